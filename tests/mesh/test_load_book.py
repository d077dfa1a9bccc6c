"""Issue 44: the mesh's predicted wait (``ethen.mesh.orchestrator.load``): the formula against a brute-force
walk of the prefill queue, its linear form, the calibration inverse, and the load book's counts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.mesh.orchestrator.load import (
    LoadBook,
    MeshLoad,
    predicted_wait_ms,
    prefill_ms_per_token_of,
    slot_wait_ms,
)
from ethen.mesh.worker.limits import MAX_DECODE_BATCH, PREFILL_CHUNK_TOKENS


def brute_wait(queued: int, own: int, decoding: int, step: float, per_tok: float) -> float:
    """Token by token: every prefill token costs per_tok; every time a chunk of 128 starts, the decoding
    sessions (if any) get one turn: one batched step, whatever their number; the first turn is the rest of
    the step in progress, half a step on average."""
    total = 0.0
    for i in range(queued + own):
        if i % PREFILL_CHUNK_TOKENS == 0 and decoding > 0:
            total += step / 2 if i == 0 else step
        total += per_tok
    return total


@given(st.integers(0, 3000), st.integers(0, 800), st.integers(0, 80), st.floats(0, 200), st.floats(0, 5),
       st.integers(1, 32))
def test_wait_matches_brute_force(queued: int, own: int, decoding: int, step: float, per_tok: float,
                                  batch: int) -> None:
    got = predicted_wait_ms(queued, own, decoding, step, per_tok)
    assert got == pytest.approx(brute_wait(queued, own, decoding, step, per_tok), rel=1e-9, abs=1e-6)
    load = MeshLoad(0, decoding, queued, step, per_tok, batch)
    q, k = load.linear()
    turn = step if decoding else 0.0
    assert load.ms_per_output_token == pytest.approx(math.ceil((decoding + 1) / batch) * step)
    assert got - 1e-6 <= q + own * k <= got + 2 * turn + 1e-6  # the linear form: a bound, within 2 turns
    if own + queued > 0 and got > 0:
        inv = prefill_ms_per_token_of(got, queued, own, decoding, step)
        assert inv == pytest.approx(max(0.01, per_tok), rel=1e-6, abs=1e-6)


def test_book_counts_the_queue_and_calibrates() -> None:
    book = LoadBook(alpha=1.0)
    a = book.begin(300)
    b = book.begin(100)
    snap = book.snapshot()
    assert (snap.prefilling, snap.decoding, snap.queued_tokens) == (2, 0, 400)
    book.first_token(a, 600.0)  # nothing ahead of it, 0 decoding: 2 ms per token
    assert book.prefill_ms_per_token == pytest.approx(2.0)
    snap = book.snapshot()
    assert (snap.prefilling, snap.decoding, snap.queued_tokens, snap.sessions) == (1, 1, 100, 2)
    book.step(40.0)  # one session decoding: one batched step
    assert book.step_ms == 40.0
    busy = book.snapshot()  # 50 tokens share the worker with the 100 waiting: 2 x 50 token-times, half a turn
    assert busy.wait_ms(50) == pytest.approx(100 * 2.0 + 0.5 * 40.0)  # the rest of the step in progress
    book.end(b)  # ended before its first token: leaves the queue
    book.end(a)
    snap = book.snapshot()
    assert (snap.prefilling, snap.decoding, snap.queued_tokens) == (0, 0, 0)
    assert snap.batch_limit == MAX_DECODE_BATCH


@given(st.integers(0, 500), st.integers(1, 100), st.floats(0, 60_000))
def test_slot_wait_matches_brute_force(sessions: int, cap: int, gen_ms: float) -> None:
    """Brute force: the sessions end in waves of ``cap``; the new one starts once it is within ``cap``."""
    waves, ahead = 0, sessions
    while ahead + 1 > cap:
        ahead -= cap
        waves += 1
    assert slot_wait_ms(sessions, cap, gen_ms) == pytest.approx(waves * gen_ms)
    full = MeshLoad(sessions, 0, 0, 10.0, 1.0, 16, cap, gen_ms)
    assert full.wait_ms(0) == pytest.approx(waves * gen_ms)
    assert full.linear()[0] == pytest.approx(waves * gen_ms)


def test_generation_time_is_measured_first_token_to_end() -> None:
    now = [100.0]
    book = LoadBook(alpha=1.0, clock=lambda: now[0], max_sessions=1)
    t = book.begin(10)
    book.first_token(t, 50.0)
    now[0] = 102.5
    book.end(t)
    assert book.generation_ms == pytest.approx(2500.0)
    assert book.snapshot().slot_ms == 0.0  # no session: a new one starts at once
    book.begin(10)
    assert book.snapshot().slot_ms == pytest.approx(2500.0)  # one session, cap 1: a new one waits for it
    book.begin(10)
    assert book.snapshot().slot_ms == pytest.approx(2500.0 * 2)
