"""Property tests of ``score_route`` against the brute-force oracle (500 examples each)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.mesh import NodeState, NoRouteAvailable, Route, RouteWeights, RoutingRequest, score_route
from tests.mesh import oracle
from tests.mesh.strategies import node_states, weights, windows

PROPERTY = settings(max_examples=500, deadline=None)
prompts = st.sampled_from([0, 1, 512, 1024, 3000])


def route_or_none(
    states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, prompt: int = 0
) -> Route | None:
    try:
        return score_route(RoutingRequest(window, prompt), states, w)
    except NoRouteAvailable:
        return None


def exact_cost(route: Route) -> Fraction:
    return sum(
        (Fraction(t) for s in route.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)), Fraction(0)
    )


@PROPERTY
@given(node_states(), windows, weights, prompts)
def test_cost_is_optimal(
    states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, prompt: int
):
    expected = oracle.best_route(states, window, w, prompt)
    route = route_or_none(states, window, w, prompt)
    if expected is None:
        assert route is None
        return
    assert route is not None
    # Exactly the minimum over every covering chain, and Route.cost is that minimum correctly rounded.
    assert exact_cost(route) == expected.exact_cost
    assert route.cost == float(expected.exact_cost)


@PROPERTY
@given(node_states(), windows, weights)
def test_tie_break_order(states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights):
    """Among all cheapest chains: fewest stages, then node ids lexicographically, then first layers."""
    expected = oracle.best_route(states, window, w)
    route = route_or_none(states, window, w)
    # Both input orders, so that an order-dependent tie-break cannot pass by luck.
    assert route_or_none(list(reversed(states)), window, w) == route
    if expected is None:
        assert route is None
        return
    assert route is not None
    candidates = oracle.enumerate_routes(states, route.window or (0, 0), w)
    cheapest = [c for c in candidates if c.exact_cost == expected.exact_cost]
    fewest = min(len(c.stages) for c in cheapest)
    by_stages = [c for c in cheapest if len(c.stages) == fewest]
    first_nodes = min(c.nodes for c in by_stages)
    assert len(route.stages) == fewest
    assert route.nodes == first_nodes
    assert tuple((s.node_id, s.first, s.last) for s in route.stages) == expected.stages


@PROPERTY
@given(node_states(), windows, weights, st.randoms(use_true_random=False))
def test_result_does_not_depend_on_the_order_of_states(
    states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, rnd
):
    shuffled = list(states)
    rnd.shuffle(shuffled)
    first = route_or_none(states, window, w)
    second = route_or_none(shuffled, window, w)
    assert first == second
    assert route_or_none(list(reversed(states)), window, w) == first


@PROPERTY
@given(node_states(), windows, weights)
def test_route_covers_the_window_without_gaps_or_overlaps(
    states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights
):
    route = route_or_none(states, window, w)
    if route is None:
        return
    assert route.window == oracle.window_of(states, window)
    first, last = route.window
    assert route.stages[0].first == first
    assert route.stages[-1].last == last
    for before, after in zip(route.stages, route.stages[1:], strict=False):
        assert after.first == before.last + 1  # no gap, no overlap
        assert after.node_id != before.node_id  # contiguous fragments of one node are one stage
    by_id = {s.node_id: s for s in states}
    for stage in route.stages:
        node = by_id[stage.node_id]
        assert node.alive
        # The stage is tiled by whole fragments of its node, all inside the window.
        reach = {stage.first}
        for boundary in range(stage.first, stage.last + 1):
            if boundary in reach:
                reach |= {b + 1 for a, b in node.served_layers if a == boundary and b <= stage.last}
        assert stage.last + 1 in reach
    assert route.hops() == len(route.stages) - 1


@PROPERTY
@given(node_states(), windows, weights, prompts)
def test_cost_equals_the_sum_of_its_breakdown(
    states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, prompt: int
):
    route = route_or_none(states, window, w, prompt)
    if route is None:
        return
    terms = [t for s in route.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)]
    assert route.cost == math.fsum(terms)
    assert route.cost == pytest.approx(sum(s.cost for s in route.stages))
    by_id = {s.node_id: s for s in states}
    for i, stage in enumerate(route.stages):
        assert stage.node_cost == oracle.stage_cost(by_id[stage.node_id], w)
        assert stage.hop_cost == (w.hop * 15.0 if i else 0.0)
        assert stage.prefill_cost == (0.0 if i else w.prompt * 10.0 * prompt / 1024)


decimals = st.sampled_from([0.1, 0.2, 0.3, 0.7, 1.1, 2.3, 0.6, 9.9, 13.37])


@PROPERTY
@given(st.tuples(decimals, decimals, decimals), st.permutations([0, 1, 2]), st.booleans())
def test_exactly_tied_chains_are_ordered_by_node_ids_not_by_rounding(costs, perm, swap):
    """Two disjoint 3-stage chains whose stage costs are permutations of each other tie exactly."""
    w = RouteWeights(latency=1.0, load=0.0, capacity=0.0)
    other = [costs[i] for i in perm]
    lo, hi = ("a", "b", "c"), ("d", "e", "f")
    if swap:
        lo, hi = hi, lo
    states = [
        NodeState(lo[0], costs[0], 0, 1, [(0, 0)]), NodeState(lo[1], costs[1], 0, 1, [(1, 1)]),
        NodeState(lo[2], costs[2], 0, 1, [(2, 4)]), NodeState(hi[0], other[0], 0, 1, [(0, 2)]),
        NodeState(hi[1], other[1], 0, 1, [(3, 3)]), NodeState(hi[2], other[2], 0, 1, [(4, 4)]),
    ]  # fmt: skip
    assert score_route(RoutingRequest(), states, w).nodes == ("a", "b", "c")
    assert oracle.best_route(states, None, w).nodes == ("a", "b", "c")
