"""Brute-force oracle for ``score_route``: enumerate every covering chain of whole fragments.

Independent of the DP: it walks all chains by depth-first search, merges contiguous fragments of one node
into a stage, prices each route with exact rational arithmetic (``Fraction`` of the float terms) and sorts
by the documented total order: (exact cost, stages, node ids, stage first layers). Only for small meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ethen.mesh import NodeState, RouteWeights


def stage_cost(state: NodeState, w: RouteWeights) -> float:
    """§2.1, written out again (same float operations as the spec formula)."""
    return (
        w.latency * state.latency_ms
        + w.load * state.current_load * 120.0
        + w.capacity * 100.0 / max(state.capacity_score, 0.01)
    )


@dataclass(frozen=True)
class Candidate:
    stages: tuple[tuple[str, int, int], ...]  # (node_id, first, last)
    exact_cost: Fraction

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.stages)

    @property
    def key(self) -> tuple[Fraction, int, tuple[str, ...], tuple[int, ...]]:
        return (self.exact_cost, len(self.stages), self.nodes, tuple(f for _, f, _ in self.stages))


def window_of(states: list[NodeState], layer_range: tuple[int, int] | None) -> tuple[int, int] | None:
    if layer_range is not None:
        return layer_range
    layers = [x for s in states if s.alive for pair in s.served_layers for x in pair]
    return (min(layers), max(layers)) if layers else None


def enumerate_routes(
    states: list[NodeState], window: tuple[int, int], w: RouteWeights, prompt_tokens: int = 0
) -> list[Candidate]:
    """Every distinct route (after merging) covering ``window`` with whole fragments of live nodes."""
    first, last = window
    frags = [
        (s.node_id, a, b)
        for s in states
        if s.alive
        for a, b in s.served_layers
        if a >= first and b <= last
    ]
    cost = {s.node_id: Fraction(stage_cost(s, w)) for s in states if s.alive}
    hop = Fraction(w.hop * 15.0)
    prefill = Fraction(w.prompt * 10.0 * prompt_tokens / 1024)
    found: dict[tuple[tuple[str, int, int], ...], Candidate] = {}

    def walk(boundary: int, chain: list[tuple[str, int, int]]) -> None:
        if boundary == last + 1:
            stages: list[tuple[str, int, int]] = []
            for node, a, b in chain:
                if stages and stages[-1][0] == node:
                    stages[-1] = (node, stages[-1][1], b)
                else:
                    stages.append((node, a, b))
            total = sum((cost[n] for n, _, _ in stages), Fraction(0)) + hop * (len(stages) - 1) + prefill
            key = tuple(stages)
            found[key] = Candidate(key, total)
            return
        for node, a, b in frags:
            if a == boundary:
                chain.append((node, a, b))
                walk(b + 1, chain)
                chain.pop()

    walk(first, [])
    return sorted(found.values(), key=lambda c: c.key)


def best_route(
    states: list[NodeState], layer_range: tuple[int, int] | None, w: RouteWeights, prompt_tokens: int = 0
) -> Candidate | None:
    window = window_of(states, layer_range)
    if window is None:
        return None
    routes = enumerate_routes(states, window, w, prompt_tokens)
    return routes[0] if routes else None
