"""Issue 42 item 1, the pure part: a run of 3 failures opens a candidate's circuit whatever came before it,
and a successful trial drops that run (only that run) from the telemetry, so the provider ranks as before.

Before, the candidate gate was only "0 successes over >= 3 recent samples": a primary that had served 10
requests and then failed 17 times kept its 10 successes in the window, so no circuit opened, nothing probed
it and its reliability (19/37) ranked it below the alternative for the rest of the 300 s window.

The telemetry store (explicit ``now``), the gate (``ethen.gateway.routing.telemetry.is_failing``) and the
circuit board (controlled clock) are checked against a brute-force oracle over random outcome histories:
sort the kept outcomes by finish time, look at the last three.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ethen.gateway.circuit import CircuitBoard
from ethen.gateway.observation.telemetry_store import AttemptRecord, TelemetryStore
from ethen.gateway.routing import CandidateStats
from ethen.gateway.routing.policy import FAILING_STREAK
from ethen.gateway.routing.telemetry import smoothed_success

WALL = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
WINDOW = 300.0
Outcome = tuple[float, bool]  # (finish time, success)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rec(model: str, at: float, ok: bool) -> AttemptRecord:
    return AttemptRecord("p", model, at, 10.0, ok)


# --- the oracle -------------------------------------------------------------------------------------------


def kept(inserted: list[Outcome], now: float, max_outcomes: int = 50) -> list[Outcome]:
    """What the store counts: the last ``max_outcomes`` inserted, finished within the window, by time."""
    return sorted(o for o in inserted[-max_outcomes:] if now - WINDOW < o[0] <= now)


def oracle_failing(outcomes: list[Outcome]) -> bool:
    """The candidate gate, by brute force: the last 3 outcomes (by finish time) all failed."""
    return len(outcomes) >= 3 and not any(ok for _, ok in outcomes[-3:])


def oracle_forget(outcomes: list[Outcome], before: float) -> list[Outcome]:
    """The outage's failures gone: a failure that finished at or before ``before`` with no success between
    it and ``before``."""
    return [
        (at, ok) for at, ok in outcomes
        if ok or at > before or any(ok2 and at < at2 <= before for at2, ok2 in outcomes)
    ]  # fmt: skip


# --- examples ---------------------------------------------------------------------------------------------


def test_three_failures_after_ten_successes_open_the_candidate_circuit_and_a_trial_restores_the_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "ethen.gateway.circuit")
    clock = Clock()
    board = CircuitBoard(2.0, 10.0, clock=clock)
    store = TelemetryStore()
    for i in range(10):
        store.record(rec("m", clock.t + i * 0.1, True))
    clock.t += 2.0
    before_outage = store.snapshot(clock.t).get("p", "m")
    assert before_outage == CandidateStats(10, 10, 10.0, None, 0)
    for i in range(FAILING_STREAK - 1):
        store.record(rec("m", clock.t + i * 0.1, False))
        clock.t += 0.1
        board.sync(store.snapshot(clock.t))
    assert board.circuits == {}  # 2 in a row: not yet
    store.record(rec("m", clock.t, False))
    board.sync(store.snapshot(clock.t))
    assert set(board.circuits) == {"p/m"}  # before: none (10 successes in the window)
    assert store.snapshot(clock.t).get("p", "m").streak == 3
    assert [r.getMessage() for r in caplog.records] == [
        "circuit open: p/m excluded from routing (candidate_failing: its last 3 recent outcomes failed); "
        "first trial in 2.0 s"
    ]
    for _ in range(14):  # the outage goes on (17 failures in all); the circuit stays open, one log line
        clock.t += 0.5
        store.record(rec("m", clock.t, False))
        board.sync(store.snapshot(clock.t))
    assert len(caplog.records) == 1 and board.ready() == ["p/m"]

    # the half-open trial (a probe) succeeds: what Executor.record does with it
    assert board.acquire(("p/m",))
    clock.t += 0.1
    store.record(rec("m", clock.t, True))
    board.resolve(("p/m",), True)
    assert store.forget_failures("p", "m", clock.t - 1e-9) == 17
    board.sync(store.snapshot(clock.t))
    assert board.circuits == {}
    assert caplog.records[-1].getMessage() == "circuit closed: p/m is routed to again (a trial succeeded)"
    after = store.snapshot(clock.t).get("p", "m")
    assert (after.samples, after.successes, after.streak) == (11, 11, 0)  # as before, plus the trial
    assert after.terms[4] > before_outage.terms[4]  # reliability: before 19/37 kept it ranked below


def test_failures_before_the_last_success_are_not_the_outages_and_stay() -> None:
    store = TelemetryStore()
    for at, ok in [(1.0, False), (2.0, True), (3.0, False), (4.0, False), (5.0, False), (6.0, True)]:
        store.record(rec("m", at, ok))
    assert store.snapshot(5.5).get("p", "m").streak == 3
    assert store.forget_failures("p", "m", 6.0 - 1e-9) == 3
    st_ = store.snapshot(7.0).get("p", "m")
    assert (st_.samples, st_.successes) == (3, 2)  # the failure at 1.0 still counts
    assert st_.terms[4] == smoothed_success(3, 2)


def test_a_run_is_counted_by_finish_time_not_arrival_order() -> None:
    """Another instance's records arrive late (``record_remote``): a success that finished last ends the
    run even when it arrived first."""
    store = TelemetryStore()
    store.record_remote(rec("m", 10.0, True))
    for at in (7.0, 8.0, 9.0):
        store.record_remote(rec("m", at, False))
    st_ = store.snapshot(11.0).get("p", "m")
    assert st_.streak == 0 and not st_.terms[5]
    store.record_remote(rec("m", 10.5, False))
    assert store.snapshot(11.0).get("p", "m").streak == 1


def test_streak_must_fit_the_failures() -> None:
    with pytest.raises(ValueError, match="streak"):
        CandidateStats(5, 3, streak=3)
    assert CandidateStats(5, 2, streak=3).terms[5]
    assert not CandidateStats(5, 3, streak=2).terms[5]
    assert CandidateStats(3, 0).terms[5]  # the spec's rule still holds on its own
    assert not CandidateStats(5, 2, streak=3).without_gate().terms[5]


# --- properties against the oracle ------------------------------------------------------------------------

histories = st.lists(
    st.tuples(st.sampled_from(("x", "y")), st.integers(0, 400), st.booleans()),
    max_size=70,
    unique_by=lambda t: t[1],  # distinct finish times: "the last 3" is well defined
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories, now_off=st.integers(0, 500), shuffle=st.randoms(use_true_random=False))
def test_gate_streak_and_circuits_match_the_oracle(
    history: list[tuple[str, int, bool]], now_off: int, shuffle: object
) -> None:
    arrival = list(history)
    shuffle.shuffle(arrival)  # type: ignore[attr-defined]  # records from other instances arrive late
    store = TelemetryStore(window_seconds=WINDOW, max_outcomes=50)
    for model, at, ok in arrival:
        store.record_remote(rec(model, float(at), ok))
    now = float(now_off)
    snap = store.snapshot(now)
    clock = Clock(now)
    board = CircuitBoard(clock=clock)
    board.sync(snap)
    provider_n = provider_s = 0
    for model in ("x", "y"):
        outcomes = kept([(float(at), ok) for m, at, ok in arrival if m == model], now)
        st_ = snap.get("p", model)
        last_ok = max((i for i, (_, ok) in enumerate(outcomes) if ok), default=-1)
        assert st_.samples == len(outcomes) and st_.streak == len(outcomes) - 1 - last_ok
        assert st_.terms[5] == oracle_failing(outcomes)
        assert (f"p/{model}" in board.circuits) == oracle_failing(outcomes)
        provider_n += len(outcomes)
        provider_s += sum(ok for _, ok in outcomes)
    assert ("p" in board.circuits) == (provider_n >= 3 and provider_s == 0)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories, before=st.integers(0, 400))
def test_forget_drops_exactly_the_outages_failures(history: list[tuple[str, int, bool]], before: int) -> None:
    store = TelemetryStore(window_seconds=1e9, max_outcomes=100)
    for model, at, ok in history:
        store.record(rec(model, float(at), ok))
    store.forget_failures("p", "x", before + 0.5)
    got = [(r.at, r.success) for r in store.records("p", "x")]
    want = oracle_forget([(float(at), ok) for m, at, ok in history if m == "x"], before + 0.5)
    assert sorted(got) == sorted(want)
    assert [(r.at, r.success) for r in store.records("p", "y")] == [
        (float(at), ok) for m, at, ok in history if m == "y"
    ]  # other keys untouched


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(st.booleans(), max_size=30).map(lambda xs: [*xs, True]),  # the last outcome served
    no_history=st.booleans(),
    run=st.integers(FAILING_STREAK, 18),  # history + run + trial fit the ring of 50
)
def test_after_any_outage_a_successful_trial_restores_the_pre_outage_stats(
    before: list[bool], no_history: bool, run: int
) -> None:
    """Whatever came before (or nothing), a run of >= 3 failures opens the circuit; the trial's success and
    the drop leave the stats of the history before the outage plus one success."""
    history = [] if no_history else before
    store = TelemetryStore()
    clock = Clock(0.0)
    board = CircuitBoard(clock=clock)
    for ok in history:
        clock.t += 1.0
        store.record(rec("m", clock.t, ok))
    for _ in range(run):
        clock.t += 1.0
        store.record(rec("m", clock.t, False))
        board.sync(store.snapshot(clock.t))
    assert "p/m" in board.circuits
    clock.t += 10.0
    assert board.acquire(("p/m",))
    store.record(rec("m", clock.t, True))
    board.resolve(("p/m",), True)
    assert store.forget_failures("p", "m", clock.t - 1e-9) == run
    board.sync(store.snapshot(clock.t))
    assert board.circuits == {}
    st_ = store.snapshot(clock.t).get("p", "m")
    assert (st_.samples, st_.successes) == (len(history) + 1, sum(history) + 1)


def test_another_instance_drops_the_same_run_even_when_the_trial_lands_before_the_bound() -> None:
    """[shared]: the forget is handed on with both bounds (``on_forget``). On another instance the trial's
    own success, its time rounded (0.1 ms) and converted to that clock, may land at or before ``before``:
    had it worked the outage's start out again from its own successes, it would have dropped nothing."""
    a, b = TelemetryStore(), TelemetryStore()
    history = [(float(t), True) for t in range(1, 6)] + [(float(t), False) for t in range(6, 9)]
    for store in (a, b):
        for at, ok in history:
            store.record_remote(rec("m", at, ok))

    def hand_on(provider: str, model: str, before: float, since: float | None) -> None:  # the bus, inline
        b.forget_remote(provider, model, before, since)

    a.on_forget = hand_on
    a.record(rec("m", 10.0, True))
    b.record_remote(rec("m", 10.0 - 2e-9, True))  # the trial, as b got it
    assert a.forget_failures("p", "m", 10.0 - 1e-9) == 3
    for store in (a, b):
        st_ = store.snapshot(11.0).get("p", "m")
        assert (st_.samples, st_.successes, st_.streak) == (6, 6, 0)
