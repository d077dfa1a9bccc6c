"""``score_route_cached`` (issue 45 item 3): the prompt term counts only the positions every stage of a route
holds in its prefix cache; checked against the brute-force oracle over every covering chain."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.mesh import NodeState, NoRouteAvailable, Route, RouteWeights, RoutingRequest, score_route
from ethen.mesh.routing import InvalidMeshInput, score_route_cached
from tests.mesh import oracle
from tests.mesh.strategies import NODE_IDS, node_states, weights, windows

PROPERTY = settings(max_examples=400, deadline=None)
PROMPT = 3000


def exact_cost(route: Route) -> Fraction:
    return sum((Fraction(t) for s in route.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)),
               Fraction(0))


def oracle_best(states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, prompt: int,
                cached: dict[str, int]) -> tuple[tuple[Fraction, int, tuple[str, ...], tuple[int, ...]],
                                                 tuple[tuple[str, int, int], ...], int] | None:
    """Every covering chain priced with its own cached tokens (the minimum over its nodes)."""
    win = oracle.window_of(states, window)
    if win is None:
        return None
    full = Fraction(w.prompt * 10.0 * prompt / 1024)
    best = None
    for c in oracle.enumerate_routes(states, win, w, prompt):
        held = min(cached.get(n, 0) for n in c.nodes)
        cost = c.exact_cost - full + Fraction(w.prompt * 10.0 * (prompt - held) / 1024)
        key = (cost, len(c.stages), c.nodes, tuple(f for _, f, _ in c.stages))
        if best is None or key < best[0]:
            best = (key, c.stages, held)
    return best


cached_maps = st.dictionaries(st.sampled_from(NODE_IDS), st.sampled_from([0, 64, 512, 1024, 2944]),
                              max_size=5)


@PROPERTY
@given(node_states(), windows, weights, cached_maps)
def test_the_cached_route_is_the_oracles_over_every_chain(states: list[NodeState],
                                                          window: tuple[int, int] | None, w: RouteWeights,
                                                          cached: dict[str, int]) -> None:
    expected = oracle_best(states, window, w, PROMPT, cached)
    try:
        route = score_route_cached(RoutingRequest(window, PROMPT), states, w, cached=cached)
    except NoRouteAvailable:
        assert expected is None
        return
    assert expected is not None
    key, stages, held = expected
    assert exact_cost(route) == key[0]
    assert tuple((s.node_id, s.first, s.last) for s in route.stages) == stages
    assert route.cached_tokens == held == min(cached.get(n, 0) for n in route.nodes)
    assert route.stages[0].prefill_cost == w.prefill_cost(PROMPT - held)
    assert route.prompt_tokens == PROMPT
    # the order of the states never matters
    again = score_route_cached(RoutingRequest(window, PROMPT), list(reversed(states)), w, cached=cached)
    assert again == route


@PROPERTY
@given(node_states(), windows, weights)
def test_without_cached_prefixes_it_is_score_route(states: list[NodeState], window: tuple[int, int] | None,
                                                   w: RouteWeights) -> None:
    try:
        plain = score_route(RoutingRequest(window, PROMPT), states, w)
    except NoRouteAvailable:
        with pytest.raises(NoRouteAvailable):
            score_route_cached(RoutingRequest(window, PROMPT), states, w, cached={})
        return
    assert score_route_cached(RoutingRequest(window, PROMPT), states, w, cached={}) == plain


def node(node_id: str, latency: float, *layers: tuple[int, int]) -> NodeState:
    return NodeState(node_id, latency, 0.0, 1.0, list(layers))


def test_the_chain_holding_the_prefix_wins_and_the_explanation_names_its_holders() -> None:
    # b is 5 ms slower than a; holding 1,024 of the 1,500 prompt tokens saves 10 ms of prompt term.
    states = [node("a", 1.0, (0, 29)), node("b", 6.0, (0, 29)), node("c", 1.0, (0, 14))]
    w = RouteWeights(latency=1.0, load=0.0, capacity=0.0)
    request = RoutingRequest((0, 29), 1500)
    assert score_route(request, states, w).nodes == ("a",)
    route = score_route_cached(request, states, w, cached={"b": 1024, "c": 512})
    assert route.nodes == ("b",)
    assert route.cached_tokens == 1024
    assert route.stages[0].prefill_cost == w.prefill_cost(1500 - 1024)
    assert route.prefix_holders == (("b", 1024), ("c", 512))
    assert route.to_dict()["prefix_holders"] == {"b": 1024, "c": 512}
    assert "prefix holders: b (1024 tokens), c (512 tokens)" in route.reason
    assert "a" in route.rejected.not_cheapest
    # a prefix held by one stage of a chain only is no saving: c holds 0-14, nobody else holds 15-29
    half = score_route_cached(request, [node("a", 1.0, (0, 29)), node("c", 0.5, (0, 14)),
                                        node("d", 0.5, (15, 29))], w, cached={"c": 1024})
    assert half.cached_tokens == 0


def test_a_bad_cached_amount_names_the_node() -> None:
    with pytest.raises(InvalidMeshInput, match=r"cached\['a'\] = -1"):
        score_route_cached(RoutingRequest(None, 10), [node("a", 1.0, (0, 3))], cached={"a": -1})
    with pytest.raises(InvalidMeshInput, match="prompt_tokens=10"):
        score_route_cached(RoutingRequest(None, 10), [node("a", 1.0, (0, 3))], cached={"a": 64})
