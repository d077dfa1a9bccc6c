"""Pure parts of the orchestrator: back-off, route recomposition, health -> NodeState, gRPC error mapping."""

from __future__ import annotations

import grpc
import pytest

from ethen.mesh import NodeState, RouteWeights, RoutingFailure, failover, redundancy_map_from_states
from ethen.mesh.orchestrator import (
    Backoff,
    DegradedRoute,
    HealthMonitor,
    NodeOverloaded,
    NodeRejected,
    NodeUnavailable,
    SessionLost,
    from_grpc,
    plan_route,
    recompose,
    runs_whole_fragments,
    state_from_health,
)
from ethen.mesh.proto import mesh_pb2

W = RouteWeights()


def test_backoff_grows_exponentially_and_resets_on_success() -> None:
    b = Backoff(base_s=1.0, factor=2.0, max_s=5.0)
    assert not b.blocked("n", 0.0)
    assert b.record_failure("n", 10.0) == 11.0
    assert b.blocked("n", 10.9) and not b.blocked("n", 11.0)
    assert b.record_failure("n", 11.0) == 13.0
    assert b.record_failure("n", 13.0) == 17.0
    assert b.record_failure("n", 17.0) == 22.0  # capped at max_s
    assert b.failures("n") == 4
    b.record_success("n")
    assert not b.blocked("n", 17.5) and b.failures("n") == 0
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0)


def test_concurrent_failure_reports_of_one_crash_count_once() -> None:
    now = [100.0]
    monitor = HealthMonitor({}, Backoff(base_s=1.0), clock=lambda: now[0])
    for _ in range(5):  # five sessions hit the same dead node in one round
        monitor.mark_failed("n")
    assert monitor.backoff.failures("n") == 1 and monitor.backoff.blocked("n", 100.5)
    now[0] = 101.5
    monitor.mark_failed("n")  # a new failure after the back-off ended: the next, longer one
    assert monitor.backoff.failures("n") == 2 and monitor.backoff.blocked("n", 103.0)


def _s(node: str, layers: list[tuple[int, int]], latency: float = 5.0, alive: bool = True) -> NodeState:
    return NodeState(node, latency, 0.0, 5.0, layers, alive)


def test_recompose_uses_failover_when_the_substitute_runs_whole_fragments() -> None:
    states = (_s("gpu", [(0, 9)], 1.0), _s("mini", [(0, 9), (10, 19)], 50.0),
              _s("laptop", [(10, 19), (20, 29)]))
    route = plan_route(states, 30, 10, W, "m")
    assert route.nodes == ("gpu", "laptop")
    new = recompose(route, "gpu", states, W, None)
    assert new.nodes == ("mini", "laptop")
    assert [(s.first, s.last) for s in new.stages] == [(0, 9), (10, 29)]
    assert new == failover(route, redundancy_map_from_states(states), "gpu",
                           [s if s.node_id != "gpu" else _s("gpu", [(0, 9)], 1.0, False) for s in states], W)


def test_recompose_reroutes_when_failover_would_split_a_fragment() -> None:
    # b's only fragment is 0-19: a per-layer substitute for a's 10-19 would enter it mid-fragment.
    states = (_s("a", [(0, 9)], 1.0), _s("c", [(10, 19)], 1.0), _s("b", [(0, 19)], 30.0), _s("d", [(20, 29)]))
    route = plan_route(states, 30, 0, W, "m")
    assert route.nodes == ("a", "c", "d")
    survivors = [s if s.node_id != "c" else _s("c", [(10, 19)], 1.0, False) for s in states]
    raw = failover(route, redundancy_map_from_states(survivors), "c", survivors, W)
    assert not runs_whole_fragments(raw, survivors)
    new = recompose(route, "c", states, W, None)
    assert new.nodes == ("b", "d")
    assert runs_whole_fragments(new, survivors)
    assert "split a fragment" in new.reason


def test_recompose_without_a_replica_fails_clearly() -> None:
    states = (_s("a", [(0, 9)]), _s("b", [(10, 29)]))
    route = plan_route(states, 30, 0, W, "m")
    with pytest.raises(RoutingFailure) as excinfo:
        recompose(route, "b", states, W, None)
    assert excinfo.value.failed_node == "b"
    assert excinfo.value.missing_layers == tuple(range(10, 30))
    with pytest.raises(DegradedRoute) as degraded:
        recompose(route, "b", states, W, "fallback-model")
    assert degraded.value.route.degraded and degraded.value.route.model == "fallback-model"
    assert "fallback-model" in str(degraded.value)


def test_state_from_health() -> None:
    reply = mesh_pb2.HealthResponse(node_id="x", latency_ms=3.5, load=0.25, capacity_score=7.0, alive=True,
                                    served_layers=[mesh_pb2.LayerRange(first=0, last=9)])
    s = state_from_health("x", reply, alive=True)
    assert (s.latency_ms, s.current_load, s.capacity_score, s.served_layers, s.alive) == (
        3.5, 0.25, 7.0, ((0, 9),), True)
    assert not state_from_health("x", reply, alive=False).alive
    assert not state_from_health("x", None, alive=True).alive


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "boom"


@pytest.mark.parametrize(("code", "kind"), [
    (grpc.StatusCode.UNAVAILABLE, NodeUnavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, NodeUnavailable),
    (grpc.StatusCode.NOT_FOUND, SessionLost),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, NodeOverloaded),
    (grpc.StatusCode.INVALID_ARGUMENT, NodeRejected),
])
def test_grpc_errors_map_to_the_mesh_tree(code: grpc.StatusCode, kind: type[Exception]) -> None:
    err = from_grpc("n1", _Err(code))
    assert type(err) is kind
    assert "n1" in str(err) and code.name in str(err) and "boom" in str(err)


def test_a_leader_waits_for_active_sessions_but_not_for_ended_ones() -> None:
    import time as _time

    import numpy as np

    from ethen.mesh.worker.batching import Job, StepBatcher

    batcher = StepBatcher(lambda jobs: [j.hidden for j in jobs], window_s=0.05, active_horizon_s=10.0)

    def step(sid: str) -> float:
        t0 = _time.perf_counter()
        batcher.run(Job(session_id=sid, first_layer=0, last_layer=0, positions=[0],
                        hidden=np.zeros((1, 2), np.float32)))
        return _time.perf_counter() - t0

    step("a")
    step("b")  # two sessions are active now: a lone step waits the window for the other one
    assert step("a") >= 0.04
    batcher.forget("b")  # b ended
    assert step("a") < 0.04
