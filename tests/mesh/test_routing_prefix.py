"""``score_route_cached`` (issue 45 item 3): the prompt term counts only the positions every stage of a route
holds in its prefix cache; checked against the brute-force oracle over every covering chain."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ethen.mesh import NodeState, NoRouteAvailable, Route, RouteWeights, RoutingRequest, score_route
from ethen.mesh.routing import InvalidMeshInput, score_route_cached
from tests.mesh import oracle
from tests.mesh.strategies import NODE_IDS, latencies, loads, node_states, scores, weights, windows

PROPERTY = settings(max_examples=400, deadline=None)
PROMPT = 3000


def exact_cost(route: Route) -> Fraction:
    return sum((Fraction(t) for s in route.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)),
               Fraction(0))


Cached = dict[str, dict[int, int]]


def held_by(states: list[NodeState], stages: tuple[tuple[str, int, int], ...], cached: Cached) -> int:
    """Positions every stage holds: the minimum over the fragments the chain runs (inside its stages)."""
    frags = {s.node_id: s.served_layers for s in states}
    return min(cached.get(n, {}).get(a, 0) for n, first, last in stages for a, b in frags[n]
               if first <= a and b <= last)


def oracle_best(states: list[NodeState], window: tuple[int, int] | None, w: RouteWeights, prompt: int,
                cached: Cached) -> tuple[tuple[Fraction, int, tuple[str, ...], tuple[int, ...]],
                                         tuple[tuple[str, int, int], ...], int] | None:
    """Every covering chain priced with its own cached tokens."""
    win = oracle.window_of(states, window)
    if win is None:
        return None
    full = Fraction(w.prompt * 10.0 * prompt / 1024)
    best = None
    for c in oracle.enumerate_routes(states, win, w, prompt):
        held = held_by(states, c.stages, cached)
        cost = c.exact_cost - full + Fraction(w.prompt * 10.0 * (prompt - held) / 1024)
        key = (cost, len(c.stages), c.nodes, tuple(f for _, f, _ in c.stages))
        if best is None or key < best[0]:
            best = (key, c.stages, held)
    return best


amounts = st.sampled_from([0, 64, 512, 1024, 2944])


@st.composite
def worker_states(draw: st.DrawFn, max_nodes: int = 5) -> list[NodeState]:
    """Small meshes whose nodes' fragments do not overlap (as a worker's never do)."""
    ids = draw(st.lists(st.sampled_from(NODE_IDS), min_size=2, max_size=max_nodes, unique=True))
    out = []
    for node_id in ids:
        cuts = sorted({0, 8} | draw(st.sets(st.integers(1, 7), max_size=3)))
        keep = st.sampled_from([True, True, True, False])
        frags = [(a, b - 1) for a, b in itertools.pairwise(cuts) if draw(keep)]
        out.append(NodeState(node_id, draw(latencies), draw(loads), draw(scores), frags,
                             draw(st.sampled_from([True, True, True, False]))))
    return out


@st.composite
def cached_maps(draw: st.DrawFn, states: list[NodeState]) -> Cached:
    return {s.node_id: {a: draw(amounts) for a, _ in s.served_layers} for s in states if draw(st.booleans())}


# prompt weights up to 50: a held prefix then outweighs a hop or a slower node, so the choice moves
prompt_weights = st.one_of(weights, st.builds(
    RouteWeights, latency=st.sampled_from([0.0, 1.0]), load=st.sampled_from([0.0, 1.0]),
    capacity=st.sampled_from([0.0, 0.1]), hop=st.sampled_from([0.0, 0.3, 1.0]),
    prompt=st.sampled_from([1.0, 10.0, 50.0])))


@PROPERTY
@given(st.data(), st.one_of(st.none(), windows), prompt_weights)
def test_the_cached_route_is_the_oracles_over_every_chain(data: st.DataObject,
                                                          window: tuple[int, int] | None,
                                                          w: RouteWeights) -> None:
    states = data.draw(worker_states())
    cached = data.draw(cached_maps(states))
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
    assert route.cached_tokens == held
    plain = score_route(RoutingRequest(window, PROMPT), states, w)
    event(f"holds a prefix: {held > 0}; not the cache-blind route: {route.stages != plain.stages}")
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
    route = score_route_cached(request, states, w, cached={"b": {0: 1024}, "c": {0: 512}})
    assert route.nodes == ("b",)
    assert route.cached_tokens == 1024
    assert route.stages[0].prefill_cost == w.prefill_cost(1500 - 1024)
    assert route.prefix_holders == (("b", 1024), ("c", 512))
    assert route.to_dict()["prefix_holders"] == {"b": 1024, "c": 512}
    assert "prefix holders: b (1024 tokens), c (512 tokens)" in route.reason
    assert "a" in route.rejected.not_cheapest
    # a prefix held by one stage of a chain only is no saving: c holds 0-14, nobody else holds 15-29
    half = score_route_cached(request, [node("a", 1.0, (0, 29)), node("c", 0.5, (0, 14)),
                                        node("d", 0.5, (15, 29))], w, cached={"c": {0: 1024}})
    assert half.cached_tokens == 0
    # a node holds the prefix on one fragment only: a chain running that fragment there can use it
    mixed = [node("m", 1.0, (0, 14), (15, 29)), node("t", 1.0, (15, 29))]
    split = score_route_cached(request, mixed, RouteWeights(latency=1.0, load=0.0, capacity=0.0, prompt=30.0),
                               cached={"m": {0: 1024, 15: 0}, "t": {15: 1024}})
    assert [(s.node_id, s.first, s.last) for s in split.stages] == [("m", 0, 14), ("t", 15, 29)]
    assert split.cached_tokens == 1024


def test_a_bad_cached_amount_names_the_node() -> None:
    with pytest.raises(InvalidMeshInput, match=r"cached\['a'\]\[0\] = -1"):
        score_route_cached(RoutingRequest(None, 10), [node("a", 1.0, (0, 3))], cached={"a": {0: -1}})
    with pytest.raises(InvalidMeshInput, match="prompt_tokens=10"):
        score_route_cached(RoutingRequest(None, 10), [node("a", 1.0, (0, 3))], cached={"a": {0: 64}})
