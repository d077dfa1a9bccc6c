"""Issue 44: a cloud provider's capacity from its rate-limit headers and the in-flight calls (pure rules of
``ethen.gateway.providers.ratelimit``)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.gateway.providers.base import Timeouts
from ethen.gateway.providers.http import HttpPool
from ethen.gateway.providers.ratelimit import (
    IDLE,
    MAX_BLOCK_S,
    REMAINING_HEADERS,
    UNKNOWN_RESET_S,
    blocked_for_s,
    cloud_capacity,
    parse_duration_s,
)

WALL = datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(("text", "seconds"), [
    ("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3s", 3723.0), ("0.5", 0.5), ("7.66s", 7.66),
    ("soon", None), ("1x", None), ("", None),
])
def test_durations(text: str, seconds: float | None) -> None:
    got = parse_duration_s(text)
    assert got == pytest.approx(seconds) if seconds is not None else got is None


def test_headers_that_block() -> None:
    assert blocked_for_s(200, {"x-ratelimit-remaining-requests": "12"}, WALL) is None
    assert blocked_for_s(200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s"},
                         WALL) == 360.0
    assert blocked_for_s(200, {"x-ratelimit-remaining-tokens": "0"}, WALL) == UNKNOWN_RESET_S
    assert blocked_for_s(429, {"retry-after": "7"}, WALL) == 7.0
    assert blocked_for_s(429, {"retry-after-ms": "250"}, WALL) == 0.25
    assert blocked_for_s(503, {"retry-after": "Mon, 07 Dec 2026 12:00:30 GMT"}, WALL) == pytest.approx(30.0)
    assert blocked_for_s(429, {}, WALL) == UNKNOWN_RESET_S
    assert blocked_for_s(200, {"retry-after": "7"}, WALL) is None  # only a refusal's retry-after blocks
    anthropic = {"anthropic-ratelimit-output-tokens-remaining": "0",
                 "anthropic-ratelimit-output-tokens-reset": "2026-12-07T12:00:12Z"}
    assert blocked_for_s(200, anthropic, WALL) == pytest.approx(12.0)
    assert blocked_for_s(200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "9h"},
                         WALL) == MAX_BLOCK_S


@given(st.integers(0, 500), st.integers(1, 100), st.one_of(st.none(), st.floats(0, 10_000)),
       st.one_of(st.none(), st.floats(-100, 100)))
def test_connection_queue_matches_brute_force(in_flight: int, conns: int, call_ms: float | None,
                                              block_s: float | None) -> None:
    now = 1000.0
    cap = cloud_capacity(now, None if block_s is None else now + block_s, in_flight, conns, call_ms)
    # brute force: requests take a connection in arrival order, conns at a time; ours is number in_flight + 1
    waves = 0
    position = in_flight + 1
    while position > conns:
        position -= conns
        waves += 1
    expect = waves * (call_ms or 0.0) + max(0.0, block_s or 0.0) * 1000.0
    assert cap.queue_ms == pytest.approx(expect, rel=1e-9, abs=1e-6)
    assert cap.prefill_ms_per_token is None


@given(st.integers(0, 200), st.integers(1, 100), st.one_of(st.none(), st.floats(0, 10_000)),
       st.one_of(st.none(), st.floats(-100, -1), st.floats(1, 100)))  # no block ending while we read it
def test_a_pool_reports_what_cloud_capacity_gives_for_its_state(in_flight: int, conns: int,
                                                                 call_ms: float | None,
                                                                 block_s: float | None) -> None:
    """HttpPool.capacity answers the idle case without the clock (the shared IDLE value): never while calls
    fill its connections or a block lasts; otherwise what cloud_capacity says now."""
    pool = HttpPool("p", "http://127.0.0.1:9/v1", {}, Timeouts(), conns)
    pool.in_flight, pool.call_ms = in_flight, call_ms
    pool.blocked_until = None if block_s is None else time.monotonic() + block_s
    before = time.monotonic()
    got = pool.capacity()
    want = cloud_capacity(before, pool.blocked_until, in_flight, conns, call_ms)
    if want == IDLE:
        assert got == IDLE
    else:
        assert got.source == want.source and got.queue_ms == pytest.approx(want.queue_ms, abs=1.0)
    if in_flight >= conns and call_ms:
        assert got.queue_ms > 0 and got.source in ("connections", "rate_limit")


_NAMES = sorted({*REMAINING_HEADERS, "retry-after", "retry-after-ms", "x-ratelimit-reset-requests",
                 "x-ratelimit-reset-tokens", "anthropic-ratelimit-tokens-reset", "x-other"})


@given(st.sampled_from([200, 201, 400, 404, 429, 500, 503]),
       st.dictionaries(st.sampled_from(_NAMES), st.sampled_from(["0", "1", "0.0", "2s", "x", ""])))
def test_only_a_429_503_or_a_remaining_header_can_block(status: int, headers: dict[str, str]) -> None:
    """HttpPool._note skips the header copy when neither is there: blocked_for_s must then say None."""
    if status not in (429, 503) and not any(h in headers for h in REMAINING_HEADERS):
        assert blocked_for_s(status, headers, WALL) is None
