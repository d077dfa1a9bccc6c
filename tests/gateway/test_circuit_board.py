"""The circuit board (ethen.gateway.circuit) on a controlled clock: it follows the telemetry's failing gates,
goes half-open after the cool-down, lets one trial through per key, doubles the cool-down on a failed trial up
to the cap, closes when the gate lifts, and logs each transition once. Config keys are validated by name."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta

import pytest

from ethen.gateway.circuit import CircuitBoard, Prober
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.observation.telemetry_store import AttemptRecord, TelemetryStore
from tests.gateway.service_harness import config_dict

WALL = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fail(store: TelemetryStore, provider: str, model: str, at: float, n: int = 1, ok: bool = False) -> None:
    for _ in range(n):
        store.record(AttemptRecord(provider, model, at, 10.0, ok))


def test_follows_the_gate_half_open_after_cool_down_one_trial_doubling_capped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "ethen.gateway.circuit")
    clock = Clock()
    board = CircuitBoard(2.0, 5.0, clock=clock)
    store = TelemetryStore()
    fail(store, "a", "x", clock.t, 2)
    board.sync(store.snapshot(clock.t))
    assert board.circuits == {} and board.view(WALL).half_open == frozenset()  # 2 failures: gate open
    fail(store, "a", "x", clock.t)
    board.sync(store.snapshot(clock.t))
    assert set(board.circuits) == {"a", "a/x"}
    opened = [r.getMessage() for r in caplog.records]
    assert len(opened) == 2 and all("circuit open" in m for m in opened)
    view = board.view(WALL)
    assert view.half_open == frozenset() and view.retry_at["a"] == WALL + timedelta(seconds=2)
    board.sync(store.snapshot(clock.t))  # same gates: no second log line
    assert len(caplog.records) == 2

    clock.t += 2.0
    assert board.view(WALL).half_open == {"a", "a/x"}  # the cached view expired with the cool-down
    assert board.ready() == ["a", "a/x"]
    assert board.acquire(("a", "a/x"))
    assert not board.acquire(("a",))  # one trial in flight per key
    assert board.view(WALL).half_open == frozenset()
    board.resolve(("a", "a/x"), False, detail="upstream_server_error", request_id="r9")
    assert board.circuits["a"].cooldown_s == 4.0 and not board.acquire(("a",))
    failed = caplog.records[-1].getMessage()
    assert "trial failed" in failed and "r9" in failed and "4.0 s" in failed
    clock.t += 4.0
    assert board.acquire(("a", "a/x"))
    board.resolve(("a", "a/x"), False)
    assert board.circuits["a"].cooldown_s == 5.0  # capped
    clock.t += 5.0
    assert board.acquire(("a", "a/x"))
    board.resolve(("a", "a/x"), None)  # no evidence (e.g. the request itself was refused): free again
    assert board.circuits["a"].cooldown_s == 5.0 and board.acquire(("a", "a/x"))
    board.resolve(("a", "a/x"), True)
    fail(store, "a", "x", clock.t, ok=True)  # the trial's success sample lifts both gates
    board.sync(store.snapshot(clock.t))
    assert board.circuits == {} and board.view(WALL).half_open == frozenset()
    closed = [r.getMessage() for r in caplog.records if "closed" in r.getMessage()]
    assert len(closed) == 2 and all("a trial succeeded" in m for m in closed)


def test_closes_when_the_failures_leave_the_window_and_reopens_at_the_base_cool_down() -> None:
    clock = Clock()
    board = CircuitBoard(2.0, 10.0, clock=clock)
    store = TelemetryStore(window_seconds=30.0)
    fail(store, "a", "x", clock.t, 3)
    board.sync(store.snapshot(clock.t))
    clock.t += 2.0
    assert board.acquire(("a", "a/x"))
    board.resolve(("a", "a/x"), False)
    assert board.circuits["a"].cooldown_s == 4.0
    clock.t += 31.0
    board.sync(store.snapshot(clock.t))
    assert board.circuits == {}
    fail(store, "a", "x", clock.t, 3)
    board.sync(store.snapshot(clock.t))
    assert board.circuits["a"].cooldown_s == 2.0


def test_candidate_circuit_alone_when_the_provider_still_works() -> None:
    clock = Clock()
    board = CircuitBoard(clock=clock)
    store = TelemetryStore()
    fail(store, "a", "x", clock.t, 3)
    fail(store, "a", "y", clock.t, 2, ok=True)
    board.sync(store.snapshot(clock.t))
    assert set(board.circuits) == {"a/x"}
    assert board.blocking("a", "x") == ("a/x",) and board.blocking("a", "y") == ()
    assert not board.acquire(())  # nothing to try


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBoard(5.0, 2.0)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"cooldown_s": 0}, "circuit.cooldown_s = 0.0: Input should be greater than 0"),
        ({"cooldown_s": "2s"}, "circuit.cooldown_s = '2s'"),
        ({"cooldown_s": 5, "max_cooldown_s": 3}, "max_cooldown_s = 3.0: must be >= circuit.cooldown_s"),
        ({"probe": "yes"}, "circuit.probe = 'yes'"),
        ({"cool_down": 1}, "circuit.cool_down = 1: Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_the_key_and_value(section: dict[str, object], message: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse_config(config_dict("http://127.0.0.1:9", circuit=section))
    assert message in info.value.message


def test_config_defaults() -> None:
    c = parse_config(config_dict("http://127.0.0.1:9")).circuit
    assert (c.cooldown_s, c.max_cooldown_s, c.probe) == (2.0, 10.0, True)


def test_a_hanging_probe_fails_its_trial_after_the_probe_timeout_and_the_next_probe_goes() -> None:
    """Issue 23 item 3: a probe that gets no answer used to hold the trial slot for the provider's whole
    request timeout (300 s by default), so no other probe (nor live trial) went. Now the Prober fails the
    trial after ``timeout_s`` (the cool-down doubles, capped) and cancels the probe; the next probe follows
    the cool-down."""

    async def main() -> tuple[list[float], list[bool], float, bool]:
        board = CircuitBoard(0.1, 0.3)
        store = TelemetryStore()
        fail(store, "alpha", "m", time.monotonic(), 3)
        board.sync(store.snapshot())
        started: list[float] = []
        cancelled: list[bool] = []

        async def probe(cid: str, keys: tuple[str, ...]) -> None:
            started.append(time.monotonic())
            try:
                await asyncio.sleep(3600)  # the upstream never answers
            except asyncio.CancelledError:
                cancelled.append(True)
                board.resolve(keys, None)  # what the executor's probe does when cancelled
                raise

        prober = Prober(board, store.snapshot, lambda key: "alpha/m", probe, timeout_s=0.2)
        board.on_open = prober.wake
        prober.wake()
        try:
            for _ in range(200):  # bounded: 4 s
                if len(started) >= 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            await prober.aclose()
        c = board.circuits["alpha"]
        return started, cancelled, c.cooldown_s, c.in_flight

    started, cancelled, cooldown, in_flight = asyncio.run(main())
    assert len(started) >= 2, started  # before: one probe, stuck for as long as the upstream hangs
    gap = started[1] - started[0]
    assert 0.2 + 0.2 * 0.9 <= gap < 2.0, gap  # the probe timeout, then the doubled cool-down (0.2 s)
    assert cancelled and cooldown >= 0.2 and not in_flight


def test_probe_timeout_must_be_positive() -> None:
    board = CircuitBoard()
    with pytest.raises(ValueError, match="timeout_s"):
        Prober(board, TelemetryStore().snapshot, lambda key: None, _never, timeout_s=0)


async def _never(cid: str, keys: tuple[str, ...]) -> None:
    raise AssertionError("not called")
