"""Issue 44 item 3, the mesh admits what it can serve: the mesh provider's ``max_queue`` bounds the
generations waiting for their first token; one more is refused at once (``MeshSaturated``: the gateway's
fallback, or 503 ``mesh_saturated`` with ``Retry-After``). The decision (:func:`queue_admits`) and the load
book's atomic check (:meth:`LoadBook.try_begin`) against a brute-force model of the queue; the config key;
an orchestrator refusing before any worker is asked."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers import build_providers
from ethen.mesh.orchestrator import MeshSaturated
from ethen.mesh.orchestrator.load import LoadBook, queue_admits, queue_retry_after_s
from ethen.model.sampling import SamplingParams
from tests.mesh.test_progress_deadline import _any_route, _config

_OPS = st.lists(st.tuples(st.sampled_from(["begin", "first", "end"]), st.integers(0, 40),
                          st.integers(1, 2000)), max_size=60)


@given(st.integers(0, 50), st.one_of(st.none(), st.integers(1, 50)))
def test_admits_iff_below_the_bound(waiting: int, max_queue: int | None) -> None:
    oracle = max_queue is None or waiting + 1 <= max_queue  # the newcomer would be waiter number waiting + 1
    assert queue_admits(waiting, max_queue) is oracle


@given(_OPS, st.one_of(st.none(), st.integers(1, 6)))
def test_the_book_never_holds_more_waiting_than_the_bound(ops: list[tuple[str, int, int]],
                                                          max_queue: int | None) -> None:
    """A walk of arrivals, first tokens and ends against a model: a list of waiting and of decoding
    tickets. An arrival is refused exactly when the model's waiting list is full, and nothing is counted
    then; the book's counts always equal the model's."""
    book = LoadBook()
    waiting: list[tuple[object, int]] = []
    decoding: list[object] = []
    for op, pick, tokens in ops:
        if op == "begin":
            ticket = book.try_begin(tokens, max_queue)
            full = max_queue is not None and len(waiting) >= max_queue
            assert (ticket is None) is full
            if ticket is not None:
                waiting.append((ticket, tokens))
        elif op == "first" and waiting:
            ticket, _ = waiting.pop(pick % len(waiting))
            book.first_token(ticket, 100.0)
            decoding.append(ticket)
        elif op == "end" and (waiting or decoding):
            both = [t for t, _ in waiting] + decoding
            ticket = both[pick % len(both)]
            book.end(ticket)
            waiting = [(t, n) for t, n in waiting if t is not ticket]
            decoding = [t for t in decoding if t is not ticket]
        snap = book.snapshot()
        assert (snap.prefilling, snap.decoding, snap.queued_tokens) == (
            len(waiting), len(decoding), sum(n for _, n in waiting))
        assert max_queue is None or snap.prefilling <= max_queue


@given(st.floats(-1e3, 1e9, allow_nan=False))
def test_retry_after_is_the_queue_wait_in_whole_seconds_within_1_to_60(queue_ms: float) -> None:
    got = queue_retry_after_s(queue_ms)
    assert 1 <= got <= 60
    if 1000.0 <= queue_ms <= 59_000.0:
        assert got - 1 < queue_ms / 1000.0 <= got  # rounded up: never sooner than the queue clears


def test_max_queue_is_a_mesh_provider_key_with_errors_naming_key_and_value() -> None:
    assert parse_config(_config()).providers[0].max_queue is None  # type: ignore[union-attr]
    assert parse_config(_config(max_queue=8)).providers[0].max_queue == 8  # type: ignore[union-attr]
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.max_queue = 0: .*greater than or equal"):
        parse_config(_config(max_queue=0))
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.max_queue = 'many'"):
        parse_config(_config(max_queue="many"))


def test_a_full_queue_is_refused_at_once_before_any_worker_is_asked() -> None:
    """The configured bound reaches the orchestrator; with one generation waiting (max_queue = 1) the next
    is refused on its first step, well under admission_timeout_s, though its worker (port 9) answers
    nothing; when the waiting one got its first token, the next is admitted (and only then asks a
    worker)."""
    cfg = _config(max_queue=1, admission_timeout_s=30.0, start_timeout_s=0)
    provider: Any = build_providers(parse_config(cfg))["mesh"]
    orch = provider._loader()  # embeddings + head load; the worker address answers nothing
    try:
        assert orch.max_queue == 1
        route = _any_route(orch)
        held = orch.load_book.try_begin(300, orch.max_queue, route.nodes)  # waits on the route's chain
        assert held is not None
        gen = orch.generate([1, 2, 3, 4], SamplingParams(max_tokens=2), route=route)
        t0 = time.monotonic()
        with pytest.raises(MeshSaturated) as info:
            gen.result()
        assert time.monotonic() - t0 < 1.0
        assert "max_queue = 1" in str(info.value) and info.value.retry_after_s >= 1
        snap = orch.load_book.load(route.nodes)
        assert (snap.prefilling, snap.queued_tokens) == (1, 300)  # the refused one left nothing counted
        orch.load_book.first_token(held, 50.0)
        assert orch.load_book.try_begin(4, orch.max_queue, route.nodes) is not None  # room again
    finally:
        orch.close()
