"""The gateway's live telemetry: a bounded, process-local, in-memory store of attempt outcomes.

Every attempt the executor makes is recorded (:class:`AttemptRecord`: model, provider, latency, TTFT, success,
error class, tokens, cost, whether it was a fallback, whether its stream completed). The router reads it as a
:class:`~ethen.gateway.routing.TelemetrySnapshot`.

Bounds and "recent" (matching the core's documented window, ``ethen.gateway.routing.telemetry``): per
(provider, model) the last ``max_outcomes`` (50) records are kept in a ring buffer, and a snapshot counts only
those that finished within the last ``window_seconds`` (300 s). At most ``max_keys`` (provider, model) pairs
are kept; the least recently written pair is dropped past that. So memory is O(max_keys * max_outcomes). The
store is reset on restart (it is operational evidence, never billing).

Each key's stats carry its run of failures (``CandidateStats.streak``: the failures that finished after its
most recent success in the window, by finish time), which the candidate gate reads (3 in a row trip it,
whatever came before: ``ethen.gateway.routing.telemetry``).

A circuit that closes after a successful trial (``ethen.gateway.circuit``) calls :meth:`forget_failures`: the
failures recorded since the last success before the trial describe an outage that is over, so they stop
counting (a circuit breaker resets its counts when it closes). Without that, the smoothed reliability would
keep a recovered provider ranked below its alternatives for the rest of the window: the lock-out the gate no
longer imposes. Failures older than that success stay: the provider ranks as before the outage.

Several instances (``ethen.gateway.shared``): :meth:`TelemetryStore.record` and
:meth:`TelemetryStore.forget_failures` also hand what they did to ``on_record`` / ``on_forget`` when set (the
shared telemetry bus publishes them, batched, off the request path); what other instances did arrives through
:meth:`record_remote` / :meth:`forget_remote`, which never publish again. A remote record's ``at`` is its
finish time converted to this process's monotonic clock (wall clocks: keep hosts on NTP).

Snapshots are cached: one is rebuilt only after a new record arrives or when the oldest record in it ages out
of the window, so the request path usually pays one comparison. Time is ``time.monotonic()`` seconds (callers
may pass ``now`` explicitly, which the tests do).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from ethen.gateway.routing import CandidateStats, TelemetrySnapshot
from ethen.gateway.routing.telemetry import RECENT_MAX_OUTCOMES, RECENT_WINDOW_SECONDS

__all__ = ["AttemptRecord", "TelemetryStore"]


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt's outcome. ``at`` is the monotonic time it finished."""

    provider: str
    model: str
    at: float
    latency_ms: float
    success: bool
    ttft_ms: float | None = None
    error_class: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None
    fallback: bool = False
    stream: bool = False
    stream_completed: bool | None = None


class TelemetryStore:
    """Bounded ring buffers of :class:`AttemptRecord` per (provider, model)."""

    def __init__(
        self,
        *,
        window_seconds: float = RECENT_WINDOW_SECONDS,
        max_outcomes: int = RECENT_MAX_OUTCOMES,
        max_keys: int = 10_000,
    ) -> None:
        if window_seconds <= 0 or max_outcomes <= 0 or max_keys <= 0:
            raise ValueError("window_seconds, max_outcomes and max_keys must be > 0")
        self.window_seconds = float(window_seconds)
        self.max_outcomes = int(max_outcomes)
        self.max_keys = int(max_keys)
        self._records: OrderedDict[tuple[str, str], deque[AttemptRecord]] = OrderedDict()
        # Per-key cache: stats over the key's recent records, valid until ``_until[key]`` (when its oldest
        # counted record leaves the window, or a record stamped after the computation time starts to count).
        self._stats: dict[tuple[str, str], CandidateStats] = {}
        self._until: dict[tuple[str, str], float] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._cached: TelemetrySnapshot | None = None
        self._cached_at = 0.0
        self._cached_until = float("inf")
        #: called with each locally made record / forget (the shared telemetry bus); never for remote ones
        self.on_record: Callable[[AttemptRecord], None] | None = None
        self.on_forget: Callable[[str, str, float, float | None], None] | None = None

    def record(self, rec: AttemptRecord) -> None:
        """Keep an outcome of this process (and hand it to ``on_record``)."""
        self.record_remote(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def record_remote(self, rec: AttemptRecord) -> None:
        """Keep an outcome another instance made (``rec.at`` already on this process's clock)."""
        key = (rec.provider, rec.model)
        ring = self._records.get(key)
        if ring is None:
            ring = self._records[key] = deque(maxlen=self.max_outcomes)
            if len(self._records) > self.max_keys:
                old, _ = self._records.popitem(last=False)
                self._stats.pop(old, None)
                self._until.pop(old, None)
                self._dirty.discard(old)
                self._cached = None
        else:
            self._records.move_to_end(key)
        ring.append(rec)
        self._dirty.add(key)

    def forget_failures(self, provider: str, model: str, before: float) -> int:
        """Drop the outage's failures of (provider, model): the failed records that finished at or before
        ``before`` and after its last success that finished at or before ``before`` (all of them when there
        is none); returns how many were dropped. Failures before that success are not the outage's: they
        keep counting, so the provider ranks as it did before the outage, not better. Handed to
        ``on_forget`` with both bounds (other instances drop the failures between them: they do not work
        the start out again, since a success from the trial itself, its time rounded and converted to their
        clock, could land at or before ``before`` there)."""
        ring = self._records.get((provider, model), ())
        since = max((rec.at for rec in ring if rec.success and rec.at <= before), default=None)
        if self.on_forget is not None:
            self.on_forget(provider, model, before, since)
        return self.forget_remote(provider, model, before, since)

    def forget_remote(self, provider: str, model: str, before: float, since: float | None = None) -> int:
        """Drop the failed records of (provider, model) that finished after ``since`` (``None``: any time)
        and at or before ``before``: :meth:`forget_failures` as decided by another instance (both on this
        process's clock)."""
        key = (provider, model)
        ring = self._records.get(key)
        if ring is None:
            return 0
        after = float("-inf") if since is None else since
        kept = [rec for rec in ring if rec.success or not after < rec.at <= before]
        dropped = len(ring) - len(kept)
        if dropped:
            ring.clear()
            ring.extend(kept)
            self._dirty.add(key)
        return dropped

    def models_of(self, provider: str) -> list[str]:
        """The models of ``provider`` that have kept records."""
        return [m for p, m in self._records if p == provider]

    def records(self, provider: str, model: str) -> tuple[AttemptRecord, ...]:
        """The kept records of one (provider, model), oldest first."""
        return tuple(self._records.get((provider, model), ()))

    def __len__(self) -> int:
        return sum(len(r) for r in self._records.values())

    def _refresh(self, key: tuple[str, str], now: float) -> None:
        horizon = now - self.window_seconds
        samples = successes = ttft_n = 0
        lat_sum = ttft_sum = 0.0
        oldest = nxt = float("inf")
        failed_at: list[float] = []
        ring = self._records.get(key, ())
        for rec in ring:
            at = rec.at
            if at > now:
                nxt = min(nxt, at)
                continue
            if at <= horizon:
                continue
            if at < oldest:
                oldest = at
            samples += 1
            if rec.success:
                successes += 1
                lat_sum += rec.latency_ms
                if rec.ttft_ms is not None:
                    ttft_sum += rec.ttft_ms
                    ttft_n += 1
            else:
                failed_at.append(at)
        streak = len(failed_at)
        if streak and successes:  # the run: the failures after the most recent counted success, by finish
            # time, not ring order (other instances' records arrive late); a second pass only with failures
            last_ok = max(rec.at for rec in ring if rec.success and horizon < rec.at <= now)
            streak = sum(1 for at in failed_at if at > last_ok)
        if samples:
            self._stats[key] = CandidateStats(
                samples=samples,
                successes=successes,
                latency_ms_mean=lat_sum / successes if successes else None,
                ttft_ms_mean=ttft_sum / ttft_n if ttft_n else None,
                streak=streak,
            )
        else:
            self._stats.pop(key, None)
        until = min(oldest + self.window_seconds, nxt)
        if until == float("inf"):
            self._until.pop(key, None)
        else:
            self._until[key] = until

    def snapshot(self, now: float | None = None) -> TelemetrySnapshot:
        """Stats over the records that finished within the window before ``now``. Only keys written since
        the last snapshot, or whose window moved past a record, are recomputed."""
        if now is None:
            now = time.monotonic()
        if self._cached is not None and not self._dirty and self._cached_at <= now < self._cached_until:
            return self._cached
        if now < self._cached_at:  # time went backwards (explicit ``now``): recompute everything
            stale: set[tuple[str, str]] = set(self._records)
        else:
            stale = self._dirty | {k for k, until in self._until.items() if until <= now}
        for key in stale:
            self._refresh(key, now)
        self._dirty.clear()
        snap = TelemetrySnapshot(
            stats=MappingProxyType(dict(self._stats)),
            window_seconds=self.window_seconds,
            max_outcomes=self.max_outcomes,
        )
        self._cached = snap
        self._cached_at = now
        self._cached_until = min(self._until.values(), default=float("inf"))
        return snap
