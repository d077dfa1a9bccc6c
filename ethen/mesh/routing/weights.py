"""The cost model of spec §2: :class:`RouteWeights` and the three terms of a route's cost.

- node term (§2.1): ``w_l*latency + w_c*load*120 + w_k*100/max(score, 0.01)``
- hop term (§2.2): ``w_h*15`` for each boundary between two stages
- prefill term (§2.2): ``w_p*10*prompt_tokens/1024``, once per route

Weights must be finite and ``>= 0`` (the spec gives no meaning to a negative weight, and a negative hop
weight would reward splitting a route into more stages).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from ethen.mesh.routing._checks import check_number
from ethen.mesh.routing.errors import InvalidMeshInput

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ethen.mesh.routing.state import NodeState

__all__ = ["CAPACITY_MS", "HOP_MS", "LOAD_MS", "MIN_CAPACITY", "PREFILL_MS_PER_1K_TOKENS", "RouteWeights"]

LOAD_MS = 120.0
"""A node at 100 % load adds 120 ms-equivalent (times ``w_c``)."""
CAPACITY_MS = 100.0
"""Numerator of the capacity term: a node with score 1 adds 100 ms-equivalent (times ``w_k``)."""
MIN_CAPACITY = 0.01
"""Capacity scores below this are clamped to it."""
HOP_MS = 15.0
"""Each boundary between two stages costs 15 ms-equivalent (times ``w_h``)."""
PREFILL_MS_PER_1K_TOKENS = 10.0
"""Each 1,024 prompt tokens cost 10 ms-equivalent (times ``w_p``)."""


@dataclass(frozen=True, slots=True)
class RouteWeights:
    """Weights of the cost terms; the defaults are the spec's (§2.1 table, hop and prompt 1.0)."""

    latency: float = 1.0
    load: float = 1.0
    capacity: float = 0.35
    hop: float = 1.0
    prompt: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = check_number(f"weight {f.name}", getattr(self, f.name), non_negative=True)
            object.__setattr__(self, f.name, value)

    def with_overrides(self, overrides: Mapping[str, object]) -> RouteWeights:
        """A copy with some weights replaced; an unknown name raises ``InvalidMeshInput``."""
        names = {f.name for f in fields(self)}
        for key in overrides:
            if key not in names:
                raise InvalidMeshInput(f"unknown weight {key!r}; expected one of {', '.join(sorted(names))}")
        return replace(self, **overrides)  # type: ignore[arg-type]  # checked by __post_init__

    def node_cost(self, state: NodeState) -> float:
        """§2.1 cost of one stage run by ``state``'s node."""
        return (
            self.latency * state.latency_ms
            + self.load * state.current_load * LOAD_MS
            + self.capacity * CAPACITY_MS / max(state.capacity_score, MIN_CAPACITY)
        )

    def hop_cost(self) -> float:
        """§2.2 cost of one boundary between two stages."""
        return self.hop * HOP_MS

    def prefill_cost(self, prompt_tokens: int) -> float:
        """§2.2 prefill term, the same for every non-empty route."""
        return self.prompt * PREFILL_MS_PER_1K_TOKENS * prompt_tokens / 1024
