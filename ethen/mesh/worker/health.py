"""A worker's own health counters, reported by the ``Health`` RPC (spec §7).

Choices where the spec is silent:

- ``latency_ms`` is an exponentially weighted moving average (alpha 0.2) of *queue + compute* time per
  ``Forward`` as the worker itself measured it (wire time is not included: the spec's §8 says the router
  models the worker's own EWMA). It starts at 0 until the first request.
- ``load`` is the busy fraction of compute (the batch leader) over the last ``window_s`` seconds
  (default 5 s), in [0, 1].
- ``failed_requests`` counts Forward calls that ended in an error of any kind (bad input included).

Time is always an argument (``now``, seconds on a monotonic clock), so this module is deterministic.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["HealthSnapshot", "HealthTracker"]


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    latency_ms: float
    load: float
    served_requests: int
    failed_requests: int


class HealthTracker:
    """Thread-safe counters: EWMA latency, busy-fraction load, served/failed request counts."""

    def __init__(self, alpha: float = 0.2, window_s: float = 5.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self._alpha = alpha
        self._window_s = window_s
        self._lock = threading.Lock()
        self._latency_ms = 0.0
        self._seen = False
        self._served = 0
        self._failed = 0
        self._busy: deque[tuple[float, float]] = deque()  # (end time, busy seconds) of compute steps

    def record_request(self, latency_ms: float, ok: bool) -> None:
        """One Forward finished after ``latency_ms`` of queue + compute time."""
        with self._lock:
            if ok:
                self._served += 1
                if self._seen:
                    self._latency_ms += self._alpha * (latency_ms - self._latency_ms)
                else:
                    self._latency_ms, self._seen = latency_ms, True
            else:
                self._failed += 1

    def record_busy(self, end: float, busy_s: float) -> None:
        """Compute was busy for ``busy_s`` seconds ending at ``end``."""
        with self._lock:
            self._busy.append((end, busy_s))

    def snapshot(self, now: float) -> HealthSnapshot:
        with self._lock:
            start = now - self._window_s
            while self._busy and self._busy[0][0] < start:
                self._busy.popleft()
            busy = sum(min(b, end - start) for end, b in self._busy)
            return HealthSnapshot(
                latency_ms=self._latency_ms,
                load=min(1.0, max(0.0, busy / self._window_s)),
                served_requests=self._served,
                failed_requests=self._failed,
            )
