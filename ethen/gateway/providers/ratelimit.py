"""A cloud provider's capacity signal (issue 44): rate-limit headers and the in-flight calls.

Pure functions (``now`` is an argument); :class:`~ethen.gateway.providers.http.HttpPool` feeds them every
answer's headers and keeps the result, and :meth:`HttpProvider.capacity` turns it into the
:class:`~ethen.gateway.routing.capacity.ProviderCapacity` the router reads.

- :func:`blocked_for_s`: how long the provider will refuse a new request, from one answer: ``retry-after``
  (seconds or an HTTP date) / ``retry-after-ms`` on a 429 or 503; otherwise a remaining count of 0 in
  OpenAI's ``x-ratelimit-remaining-requests`` / ``-tokens`` (reset in ``x-ratelimit-reset-requests`` /
  ``-tokens``: ``1s``, ``6m0s``, ``20ms``) or Anthropic's ``anthropic-ratelimit-{requests,tokens,
  input-tokens,output-tokens}-remaining`` (reset an RFC 3339 time in ``...-reset``); a 0 without a readable
  reset blocks :data:`UNKNOWN_RESET_S`. ``None``: not blocked.
- :func:`cloud_capacity`: the queue a request joins: the rest of a block, plus, when the gateway's calls in
  flight already fill ``max_connections``, the calls ahead of it ``max_connections`` at a time, each taking
  the measured call time. Its own part is the candidate's TTFT (``prefill_ms_per_token`` None).
"""

from __future__ import annotations

import email.utils
import math
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Final

from ethen.gateway.routing.capacity import ProviderCapacity

__all__ = ["IDLE", "MAX_BLOCK_S", "REMAINING_HEADERS", "UNKNOWN_RESET_S", "blocked_for_s", "cloud_capacity",
           "parse_duration_s"]

UNKNOWN_RESET_S = 1.0
#: an HTTP provider neither blocked nor out of connections: no queue (the router leaves it out)
IDLE: Final = ProviderCapacity(0.0, None, "idle")
MAX_BLOCK_S = 600.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_OPENAI = ("requests", "tokens")
_ANTHROPIC = ("requests", "tokens", "input-tokens", "output-tokens")


#: the headers whose 0 blocks (:func:`blocked_for_s`): an answer with none, not a 429/503, never blocks
REMAINING_HEADERS: Final = (*(f"x-ratelimit-remaining-{k}" for k in _OPENAI),
                            *(f"anthropic-ratelimit-{k}-remaining" for k in _ANTHROPIC))


def parse_duration_s(value: str) -> float | None:
    """``"1s"``, ``"6m0s"``, ``"20ms"``, ``"1h2m"``, or a plain number of seconds; ``None`` if unreadable."""
    v = value.strip()
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    parts = _DURATION.findall(v)
    if not parts or "".join(a + b for a, b in parts) != v:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(a) * scale[b] for a, b in parts)


def _retry_after(headers: Mapping[str, str], wall: float) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    try:
        return max(0.0, float(ra))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(ra)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - wall)


def _zero(value: str | None) -> bool:
    if value is None:
        return False
    try:
        return float(value) <= 0
    except ValueError:
        return False


def _rfc3339_in_s(value: str | None, wall: float) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() - wall)
    except ValueError:
        return None


def blocked_for_s(status: int, headers: Mapping[str, str], wall: float) -> float | None:
    """Seconds the provider will refuse new requests after this answer (module docstring); ``headers``
    with lower-case names; ``wall``: the Unix time now (for dates)."""
    waits: list[float] = []
    if status in (429, 503):
        ra = _retry_after(headers, wall)
        waits.append(UNKNOWN_RESET_S if ra is None else ra)
    for kind in _OPENAI:
        if _zero(headers.get(f"x-ratelimit-remaining-{kind}")):
            reset = headers.get(f"x-ratelimit-reset-{kind}")
            d = parse_duration_s(reset) if reset is not None else None
            waits.append(UNKNOWN_RESET_S if d is None else d)
    for kind in _ANTHROPIC:
        if _zero(headers.get(f"anthropic-ratelimit-{kind}-remaining")):
            d = _rfc3339_in_s(headers.get(f"anthropic-ratelimit-{kind}-reset"), wall)
            waits.append(UNKNOWN_RESET_S if d is None else d)
    if not waits:
        return None
    return min(MAX_BLOCK_S, max(waits))


def cloud_capacity(now: float, blocked_until: float | None, in_flight: int, max_connections: int,
                   call_ms: float | None) -> ProviderCapacity:
    """The capacity of an HTTP provider at monotonic ``now`` (module docstring)."""
    block_ms = 0.0 if blocked_until is None else max(0.0, blocked_until - now) * 1000.0
    conn = max(1, max_connections)
    ahead = in_flight + 1 - conn  # calls that must end before this one gets a connection
    queue_ms = math.ceil(ahead / conn) * (call_ms or 0.0) if ahead > 0 else 0.0
    if block_ms == 0 and queue_ms == 0:
        return IDLE  # the common case, built once (the router reads one snapshot per request)
    source = "rate_limit" if block_ms > 0 else ("connections" if queue_ms > 0 else "idle")
    return ProviderCapacity(block_ms + queue_ms, None, source)
