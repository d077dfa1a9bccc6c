"""Bad input is an ``InvalidMeshInput`` (a ``ValueError``) naming the field; §7 health JSON parsing."""

from __future__ import annotations

import math

import pytest

from ethen.mesh import (
    InvalidMeshInput,
    MeshRoutingError,
    NodeState,
    RouteWeights,
    RoutingRequest,
    node_states_from_json,
    score_route,
)

GOOD = {
    "node_id": "mini",
    "latency_ms": 6.4,
    "current_load": 0.2,
    "capacity_score": 13.0,
    "served_layers": [[7, 9]],
    "alive": True,
}


def test_bad_input_errors_are_value_errors_in_the_package_tree():
    assert issubclass(InvalidMeshInput, ValueError)
    assert issubclass(InvalidMeshInput, MeshRoutingError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"served_layers": [(5, 2)]}, r"served_layers\[0\] is inverted: first layer 5 > last layer 2"),
        ({"served_layers": [(-1, 2)]}, r"served_layers\[0\] first layer must be >= 0"),
        ({"served_layers": [(1, 2, 3)]}, r"served_layers\[0\] must be a \(first, last\) pair"),
        ({"served_layers": "0-3"}, "served_layers must be a list"),
        ({"latency_ms": -1.0}, "latency_ms must be >= 0, got -1.0"),
        ({"latency_ms": math.nan}, "latency_ms must not be NaN"),
        ({"latency_ms": math.inf}, "latency_ms must be finite"),
        ({"latency_ms": "6"}, "latency_ms must be a number, got '6'"),
        ({"current_load": -0.5}, "current_load must be >= 0"),
        ({"current_load": math.nan}, "current_load must not be NaN"),
        ({"capacity_score": math.nan}, "capacity_score must not be NaN"),
        ({"node_id": ""}, "node_id must be a non-empty string"),
        ({"node_id": "  "}, "node_id must be a non-empty string"),
        ({"alive": "yes"}, "alive must be true or false"),
        # ints beyond the float range (JSON allows them): a ValueError, not an OverflowError
        ({"latency_ms": 10**400}, "latency_ms must be finite, got an integer of 401 digits"),
        ({"current_load": 10**400}, "current_load must be finite"),
        ({"capacity_score": 10**400}, "capacity_score must be finite"),
        ({"served_layers": [(0, 2**63)]}, r"served_layers\[0\] last layer must be <= 9223372036854775807"),
    ],
)
def test_node_state_refuses_bad_fields(kwargs, message):
    fields = {"node_id": "n", "latency_ms": 1.0, "current_load": 0.0, "capacity_score": 1.0,
              "served_layers": [(0, 1)], **kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        NodeState(**fields)


def test_duplicate_node_id_is_refused():
    states = [NodeState("n", 1, 0, 1, [(0, 1)]), NodeState("n", 2, 0, 1, [(0, 1)])]
    with pytest.raises(ValueError, match="duplicate node_id 'n'"):
        score_route(RoutingRequest(), states)
    with pytest.raises(ValueError, match=r"nodes\[1\]: duplicate node_id 'mini'"):
        node_states_from_json([GOOD, GOOD])


def test_routing_request_refuses_bad_fields():
    with pytest.raises(ValueError, match="layer_range is inverted: first layer 11 > last layer 8"):
        RoutingRequest((11, 8))
    with pytest.raises(ValueError, match="prompt_tokens must be >= 0"):
        RoutingRequest(prompt_tokens=-1)
    with pytest.raises(ValueError, match="prompt_tokens must be an integer"):
        RoutingRequest(prompt_tokens=1.5)  # type: ignore[arg-type]


def test_weights_refuse_negative_nan_and_unknown_names():
    with pytest.raises(ValueError, match="weight hop must be >= 0"):
        RouteWeights(hop=-1)
    with pytest.raises(ValueError, match="weight latency must not be NaN"):
        RouteWeights(latency=math.nan)
    with pytest.raises(ValueError, match="unknown weight 'hops'"):
        RouteWeights().with_overrides({"hops": 1.0})
    assert RouteWeights().with_overrides({"hop": 0.3}).hop == 0.3


def test_score_route_refuses_wrong_argument_types():
    with pytest.raises(ValueError, match="states must hold NodeState objects, got str"):
        score_route(RoutingRequest(), ["mini"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="states must hold NodeState objects, got int"):
        score_route(RoutingRequest(), {"mini": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"node 'mini'.*latency_ms must be >= 0"):
        score_route(RoutingRequest(), [{**GOOD, "latency_ms": -1}])
    with pytest.raises(ValueError, match="request must be a RoutingRequest"):
        score_route((0, 3), [])  # type: ignore[arg-type]


def test_huge_integers_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="weight hop must be finite"):
        RouteWeights(hop=10**400)
    with pytest.raises(ValueError, match="prompt_tokens must be <= 9223372036854775807"):
        RoutingRequest(prompt_tokens=10**400)
    with pytest.raises(ValueError, match="layer_range last layer must be <= 9223372036854775807"):
        RoutingRequest((0, 2**63))
    with pytest.raises(ValueError, match=r"nodes\[0\]: node 'mini': latency_ms must be finite"):
        node_states_from_json([{**GOOD, "latency_ms": 10**400}])
    # the bound is inclusive, and a fragment up to it is usable with no window given
    route = score_route(RoutingRequest(prompt_tokens=2**63 - 1), [NodeState("a", 1, 0, 1, [(0, 2**63 - 1)])])
    assert route.nodes == ("a",)


def test_a_prefill_term_that_overflows_is_refused():
    states = [NodeState("n", 1, 0, 1, [(0, 1)])]
    with pytest.raises(ValueError, match=r"weight prompt .* makes the prefill term overflow"):
        score_route(RoutingRequest(prompt_tokens=2**62), states, RouteWeights(prompt=1e300))


def test_a_stage_cost_that_overflows_is_refused():
    with pytest.raises(ValueError, match="node 'n': stage cost overflows"):
        score_route(RoutingRequest(), [NodeState("n", 1e308, 0, 1, [(0, 1)])], RouteWeights(latency=10.0))


def test_from_dict_reads_spec_health_json_with_extra_fields():
    data = {**GOOD, "served_requests": 12, "failed_requests": 1, "load": 0.3, "future_field": "x"}
    state = NodeState.from_dict(data)
    assert state == NodeState("mini", 6.4, 0.2, 13.0, [(7, 9)], True)
    assert state.served_layers == ((7, 9),)
    assert NodeState.from_dict(state.to_dict()) == state


def test_from_dict_defaults_alive_and_falls_back_to_data_plane_load():
    data = {k: v for k, v in GOOD.items() if k not in ("alive", "current_load")}
    state = NodeState.from_dict({**data, "load": 0.7})
    assert state.alive is True
    assert state.current_load == 0.7


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "health JSON must be an object, got list"),
        ({k: v for k, v in GOOD.items() if k != "latency_ms"}, "node 'mini'.*missing field.*latency_ms"),
        ({"node_id": "x"}, "missing field.*latency_ms, current_load, capacity_score, served_layers"),
        ({**GOOD, "served_layers": [[9, 7]]}, r"served_layers\[0\] is inverted"),
        ({**GOOD, "served_layers": [[1.5, 7]]}, r"served_layers\[0\] first layer must be an integer"),
        ({**GOOD, "served_layers": {"7": 9}}, "served_layers must be a list"),
        ({**GOOD, "latency_ms": None}, "latency_ms must be a number, got None"),
        ({**GOOD, "latency_ms": True}, "latency_ms must be a number, got True"),
        ({**GOOD, "alive": "true"}, "alive must be true or false"),
        ({**GOOD, "served_requests": -1}, "served_requests must be >= 0"),
        ({**GOOD, "load": "high"}, "load must be a number"),
        ({**GOOD, "node_id": 7}, "node_id must be a non-empty string, got 7"),
    ],
)
def test_from_dict_refuses_malformed_health_json(data, message):
    with pytest.raises(ValueError, match=message):
        NodeState.from_dict(data)


def test_from_json_refuses_invalid_json():
    with pytest.raises(ValueError, match="health JSON is not valid JSON"):
        NodeState.from_json('{"node_id": "x",')
    assert NodeState.from_json('{"node_id": "x", "latency_ms": 1, "current_load": 0, '
                               '"capacity_score": 2, "served_layers": [[0, 1]]}').node_id == "x"  # fmt: skip


def test_mesh_documents_name_the_bad_entry():
    assert len(node_states_from_json({"nodes": [GOOD]})) == 1
    with pytest.raises(ValueError, match=r"nodes\[1\]: .*latency_ms must be >= 0"):
        node_states_from_json([GOOD, {**GOOD, "node_id": "x", "latency_ms": -2}])
    with pytest.raises(ValueError, match="must have a 'nodes' list"):
        node_states_from_json({"states": []})
    with pytest.raises(ValueError, match="must be a list of objects, got str"):
        node_states_from_json("nope")


def test_a_hop_term_that_overflows_is_refused():
    with pytest.raises(ValueError, match=r"weight hop .* makes the hop term overflow"):
        score_route(RoutingRequest(), [NodeState("n", 1, 0, 1, [(0, 1)])], RouteWeights(hop=1.5e307))


def test_huge_layer_numbers_cost_nothing_extra():
    """The DP visits only boundaries where fragments start, never every layer number of the window."""
    from ethen.mesh import NoRouteAvailable

    big = r"layers 0-1000000000000000 \(window \(0, 1000000000000000\)\): .* up to layer 3"
    with pytest.raises(NoRouteAvailable, match=big) as info:
        score_route(RoutingRequest((0, 10**15)), [NodeState("a", 1, 0, 1, [(0, 3)])])
    assert info.value.reached == 4
    far = NodeState("far", 1, 0, 1, [(10**12, 10**12 + 3), (10**12 + 4, 10**13)])
    assert score_route(RoutingRequest(), [far]).window == (10**12, 10**13)


def test_served_layers_compare_equal_to_lists_and_tuples_of_pairs():
    state = NodeState.from_dict({**GOOD, "served_layers": [[7, 9], [10, 12]]})
    assert state.served_layers == [[7, 9], [10, 12]]
    assert state.served_layers == [(7, 9), (10, 12)]
    assert state.served_layers == ((7, 9), (10, 12))
    assert [[7, 9], [10, 12]] == state.served_layers  # noqa: SIM300 (the reflected comparison)
    assert (state.served_layers != [[7, 9], [10, 12]]) is False
    assert state.served_layers != [[7, 9]]
    assert state.served_layers != [[7, 9], [10, 13]]
    assert state.served_layers != [[7, 9, 1], [10, 12]]
    assert state.served_layers != "7-9"
    assert hash(state.served_layers) == hash(((7, 9), (10, 12)))
    assert isinstance(state.served_layers, tuple)
    assert state == NodeState("mini", 6.4, 0.2, 13.0, ((7, 9), (10, 12)), True)


def test_from_dict_reads_the_workers_health_reply_converted_by_message_to_dict():
    from google.protobuf.json_format import MessageToDict

    from ethen.mesh.proto import mesh_pb2

    reply = mesh_pb2.HealthResponse(
        node_id="mini",
        served_layers=[mesh_pb2.LayerRange(first=0, last=3), mesh_pb2.LayerRange(first=7, last=9)],
        latency_ms=6.4, load=0.2, served_requests=5, failed_requests=1, alive=True, capacity_score=13.0,
        active_sessions=2, cache_bytes=1024,
    )  # fmt: skip
    data = MessageToDict(reply, preserving_proto_field_name=True)
    assert data["served_requests"] == "5" and data["served_layers"][0] == {"last": 3}  # proto3 omits first=0
    state = NodeState.from_dict(data)
    assert state == NodeState("mini", 6.4, 0.2, 13.0, [(0, 3), (7, 9)], True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({**GOOD, "served_requests": "five"}, "served_requests must be an integer, got 'five'"),
        ({**GOOD, "failed_requests": "-1"}, "failed_requests must be an integer, got '-1'"),
        ({**GOOD, "served_layers": [{"first": 9, "last": 7}]}, r"served_layers\[0\] is inverted"),
        ({**GOOD, "served_layers": [{"first": "7", "last": 9}]}, r"\[0\] first layer must be an int"),
        ({**GOOD, "served_layers": [{"start": 7, "end": 9}]}, r"\[0\] must be a \[first, last\]"),
    ],
)
def test_from_dict_refuses_malformed_protobuf_json(data, message):
    with pytest.raises(ValueError, match=message):
        NodeState.from_dict(data)


def test_a_single_health_object_is_a_one_node_mesh():
    (state,) = node_states_from_json(GOOD)
    assert state.node_id == "mini"
    with pytest.raises(ValueError, match="node 'mini': latency_ms must be >= 0"):
        node_states_from_json({**GOOD, "latency_ms": -1})
    with pytest.raises(ValueError, match="must have a 'nodes' list"):
        node_states_from_json({"latency_ms": 1})


def test_layer_spans_formats_runs_once_for_the_router_and_the_gateway() -> None:
    """``layer_spans`` (failover's messages and the mesh provider's health reasons share it, issue 25)."""
    from ethen.mesh.routing import layer_spans

    assert layer_spans([5, 0, 1, 2, 2]) == "0-2, 5"
    assert layer_spans(range(3, 7)) == "3-6"
    assert layer_spans([]) == ""
