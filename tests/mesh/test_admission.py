"""Issue 42, the pure and in-process parts: a busy worker is not dead, a step's deadline covers the queue it
joins, and what the mesh cannot take in time is refused before the first token (``MeshSaturated``).

- the rules of :mod:`ethen.mesh.orchestrator.admission` (pure: ``now`` is an argument), with hypothesis
  properties against brute-force oracles;
- :class:`NodeGate`: slots in arrival order, a bounded wait, the calls in flight ahead;
- :class:`HealthMonitor`: a Health poll that times out on a worker that makes progress keeps it alive;
- :class:`MeshSession` over scripted workers: a full (``RESOURCE_EXHAUSTED``) or busy (timed out while other
  calls to it finished) worker is never backed off; before the first token the session routes around it or
  refuses with ``MeshSaturated``, after it a busy stage is replayed on the same worker; a stuck worker (no
  call finished since) still fails over as a dead one.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError, MeshSaturatedError, UpstreamConnectionError, http_status
from ethen.gateway.providers import build_providers
from ethen.gateway.providers.mesh import upstream_error
from ethen.mesh import NodeState, RouteWeights
from ethen.mesh.orchestrator import (
    Backoff,
    HealthMonitor,
    MeshSaturated,
    MeshSession,
    NodeGate,
    NodeOverloaded,
    NodeUnavailable,
    plan_route,
    recompose,
)
from ethen.mesh.orchestrator.admission import (
    busy_not_dead,
    queued_timeout,
    retry_after_s,
    round_timeout,
    stalled,
    units,
)
from ethen.mesh.orchestrator.client import ForwardResult
from ethen.mesh.proto import mesh_pb2
from tests.mesh.test_progress_deadline import _any_route, _config

W = RouteWeights()
D = 4  # hidden size of the scripted workers


# ---- pure rules -----------------------------------------------------------------------------------------


def test_units_and_the_deadline_of_a_call_that_joins_a_queue() -> None:
    assert [units(r) for r in (1, 2, 128, 129, 2048)] == [1, 1, 1, 2, 16]
    assert queued_timeout(5.0, 40, (), 60.0) == 5.0  # alone: as call_timeout
    assert queued_timeout(5.0, 40, (300,), 60.0) == 20.0  # 1 unit + the 3 of the call in flight ahead
    assert queued_timeout(5.0, 2048, (2048,), 60.0) == 60.0  # never past forward_timeout_s
    assert queued_timeout(None, 40, (300,), 60.0) == 60.0  # no progress deadline: the cap alone
    # a decode round's call: a unit per batch of 16 steps the worker computes one after the other
    assert [round_timeout(5.0, b, 60.0) for b in (1, 16, 17, 64, 400)] == [5.0, 5.0, 10.0, 20.0, 60.0]
    assert round_timeout(None, 64, 60.0) == 60.0


@given(st.floats(0.1, 30.0), st.integers(1, 4096), st.lists(st.integers(1, 4096), max_size=4),
       st.floats(0.1, 600.0))
def test_queued_timeout_is_progress_per_unit_of_everything_ahead_capped(p: float, rows: int, ahead: list[int],
                                                                       cap: float) -> None:
    oracle = p * sum(-(-r // 128) for r in [rows, *ahead])  # brute force: every call's started 128-row units
    assert queued_timeout(p, rows, ahead, cap) == pytest.approx(min(cap, oracle))
    assert queued_timeout(p, rows, ahead, cap) >= min(cap, queued_timeout(p, rows, (), cap))


@given(st.integers(0, 500), st.integers(0, 8), st.integers(1, 4), st.none() | st.floats(0.0, 100.0))
def test_retry_after_is_whole_seconds_between_1_and_60(waiting: int, flight: int, slots: int,
                                                       call_s: float | None) -> None:
    got = retry_after_s(waiting, flight, slots, call_s)
    per = 1.0 if call_s is None else call_s
    oracle = (waiting + flight) * per / slots
    assert isinstance(got, int) and 1 <= got <= 60
    assert got == min(60, max(1, math.ceil(oracle)))
    assert retry_after_s(waiting + 1, flight, slots, call_s) >= got  # more queued: never sooner


def test_liveness_is_judged_by_progress() -> None:
    # a Health poll that timed out: busy while calls are in flight and one finished within the grace
    assert busy_not_dead(10.0, True, 3, 6.0, 5.0)
    assert not busy_not_dead(10.0, True, 3, 4.9, 5.0)  # no progress for longer than the grace: stuck
    assert not busy_not_dead(10.0, True, 0, 9.9, 5.0)  # nothing in flight: idle and cut off
    assert not busy_not_dead(10.0, False, 3, 9.9, 5.0)  # refused (not a timeout): dead at once
    assert not busy_not_dead(10.0, True, 3, None, 5.0)  # never made progress
    # a stage call that timed out: stuck only if no call to its worker finished since it was sent
    assert not stalled(3.0, 3.5) and stalled(3.0, 2.9) and stalled(3.0, None) and stalled(None, 9.0)


# ---- the gate -------------------------------------------------------------------------------------------


def test_the_gate_lets_slots_go_in_arrival_order_and_reports_the_calls_ahead() -> None:
    gate = NodeGate(slots=2)
    a, b = gate.acquire(300, 1.0), gate.acquire(40, 1.0)
    assert a is not None and b is not None and a[1] == [] and b[1] == [300]
    assert gate.acquire(10, 0.05) is None and gate.waiting == 0  # full: the bounded wait ends, not queued
    order: list[int] = []

    def take(i: int) -> None:
        got = gate.acquire(10 + i, 5.0)
        assert got is not None
        order.append(i)
        gate.release(got[0], 0.01)

    threads = []
    for i in range(4):  # queued one after the other: they leave in that order
        threads.append(threading.Thread(target=take, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while gate.waiting < i + 1 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert gate.waiting == 4 and gate.retry_after() >= 1
    gate.release(a[0], 2.0)
    gate.release(b[0], 2.0)
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3] and gate.in_flight == 0 and gate.call_s is not None


# ---- Health: busy is not dead -----------------------------------------------------------------------------


class _HealthClient:
    def __init__(self) -> None:
        self.error: Exception | None = None
        self.in_flight = 2  # stage calls of the orchestrator waiting on it

    def health(self) -> mesh_pb2.HealthResponse:
        if self.error is not None:
            raise self.error
        return mesh_pb2.HealthResponse(node_id="n", served_layers=[mesh_pb2.LayerRange(first=0, last=29)],
                                       alive=True, capacity_score=1.0)


TIMEOUT = NodeUnavailable("n", "DEADLINE_EXCEEDED: Deadline Exceeded", "DEADLINE_EXCEEDED")
REFUSED = NodeUnavailable("n", "UNAVAILABLE: connection refused", "UNAVAILABLE")


def _monitor(grace_s: float | None) -> tuple[HealthMonitor, _HealthClient, list[float]]:
    now = [100.0]
    client = _HealthClient()
    monitor = HealthMonitor({"n": client}, Backoff(), clock=lambda: now[0], grace_s=grace_s)  # type: ignore[dict-item]
    monitor.poll("n")
    return monitor, client, now


def test_a_worker_that_makes_progress_stays_alive_when_its_health_times_out(caplog: Any) -> None:
    monitor, client, now = _monitor(grace_s=5.0)
    monitor.observe_call("n", 40, 900.0, 880.0)  # a prefill finished at t=100
    client.error = TIMEOUT
    now[0] = 104.0
    monitor.poll("n")
    assert [s.alive for s in monitor.states()] == [True]
    assert "is dead" not in caplog.text
    now[0] = 105.5  # no call finished for longer than the grace: stuck or cut off
    monitor.poll("n")
    assert [s.alive for s in monitor.states()] == [False]
    assert "mesh worker n is dead" in caplog.text


def test_a_refused_health_poll_is_death_at_once_even_with_progress() -> None:
    monitor, client, now = _monitor(grace_s=5.0)
    monitor.observe_call("n", 1, 20.0, 15.0)
    client.error = REFUSED  # kill -9: the port is closed
    now[0] = 100.1
    monitor.poll("n")
    assert [s.alive for s in monitor.states()] == [False]


def test_a_timed_out_poll_with_nothing_in_flight_is_death_at_once() -> None:
    monitor, client, now = _monitor(grace_s=5.0)
    monitor.observe_call("n", 1, 20.0, 15.0)  # it served a moment ago, then was cut off while idle
    client.in_flight = 0
    client.error = TIMEOUT
    now[0] = 100.3
    monitor.poll("n")
    assert [s.alive for s in monitor.states()] == [False]


def test_a_timed_out_poll_without_progress_is_death() -> None:
    monitor, client, now = _monitor(grace_s=5.0)  # answered Health, but never finished a stage call
    client.error = TIMEOUT
    now[0] = 100.3
    monitor.poll("n")
    assert [s.alive for s in monitor.states()] == [False]


# ---- sessions over scripted workers ------------------------------------------------------------------------


class _Worker:
    """A scripted worker: echoes its input, or raises the next scripted error."""

    def __init__(self, node: str) -> None:
        self.node_id = node
        self.forward_timeout_s = 60.0
        self.errors: list[Exception] = []
        self.calls: list[tuple[int, int, float | None]] = []  # (rows, start, timeout)

    def forward(self, session_id: str, first: int, last: int, hidden: Any, start: int,
                timeout_s: float | None = None, capability: bytes = b"") -> ForwardResult:
        self.calls.append((int(hidden.shape[0]), start, timeout_s))
        if self.errors:
            raise self.errors.pop(0)
        return ForwardResult(np.array(hidden, np.float32), 1.0, 0.0, 1)

    def close_session(self, session_id: str) -> bool:
        return True


def _states(*nodes: str) -> tuple[NodeState, ...]:
    return tuple(NodeState(n, 5.0 + i, 0.0, 5.0, ((0, 29),), True) for i, n in enumerate(nodes))


def _session(nodes: tuple[str, ...], *, progress: bool, gate: NodeGate | None = None,
             admission_timeout_s: float = 30.0) -> tuple[MeshSession, dict[str, _Worker], list[str]]:
    workers = {n: _Worker(n) for n in nodes}
    states = _states(*nodes)
    failed: list[str] = []
    gates: dict[str, NodeGate] = {}

    def gate_of(node: str) -> NodeGate:
        return gate if gate is not None else gates.setdefault(node, NodeGate())

    session = MeshSession(
        plan_route(states, 30, 8, W, "m"), workers,  # type: ignore[arg-type]
        lambda ids: np.ones((len(ids), D), np.float32), lambda h: np.zeros((1, 16), np.float32),
        lambda route, node: recompose(route, node, states, W, None), failed.append,
        gate=gate_of, admission_timeout_s=admission_timeout_s,
        last_progress=(lambda n: time.monotonic() + 1.0) if progress else (lambda n: None))
    return session, workers, failed


def test_a_full_worker_before_the_first_token_is_refused_not_backed_off() -> None:
    session, workers, failed = _session(("solo",), progress=True)
    workers["solo"].errors.append(NodeOverloaded("solo", "RESOURCE_EXHAUSTED: caller holds 64 sessions",
                                                 "RESOURCE_EXHAUSTED"))
    with pytest.raises(MeshSaturated, match="'solo' is full") as info:
        session.step([1, 2, 3, 4, 5, 6, 7, 8])
    assert failed == [] and info.value.retry_after_s >= 1  # never declared dead


def test_a_full_worker_is_routed_around_for_this_session_only() -> None:
    session, workers, failed = _session(("a", "b"), progress=True)
    assert session.route.nodes == ("a",)
    workers["a"].errors.append(NodeOverloaded("a", "RESOURCE_EXHAUSTED: full", "RESOURCE_EXHAUSTED"))
    session.step([1, 2, 3, 4])
    assert session.route.nodes == ("b",) and failed == [] and session.accepted


def test_a_busy_worker_that_timed_out_after_the_first_token_replays_on_the_same_worker() -> None:
    session, workers, failed = _session(("solo",), progress=True)
    session.step([1, 2, 3, 4, 5, 6, 7, 8])  # the prompt: the first token's logits
    session.step([9])
    workers["solo"].errors.append(NodeUnavailable("solo", "DEADLINE_EXCEEDED: Deadline Exceeded",
                                                  "DEADLINE_EXCEEDED"))
    session.step([10])
    assert failed == [] and session.failovers == [] and session.retries == 1
    assert session.route.nodes == ("solo",)
    # the timed-out step, then the replay of the history at its original step sizes, then the new token
    assert [(rows, start) for rows, start, _ in workers["solo"].calls[2:]] == [(1, 9), (8, 0), (1, 8), (1, 9)]


def test_a_busy_worker_before_the_first_token_is_refused_cleanly() -> None:
    session, workers, failed = _session(("solo",), progress=True)
    workers["solo"].errors.append(NodeUnavailable("solo", "DEADLINE_EXCEEDED: x", "DEADLINE_EXCEEDED"))
    with pytest.raises(MeshSaturated, match="'solo' is busy"):
        session.step([1, 2, 3, 4])
    assert failed == []


def test_a_stuck_worker_still_fails_over_as_a_dead_one() -> None:
    session, workers, failed = _session(("a", "b"), progress=False)
    session.step([1, 2, 3, 4])
    workers["a"].errors.append(NodeUnavailable("a", "DEADLINE_EXCEEDED: x", "DEADLINE_EXCEEDED"))
    session.step([5])
    assert failed == ["a"] and session.route.nodes == ("b",) and len(session.failovers) == 1


def test_no_slot_within_the_admission_budget_is_a_clean_refusal() -> None:
    gate = NodeGate(slots=1)
    held = gate.acquire(500, 1.0)  # another session's prefill in flight
    assert held is not None
    session, workers, _ = _session(("solo",), progress=True, gate=gate, admission_timeout_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(MeshSaturated, match="no slot for a 4-row call on worker 'solo'"):
        session.step([1, 2, 3, 4])
    assert time.monotonic() - t0 < 2.0 and workers["solo"].calls == []  # never sent
    gate.release(held[0], 3.0)


def test_a_gated_call_gets_a_deadline_that_covers_the_calls_in_flight_ahead() -> None:
    gate = NodeGate(slots=2)
    held = gate.acquire(300, 1.0)  # 3 units in flight
    assert held is not None
    session, workers, _ = _session(("solo",), progress=True, gate=gate)
    session.step([1, 2, 3, 4])
    assert workers["solo"].calls[0][2] == pytest.approx(5.0 * (1 + 3))
    gate.release(held[0])


def test_the_gateway_answers_a_saturated_mesh_503_mesh_saturated_with_retry_after() -> None:
    err = upstream_error(MeshSaturated("laptop is full", 7), "mesh")
    assert isinstance(err, MeshSaturatedError) and err.retryable and not err.health_evidence
    assert http_status(err) == 503 and err.code == "mesh_saturated"
    assert err.to_dict()["error"]["retry_after_s"] == err.retry_after_s == 7
    other = upstream_error(MeshSaturated.__mro__[1]("no route"), "mesh")  # any other mesh error
    assert isinstance(other, UpstreamConnectionError) and not isinstance(other, MeshSaturatedError)


# ---- the mesh provider's admission_timeout_s key ---------------------------------------------------------


def test_admission_timeout_s_in_the_mesh_provider_config_reaches_its_sessions() -> None:
    assert parse_config(_config()).providers[0].admission_timeout_s == 30.0  # type: ignore[union-attr]
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.admission_timeout_s = 0\.0: .*greater"):
        parse_config(_config(admission_timeout_s=0))
    provider: Any = build_providers(parse_config(_config(admission_timeout_s=2.5, start_timeout_s=0)))["mesh"]
    orch = provider._loader()  # embeddings + head load; the worker address answers nothing
    try:
        session = orch.open_session(4, route=_any_route(orch))
        assert orch.admission_timeout_s == session.admission_timeout_s == 2.5
        assert orch.monitor.grace_s == orch.progress_timeout_s == 5.0  # busy, not dead: judged by progress
    finally:
        orch.close()
