"""``score_route`` behaviour, one rule per test (spec §2-5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ethen.mesh import (
    DEFAULT_MODEL,
    NodeState,
    NoRouteAvailable,
    Route,
    RouteWeights,
    RoutingRequest,
    score_route,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mesh-states.json"
# Node term = latency exactly (no load or capacity term), to make costs easy to read.
LATENCY_ONLY = RouteWeights(latency=1.0, load=0.0, capacity=0.0)


def node(node_id: str, latency: float, *layers: tuple[int, int], alive: bool = True) -> NodeState:
    return NodeState(node_id, latency, 0.0, 1.0, list(layers), alive)


def spec_mesh() -> list[NodeState]:
    return [
        NodeState("gpu", 40, 0.8, 10, [(0, 3)]),
        NodeState("mini", 6, 0.2, 6, [(0, 3), (4, 7)]),
        NodeState("laptop", 9, 0.0, 3, [(8, 11)]),
    ]


def test_score_route_prefers_the_cheapest_covering_pipeline():
    """Spec §4: mini (0-7) -> laptop (8-11) costs 71.5 and beats gpu -> mini -> laptop (226.0)."""
    route = score_route(RoutingRequest(), spec_mesh())
    assert route.nodes == ("mini", "laptop")
    assert [(s.node_id, s.first, s.last) for s in route.stages] == [("mini", 0, 7), ("laptop", 8, 11)]
    assert route.cost == pytest.approx(71.5, abs=1e-9)
    assert route.hops() == 1
    assert route.window == (0, 11)
    assert [round(s.node_cost, 1) for s in route.stages] == [35.8, 20.7]
    assert route.rejected.not_cheapest == {"gpu"}
    # The longer pipeline of the spec's table costs 226.0 with the same weights.
    w = RouteWeights()
    gpu, mini, laptop = spec_mesh()
    longer = w.node_cost(gpu) + w.node_cost(mini) + w.node_cost(laptop) + 2 * w.hop_cost()
    assert longer == pytest.approx(226.0, abs=0.05)
    assert round(w.node_cost(gpu), 1) == 139.5


def test_the_shipped_example_mesh_is_the_spec_example():
    from ethen.mesh import node_states_from_json

    states = node_states_from_json(json.loads(EXAMPLE.read_text()))
    route = score_route(RoutingRequest((0, 11)), states)
    assert route.nodes == ("mini", "laptop")
    assert route.cost == pytest.approx(71.5, abs=1e-9)


def test_window_of_the_tail_can_be_a_single_node():
    route = score_route(RoutingRequest((8, 11)), spec_mesh())
    assert route.nodes == ("laptop",)
    assert route.hops() == 0
    assert route.cost == pytest.approx(9 + 0 + 35 / 3)


def test_contiguous_fragments_of_one_node_are_one_stage_costed_once():
    states = [node("m", 10, (0, 3), (4, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.stages == route.stages[:1]
    assert (route.stages[0].first, route.stages[0].last) == (0, 7)
    assert route.cost == 10.0  # not 10 + 10 + 15


def test_a_node_that_reappears_later_counts_again():
    states = [node("a", 2, (0, 3), (8, 11)), node("b", 5, (4, 7))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "b", "a")
    assert route.cost == 2 + 5 + 2 + 2 * 15


def test_a_node_cannot_enter_in_the_middle_of_a_fragment():
    # b's fragment 2-7 starts inside a's 0-3: continuing at layer 4 needs a fragment starting at 4.
    states = [node("a", 1, (0, 3)), node("b", 1, (2, 7))]
    with pytest.raises(NoRouteAvailable, match="layers 0-7"):
        score_route(RoutingRequest(), states)


def test_a_fragment_reaching_outside_the_window_is_not_used():
    states = [node("wide", 1, (6, 11)), node("tail", 50, (8, 11))]
    route = score_route(RoutingRequest((8, 11)), states, LATENCY_ONLY)
    assert route.nodes == ("tail",)
    assert route.rejected.outside_window == {"wide"}
    with pytest.raises(NoRouteAvailable, match="layers 8-10"):
        score_route(RoutingRequest((8, 10)), states)


def test_dead_nodes_are_ignored():
    states = [node("cheap", 1, (0, 11), alive=False), node("dear", 99, (0, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("dear",)
    assert route.rejected.dead == {"cheap"}


def test_default_window_spans_the_layers_served_by_live_nodes():
    states = [node("x", 1, (2, 5)), node("y", 1, (6, 9)), node("dead", 1, (0, 20), alive=False)]
    assert score_route(RoutingRequest(), states).window == (2, 9)


def test_no_route_names_the_window():
    states = [node("a", 1, (0, 3)), node("c", 1, (8, 11))]
    with pytest.raises(NoRouteAvailable, match=r"layers 0-11.*up to layer 3.*starts at layer 4") as info:
        score_route(RoutingRequest(), states)
    assert info.value.window == (0, 11)
    assert info.value.reached == 4
    with pytest.raises(NoRouteAvailable, match="layers 20-30"):
        score_route(RoutingRequest((20, 30)), states)


def test_no_live_node_means_no_window():
    with pytest.raises(NoRouteAvailable, match="no live node serves any layer") as info:
        score_route(RoutingRequest(), [node("a", 1, (0, 3), alive=False)])
    assert info.value.window is None
    assert "covers no window" not in str(info.value)  # the message reads as a sentence
    with pytest.raises(NoRouteAvailable):
        score_route(RoutingRequest(), [])


def test_capacity_below_the_floor_is_clamped():
    w = RouteWeights()
    costs = {
        w.node_cost(NodeState("n", 0, 0, score, [(0, 0)]))
        for score in (0.01, 0.001, 0.0, -3.0)
    }
    assert costs == {0.35 * 100 / 0.01}


def test_empty_route_costs_infinity():
    route = Route(stages=(), model="m", window=None)
    assert route.cost == math.inf
    assert route.hops() == 0
    assert route.nodes == ()


def test_an_empty_route_needs_no_model_or_window():
    route = Route(())
    assert route.cost == math.inf  # spec §2: empty route -> infinity
    assert route.model == DEFAULT_MODEL and route.window is None
    assert Route().cost == math.inf


def test_no_route_available_names_the_window_as_a_range_and_as_a_tuple():
    with pytest.raises(NoRouteAvailable) as info:
        score_route(RoutingRequest((0, 20)), spec_mesh())
    assert str(info.value).startswith("no route covers layers 0-20 (window (0, 20)): ")
    assert info.value.window == (0, 20)


def test_score_route_accepts_a_mapping_of_states_and_health_dicts():
    expected = score_route(RoutingRequest(), spec_mesh())
    by_id = {s.node_id: s for s in spec_mesh()}
    assert score_route(RoutingRequest(), by_id) == expected
    dicts = [s.to_dict() for s in spec_mesh()]
    assert score_route(RoutingRequest(), dicts) == expected
    assert score_route(RoutingRequest(), {d["node_id"]: d for d in dicts}) == expected
    mixed = [spec_mesh()[0], dicts[1], dicts[2]]
    assert score_route(RoutingRequest(), mixed).nodes == ("mini", "laptop")


def test_prompt_tokens_add_the_prefill_term_without_changing_the_choice():
    base = score_route(RoutingRequest(), spec_mesh())
    long = score_route(RoutingRequest(prompt_tokens=2048), spec_mesh())
    assert long.nodes == base.nodes
    assert long.cost == pytest.approx(base.cost + 20.0)
    assert long.stages[0].prefill_cost == 20.0
    assert long.prompt_tokens == 2048


def test_weights_change_the_choice():
    # One slow node vs two fast nodes: the hop weight decides.
    states = [node("whole", 30, (0, 7)), node("head", 5, (0, 3)), node("tail", 5, (4, 7))]
    assert score_route(RoutingRequest(), states, LATENCY_ONLY).nodes == ("head", "tail")  # 5+5+15 < 30
    heavy = RouteWeights(latency=1.0, load=0.0, capacity=0.0, hop=2.0)
    assert score_route(RoutingRequest(), states, heavy).nodes == ("whole",)  # 5+5+30 > 30
    assert score_route(RoutingRequest(), states, heavy).weights == heavy


def test_ties_go_to_fewer_stages():
    no_hop = RouteWeights(latency=1.0, load=0.0, capacity=0.0, hop=0.0)
    states = [node("b", 4, (0, 3)), node("c", 6, (4, 7)), node("z", 10, (0, 7))]
    assert score_route(RoutingRequest(), states, no_hop).nodes == ("z",)


def test_ties_then_go_to_node_ids_in_lexicographic_order():
    states = [node("m2", 3, (0, 7)), node("m1", 3, (0, 7)), node("M", 3, (0, 7))]
    assert score_route(RoutingRequest(), states, LATENCY_ONLY).nodes == ("M",)  # "M" < "m1" < "m2"
    states = [node("b", 1, (0, 3)), node("a", 1, (0, 3)), node("d", 1, (4, 7)), node("c", 1, (4, 7))]
    assert score_route(RoutingRequest(), states, LATENCY_ONLY).nodes == ("a", "c")


def test_exact_ties_are_not_decided_by_float_rounding():
    """Costs (0.1, 0.2, 1.1) and (0.1, 1.1, 0.2) tie exactly, though left-to-right float sums differ."""
    assert (0.1 + 0.2 + 15) + 1.1 + 15 != (0.1 + 1.1 + 15) + 0.2 + 15
    states = [
        node("a", 0.1, (0, 0)), node("b", 0.2, (1, 1)), node("c", 1.1, (2, 4)),
        node("d", 0.1, (0, 2)), node("e", 1.1, (3, 3)), node("f", 0.2, (4, 4)),
    ]  # fmt: skip
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert route.nodes == ("a", "b", "c")  # lexicographically first of the two exact-cost ties


def test_same_nodes_different_split_prefers_the_earliest_hand_off():
    states = [node("a", 1, (0, 3), (0, 7)), node("b", 1, (4, 11), (8, 11))]
    route = score_route(RoutingRequest(), states, LATENCY_ONLY)
    assert [(s.node_id, s.first, s.last) for s in route.stages] == [("a", 0, 3), ("b", 4, 11)]


def test_route_reports_model_and_reason():
    route = score_route(RoutingRequest(), spec_mesh(), model="smollm2")
    assert route.model == "smollm2"
    assert not route.degraded
    assert "0-11" in route.reason
    data = route.to_dict()
    assert data["nodes"] == ["mini", "laptop"]
    assert sum(s["cost"] for s in data["stages"]) == pytest.approx(data["cost"])


def test_the_package_namespace_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, ethen.mesh; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'numpy', 'networkx')); print(heavy); assert not heavy"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import ethen.mesh

    assert {"NodeState", "RoutingRequest", "RouteWeights", "Route", "score_route", "failover",
            "NoRouteAvailable", "RoutingFailure"} <= set(ethen.mesh.__all__)  # fmt: skip
