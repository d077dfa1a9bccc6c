"""The router's decision: a :class:`Route` of :class:`Stage` s, each carrying its share of the cost.

A route explains itself: every stage has three terms (node, hop, prefill) and ``Route.cost`` is their sum.
Attribution (the spec is silent): the hop term of a boundary goes to the stage *entering* it, so the first
stage has hop 0 and each later one ``w_h*15``; the prefill term goes to the first stage only.

``Route.cost`` is :func:`math.fsum` of all the terms, i.e. the exactly rounded sum, so it does not depend on
the order the terms are added in; an empty route costs ``inf`` (spec §2), so ``Route(()).cost`` is ``inf``.

``Route.reason`` is explanation only: it takes no part in ``==`` (a route returned unchanged by ``failover``
compares equal to the input route although its reason differs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ethen.mesh.routing.weights import RouteWeights

__all__ = ["DEFAULT_MODEL", "Rejections", "Route", "Stage", "price_stages"]

DEFAULT_MODEL: Final = "default"
"""Model name put on routes when the caller names none."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One node running layers ``first..last`` (inclusive), with its cost terms."""

    node_id: str
    first: int
    last: int
    node_cost: float
    hop_cost: float
    prefill_cost: float

    @property
    def layers(self) -> tuple[int, int]:
        return self.first, self.last

    @property
    def cost(self) -> float:
        """This stage's share of the route cost: node + hop + prefill terms."""
        return math.fsum((self.node_cost, self.hop_cost, self.prefill_cost))

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "first": self.first,
            "last": self.last,
            "node_cost": self.node_cost,
            "hop_cost": self.hop_cost,
            "prefill_cost": self.prefill_cost,
            "cost": self.cost,
        }


@dataclass(frozen=True, slots=True)
class Rejections:
    """Why each candidate node is not in the route (sets: their order never depends on the input's)."""

    dead: frozenset[str] = frozenset()
    """``alive`` is false."""
    outside_window: frozenset[str] = frozenset()
    """Live, but no fragment lies whole inside the window (fragments reaching outside it are unused)."""
    not_cheapest: frozenset[str] = frozenset()
    """Usable, but no cheapest chain goes through it (or it lost the tie-break)."""

    def to_dict(self) -> dict[str, list[str]]:
        """Node ids sorted within each reason."""
        return {
            "dead": sorted(self.dead),
            "outside_window": sorted(self.outside_window),
            "not_cheapest": sorted(self.not_cheapest),
        }


@dataclass(frozen=True, slots=True)
class Route:
    """A chain of stages covering ``window`` (a degraded route may leave gaps), for ``model``."""

    stages: tuple[Stage, ...] = ()
    model: str = DEFAULT_MODEL
    window: tuple[int, int] | None = None
    prompt_tokens: int = 0
    weights: RouteWeights = field(default_factory=RouteWeights)
    degraded: bool = False
    reason: str = field(default="", compare=False)
    rejected: Rejections = field(default_factory=Rejections)
    cached_tokens: int = 0
    """Prompt positions every stage holds in its prefix cache (issue 45): the prefill term counts the rest."""
    prefix_holders: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    """Explanation only: ``(node_id, cached prompt positions)`` per node holding a prefix of the prompt."""
    cost: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.stages:
            terms = [t for s in self.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)]
            object.__setattr__(self, "cost", math.fsum(terms))
        else:
            object.__setattr__(self, "cost", math.inf)

    @property
    def nodes(self) -> tuple[str, ...]:
        """One node id per stage, in pipeline order."""
        return tuple(s.node_id for s in self.stages)

    def hops(self) -> int:
        """Boundaries between stages: ``len(stages) - 1`` (0 for an empty route)."""
        return max(len(self.stages) - 1, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "window": list(self.window) if self.window is not None else None,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefix_holders": dict(self.prefix_holders),
            "nodes": list(self.nodes),
            "hops": self.hops(),
            "cost": self.cost if math.isfinite(self.cost) else None,
            "degraded": self.degraded,
            "reason": self.reason,
            "stages": [s.to_dict() for s in self.stages],
            "weights": {
                "latency": self.weights.latency,
                "load": self.weights.load,
                "capacity": self.weights.capacity,
                "hop": self.weights.hop,
                "prompt": self.weights.prompt,
            },
            "rejected": self.rejected.to_dict(),
        }


def price_stages(
    segments: Sequence[tuple[str, int, int]],
    node_costs: Sequence[float],
    weights: RouteWeights,
    prompt_tokens: int,
) -> tuple[Stage, ...]:
    """Stages for ``(node_id, first, last)`` segments whose node terms are ``node_costs`` (same order)."""
    hop = weights.hop_cost()
    prefill = weights.prefill_cost(prompt_tokens)
    return tuple(
        Stage(node_id, first, last, cost, hop if i else 0.0, 0.0 if i else prefill)
        for i, ((node_id, first, last), cost) in enumerate(zip(segments, node_costs, strict=True))
    )
