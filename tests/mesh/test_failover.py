"""``failover`` (spec §6): one test per rule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.mesh import (
    NodeState,
    NoRouteAvailable,
    Route,
    RouteWeights,
    RoutingFailure,
    RoutingRequest,
    failover,
    score_route,
)
from ethen.mesh.routing import redundancy_map_from_states
from tests.mesh.strategies import node_states, weights, windows

LATENCY_ONLY = RouteWeights(latency=1.0, load=0.0, capacity=0.0)


def node(node_id: str, latency: float, *layers: tuple[int, int], alive: bool = True) -> NodeState:
    return NodeState(node_id, latency, 0.0, 1.0, list(layers), alive)


def segments(route: Route) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.first, s.last) for s in route.stages]


def mark_dead(states: list[NodeState], node_id: str) -> list[NodeState]:
    return [NodeState(s.node_id, s.latency_ms, s.current_load, s.capacity_score, s.served_layers,
                      s.alive and s.node_id != node_id) for s in states]  # fmt: skip


def test_rule1_a_node_outside_the_route_leaves_it_unchanged_with_a_reason():
    states = [node("a", 1, (0, 7)), node("idle", 50, (0, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    same = failover(route, redundancy_map_from_states(states), "idle", states, LATENCY_ONLY)
    assert same == route  # Route.reason takes no part in equality
    assert same.stages == route.stages
    assert same.cost == route.cost
    assert not same.degraded
    assert "no participa en la ruta" in same.reason  # the spec's phrase (§6.1)
    assert same.reason == ("node 'idle' no participa en la ruta (does not take part in the route); "
                           "route unchanged")
    assert same.reason != route.reason
    # Not an error even for a node nobody knows.
    assert failover(route, {}, "ghost", states).stages == route.stages


def test_rule2_the_failed_layers_come_from_the_node_state():
    # The telemetry says b holds 4-7; the (stale) redundancy map says nothing about b.
    states = [node("a", 1, (0, 3)), node("b", 1, (4, 7)), node("c", 5, (4, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "b")
    stale_map = {4: ["c"], 5: ["c"], 6: ["c"], 7: ["c"]}
    new = failover(route, stale_map, "b", states, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 3), ("c", 4, 7)]
    assert "held layers 4-7 of window 0-7 per its telemetry" in new.reason


def test_rule2_without_a_node_state_the_layers_come_from_the_redundancy_map_clipped_to_the_window():
    states = [node("a", 1, (0, 3)), node("b", 1, (4, 7), (8, 9)), node("c", 5, (4, 7))]
    route = score_route(RoutingRequest((0, 7)), states, LATENCY_ONLY)
    full_map = redundancy_map_from_states(states)
    survivors = [s for s in states if s.node_id != "b"]  # no telemetry for b any more
    new = failover(route, full_map, "b", survivors, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 3), ("c", 4, 7)]
    assert "held layers 4-7 of window 0-7 per the redundancy map" in new.reason  # 8-9 clipped away


def test_rule2_layers_the_failed_node_holds_but_another_stage_runs_keep_their_stage():
    # gpu holds 0-3 and 8-11, but the route runs 8-11 on laptop: only 0-3 needs a substitute.
    states = [node("gpu", 1, (0, 3), (8, 11)), node("mini", 1, (0, 3), (4, 7)), node("laptop", 1, (8, 11)),
              node("spare", 3, (0, 3))]  # fmt: skip
    route = Route(
        stages=score_route(RoutingRequest((0, 3)), [states[0]], LATENCY_ONLY).stages
        + score_route(RoutingRequest((4, 11)), states[1:3], LATENCY_ONLY).stages,
        model="m",
        window=(0, 11),
    )
    assert segments(route) == [("gpu", 0, 3), ("mini", 4, 7), ("laptop", 8, 11)]
    new = failover(route, redundancy_map_from_states(states), "gpu", states, LATENCY_ONLY)
    assert "held layers 0-3, 8-11 of window 0-11 per its telemetry" in new.reason
    assert "layers 0-3 moved to mini" in new.reason
    assert segments(new) == [("mini", 0, 7), ("laptop", 8, 11)]  # laptop keeps 8-11


def test_rule3_the_cheapest_live_holder_takes_the_failed_nodes_place():
    states = [
        node("head", 1, (0, 3)), node("mid", 1, (4, 7)), node("tail", 1, (8, 11)),
        node("dear", 30, (4, 7)), node("cheap", 10, (4, 7)), node("deadcheap", 0, (4, 7), alive=False),
    ]  # fmt: skip
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("head", "mid", "tail")
    new = failover(route, redundancy_map_from_states(states), "mid", mark_dead(states, "mid"), LATENCY_ONLY)
    assert segments(new) == [("head", 0, 3), ("cheap", 4, 7), ("tail", 8, 11)]
    assert new.cost == 1 + 10 + 1 + 2 * 15
    assert not new.degraded
    assert "layers 4-7 moved to cheap" in new.reason
    assert "mid" in new.rejected.dead


def test_rule3_holders_are_chosen_per_layer_and_ties_go_to_the_lower_id():
    states = [node("a", 1, (0, 1)), node("x", 1, (2, 5)), node("p", 4, (2, 3)), node("q", 3, (4, 5)),
              node("r", 3, (4, 5))]  # fmt: skip
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "x")
    new = failover(route, redundancy_map_from_states(states), "x", states, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 1), ("p", 2, 3), ("q", 4, 5)]  # q and r tie at 3: q wins


def test_rule3_only_consecutive_duplicates_collapse():
    # gpu fails; its substitute for 0-3 is laptop, which also runs the tail: it reappears, not merged away.
    states = [node("gpu", 1, (0, 3)), node("mini", 1, (4, 7)), node("laptop", 5, (0, 3), (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("gpu", "mini", "laptop")
    new = failover(route, redundancy_map_from_states(states), "gpu", states, LATENCY_ONLY)
    assert segments(new) == [("laptop", 0, 3), ("mini", 4, 7), ("laptop", 8, 11)]
    # A substitute adjacent to its own stage merges into one stage (no hop between them).
    states = [node("mini", 1, (0, 7)), node("laptop", 1, (8, 11)), node("spare", 20, (0, 7), (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("mini", "laptop")
    new = failover(route, redundancy_map_from_states(states), "mini", states, LATENCY_ONLY)
    assert segments(new) == [("spare", 0, 7), ("laptop", 8, 11)]
    states = [node("head", 1, (0, 3)), node("x", 1, (4, 7)), node("laptop", 5, (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("head", "x", "laptop")
    new = failover(route, {layer: ["x", "laptop"] for layer in range(4, 8)}, "x", states, LATENCY_ONLY)
    assert segments(new) == [("head", 0, 3), ("laptop", 4, 11)]
    assert new.cost == 1 + 5 + 15


def test_rule4_a_missing_layer_with_a_fallback_model_gives_a_degraded_route():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("c", 3, (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = redundancy_map_from_states(states)
    new = failover(route, rmap, "b", states, LATENCY_ONLY, fallback_model="tiny")
    assert new.degraded
    assert new.model == "tiny"
    assert segments(new) == [("a", 0, 3), ("c", 8, 11)]
    assert new.cost == 1 + 3 + 15
    assert "no live holder for layers 4-7" in new.reason and "'tiny'" in new.reason


def test_rule4_degraded_without_survivors_is_an_empty_route_costing_infinity():
    states = [node("solo", 1, (0, 7))]
    route = score_route(RoutingRequest(), states)
    new = failover(route, redundancy_map_from_states(states), "solo", states, fallback_model="tiny")
    assert new.degraded and new.stages == () and new.cost == math.inf


def test_rule4_a_missing_layer_without_a_fallback_model_raises_routing_failure():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("spare", 2, (4, 5))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    with pytest.raises(RoutingFailure, match="no live holder for layers 6-7") as info:
        failover(route, redundancy_map_from_states(states), "b", states, LATENCY_ONLY)
    assert info.value.failed_node == "b"
    assert info.value.missing_layers == (6, 7)


def test_dead_holders_are_never_substitutes():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("dead", 1, (4, 7), alive=False)]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = {layer: ["b", "dead"] for layer in range(4, 8)}
    with pytest.raises(RoutingFailure):
        failover(route, rmap, "b", states)


def test_rule3_a_priced_live_holder_beats_one_without_telemetry():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("pricey", 90, (4, 7)),
              node("dead", 1, (4, 7), alive=False)]  # fmt: skip
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = {layer: ["b", "dead", "aaa-unknown", "pricey"] for layer in range(4, 8)}
    new = failover(route, rmap, "b", states, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 3), ("pricey", 4, 7)]
    assert new.cost == 1 + 90 + 15


def test_rule3_a_holder_without_telemetry_is_used_unpriced_when_no_priced_holder_exists():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("dead", 1, (4, 7), alive=False)]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = {layer: ["b", "dead", "zed", "unknown"] for layer in range(4, 8)}
    new = failover(route, rmap, "b", states, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 3), ("unknown", 4, 7)]  # ties by id; dead never used
    assert new.stages[1].node_cost == 0.0  # unpriced, and it had no stage in the route
    assert new.cost == 1 + 0 + 15
    assert "moved to unknown (unknown without telemetry, so unpriced)" in new.reason
    assert not new.degraded


def test_an_unpriced_substitute_that_already_had_a_stage_keeps_its_old_node_cost():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("c", 7, (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "b", "c")
    rmap = {layer: ["b", "c"] for layer in range(4, 8)}
    new = failover(route, rmap, "b")  # no telemetry at all: c is unpriced but was in the route
    assert segments(new) == [("a", 0, 3), ("c", 4, 11)]
    assert [s.node_cost for s in new.stages] == [1, 7]
    assert new.cost == 1 + 7 + 15


def test_failover_without_states_finds_a_substitute_from_the_map():
    states = [node("gpu", 1, (0, 3)), node("mini", 1, (4, 7)), node("laptop", 5, (0, 3), (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = redundancy_map_from_states(states)
    new = failover(route, rmap, "gpu")
    assert segments(new) == [("laptop", 0, 3), ("mini", 4, 7), ("laptop", 8, 11)]
    assert [s.node_cost for s in new.stages] == [5, 1, 5]  # old node terms, kept
    assert "held layers 0-3 of window 0-11 per the redundancy map" in new.reason


def test_failover_without_states_and_no_holder_fails_or_degrades():
    states = [node("gpu", 1, (0, 3)), node("mini", 1, (4, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    rmap = redundancy_map_from_states(states)
    with pytest.raises(RoutingFailure, match="no live holder for layers 0-3"):
        failover(route, rmap, "gpu")
    new = failover(route, rmap, "gpu", fallback_model="tiny")
    assert new.degraded and new.model == "tiny" and segments(new) == [("mini", 4, 7)]
    assert failover(route, rmap, "idle") == route


def test_a_node_keyed_redundancy_map_is_inverted():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("c", 3, (4, 5)), node("d", 4, (6, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "b")
    rmap = {"a": [(0, 3)], "b": [[4, 7]], "c": [(4, 5), 99], "d": [6, 7]}
    new = failover(route, rmap, "b", states, LATENCY_ONLY)
    assert segments(new) == [("a", 0, 3), ("c", 4, 5), ("d", 6, 7)]
    assert "held layers 4-7 of window 0-7 per its telemetry" in new.reason
    new = failover(route, rmap, "b", [], LATENCY_ONLY)  # layers of b from the node-keyed map
    assert "held layers 4-7 of window 0-7 per the redundancy map" in new.reason
    assert segments(new) == [("a", 0, 3), ("c", 4, 5), ("d", 6, 7)]


@pytest.mark.parametrize(
    ("rmap", "message"),
    [
        ({"a": [(3, 1)]}, r"redundancy_map\['a'\] entry is inverted"),
        ({"a": ["x"]}, r"redundancy_map\['a'\] must hold layers or \(first, last\) pairs, got 'x'"),
        ({"a": [(1, 2, 3)]}, r"redundancy_map\['a'\] entry must be a \(first, last\) pair"),
        ({"a": "0-3"}, r"redundancy_map\['a'\] must be a collection of layers"),
        ({"a": 3}, r"redundancy_map\['a'\] must be a collection of layers"),
        ({"a": [-1]}, r"redundancy_map\['a'\] layer must be >= 0"),
        ({"a": [(0, 3)], 4: ["b"]}, "redundancy_map keyed by node ids has an invalid node id key 4"),
        ({"": [(0, 3)]}, "invalid node id key ''"),
    ],
)
def test_a_malformed_node_keyed_map_is_refused_naming_the_key(rmap, message):
    states = [node("a", 1, (0, 3))]
    route = score_route(RoutingRequest(), states)
    with pytest.raises(ValueError, match=message):
        failover(route, rmap, "a", states)


def test_failover_recomputes_costs_with_the_given_weights_and_keeps_the_prompt():
    states = [node("a", 1, (0, 3)), node("b", 2, (4, 7)), node("c", 4, (4, 7))]
    route = score_route(RoutingRequest(prompt_tokens=1024), states, LATENCY_ONLY)
    w = RouteWeights(latency=2.0, load=0.0, capacity=0.0, hop=0.5)
    new = failover(route, redundancy_map_from_states(states), "b", states, w)
    assert new.cost == pytest.approx(2 + 8 + 7.5 + 10)
    assert new.prompt_tokens == 1024 and new.window == (0, 7) and new.weights == w


def test_failover_refuses_bad_input():
    states = [node("a", 1, (0, 3))]
    route = score_route(RoutingRequest(), states)
    with pytest.raises(ValueError, match="failed_node must be a non-empty node id"):
        failover(route, {}, "", states)
    with pytest.raises(ValueError, match=r"redundancy_map\[0\] must be a collection of node ids"):
        failover(route, {0: "a"}, "a", states)
    with pytest.raises(ValueError, match="redundancy_map key must be a layer number"):
        failover(route, {0: ["a"], "1": ["a"]}, "a", states)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"redundancy_map\['0'\] must hold layers or \(first, last\) pairs"):
        failover(route, {"0": ["a"]}, "a", states)
    with pytest.raises(ValueError, match="route must be a Route"):
        failover(None, {}, "a", states)  # type: ignore[arg-type]


@settings(max_examples=500, deadline=None)
@given(node_states(), windows, weights, st.data())
def test_failover_keeps_coverage_or_degrades_or_fails(states, window, w, data):
    """Property: after failover the failed node is gone; the route still covers the window, or is degraded."""
    try:
        route = score_route(RoutingRequest(window), states, w)
    except NoRouteAvailable:
        return
    failed = data.draw(st.sampled_from(route.nodes))
    rmap = redundancy_map_from_states(states)
    try:
        fallback = data.draw(st.sampled_from([None, "fb"]))
        new = failover(route, rmap, failed, states, w, fallback_model=fallback)
    except RoutingFailure as exc:
        assert exc.missing_layers
        return
    assert failed not in new.nodes
    stages = [(s.node_id, s.first, s.last) for s in new.stages]
    if new.degraded:
        assert new.model == "fb"
        assert set(stages) <= {(s.node_id, s.first, s.last) for s in route.stages}
        return
    assert new.stages[0].first == route.window[0] and new.stages[-1].last == route.window[1]
    for before, after in zip(new.stages, new.stages[1:], strict=False):
        assert after.first == before.last + 1
        assert after.node_id != before.node_id  # consecutive duplicates collapsed
    for s in new.stages:  # every substitute layer is held by that node per the redundancy map
        assert all(s.node_id in rmap[layer] for layer in range(s.first, s.last + 1))
    assert new.cost == math.fsum(t for s in new.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost))
