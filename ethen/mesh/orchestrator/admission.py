"""Admission of multi-row stage calls, and liveness judged by progress (issue 42: a busy worker is not dead).

Under load (72 concurrent streams on ``ethen up``) every session's prefill reached the workers at once. A
worker computes the prefills of one caller round robin, slice by slice, so N of them all finish about N
times later, and a deadline that counted that queue (``progress_timeout_s`` per 128 rows) expired for many
at once: ``DEADLINE_EXCEEDED``, the worker backed off as dead, no live holder for its layers, and the
streams already answered broke. Meanwhile its Health polls (0.5 s) waited behind the queued calls. Rules:

- **Admitted before the clock starts** (:class:`NodeGate`): the multi-row calls (prefill pieces, replays)
  this orchestrator sends one worker take one of ``slots`` (2) first, in arrival order; the gRPC deadline
  of a call starts when it leaves, and covers the queue it joins there (:func:`queued_timeout`: its own
  128-row units plus those of the calls already in flight to that worker). Decode steps are not gated (one
  row, batched in rounds; the worker gives them a turn between prefill slices); a round's call of B sessions
  gets a unit per batch of 16 the worker computes them in (:func:`round_timeout`).
- **Refused before the first byte**: a call that gets no slot within its budget (``admission_timeout_s``
  before the session's first token; ``forward_timeout_s`` for a replay later) ends the wait; before the
  first token the session raises :class:`~ethen.mesh.orchestrator.errors.MeshSaturated` with a
  ``Retry-After`` estimate (:func:`retry_after_s`), which the gateway answers as 503 ``mesh_saturated`` (or
  falls back to its next candidate). A worker's ``RESOURCE_EXHAUSTED`` (its session or memory cap) before
  the first token is the same refusal when no other route avoids that worker.
- **Liveness by progress** (:func:`busy_not_dead`, :func:`stalled`): a stage call to a worker that finished
  is progress. A Health poll that *timed out* on a worker with stage calls of this orchestrator in flight
  and progress within ``grace_s`` (``progress_timeout_s``) leaves it alive (busy); a refused connection is
  death at once, and so is a timeout on a worker with nothing in flight (cut off: a partition is still
  seen within 0.75 s). A stage call that timed out is a stuck worker only if no call to that worker
  finished since it was sent; else the worker is busy: it is not backed off, and the session refuses
  (before its first token) or replays that stage on the same worker (after it).

:class:`NodeGate` is the shell (a lock and a condition); the rules are pure functions (``now`` is an
argument).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from ethen.mesh.worker.limits import MAX_DECODE_BATCH, PREFILL_CHUNK_TOKENS

__all__ = ["GATE_SLOTS", "NodeGate", "busy_not_dead", "queued_timeout", "retry_after_s", "round_timeout",
           "stalled", "units"]

GATE_SLOTS = 2  # multi-row calls in flight to one worker from one orchestrator
_MAX_RETRY_AFTER_S = 60


def units(rows: int) -> int:
    """128-row units of a call of ``rows`` rows (what ``progress_timeout_s`` is granted per)."""
    return max(1, math.ceil(rows / PREFILL_CHUNK_TOKENS))


def queued_timeout(progress_timeout_s: float | None, rows: int, ahead: Iterable[int], cap_s: float) -> float:
    """The deadline of a call of ``rows`` rows that joins a worker where calls of ``ahead`` rows (sent by this
    orchestrator) are in flight: ``progress_timeout_s`` per unit of all of them, capped by ``cap_s``."""
    if progress_timeout_s is None:
        return cap_s
    return min(cap_s, progress_timeout_s * (units(rows) + sum(units(r) for r in ahead)))


def round_timeout(progress_timeout_s: float | None, items: int, cap_s: float) -> float:
    """The deadline of a decode round's call carrying ``items`` sessions' steps: a worker computes them
    :data:`~ethen.mesh.worker.limits.MAX_DECODE_BATCH` at a time, one after the other, so each such batch is
    a unit of ``progress_timeout_s`` (capped by ``cap_s``)."""
    if progress_timeout_s is None:
        return cap_s
    return min(cap_s, progress_timeout_s * max(1, math.ceil(items / MAX_DECODE_BATCH)))


def retry_after_s(waiting: int, in_flight: int, slots: int, call_s: float | None) -> int:
    """Whole seconds until a refused request may find a slot: the calls waiting and in flight, ``slots`` at a
    time, each taking ``call_s`` (an EWMA; unknown: 1 s); at least 1, at most 60."""
    per = 1.0 if call_s is None else max(0.0, call_s)
    est = (waiting + in_flight) * per / max(1, slots)
    return int(min(_MAX_RETRY_AFTER_S, max(1, math.ceil(est))))


def busy_not_dead(now: float, timed_out: bool, in_flight: int, last_progress: float | None,
                  grace_s: float) -> bool:
    """A Health poll failed: whether the worker still counts as alive (busy): the poll timed out (not a
    refused connection), stage calls to it are in flight (``in_flight``) and one finished within
    ``grace_s``."""
    return timed_out and in_flight > 0 and last_progress is not None and now - last_progress <= grace_s


def stalled(sent_at: float | None, last_progress: float | None) -> bool:
    """A stage call sent at ``sent_at`` timed out: whether its worker is stuck, i.e. no call to it finished
    since (unknown send time: stuck, the old rule)."""
    return sent_at is None or last_progress is None or last_progress < sent_at


class NodeGate:
    """FIFO slots for the multi-row calls to one worker (module docstring). Thread-safe."""

    def __init__(self, slots: int = GATE_SLOTS, clock: Callable[[], float] = time.monotonic,
                 alpha: float = 0.3) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.clock = clock
        self.alpha = alpha
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._flight: dict[object, int] = {}  # ticket -> rows of a call in flight
        self.call_s: float | None = None  # EWMA of a gated call's duration

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._flight)

    def acquire(self, rows: int, timeout_s: float) -> tuple[object, list[int]] | None:
        """Wait (in arrival order, at most ``timeout_s``) for a slot for a call of ``rows`` rows; returns its
        ticket and the rows of the calls in flight when it left, or ``None`` when the wait timed out."""
        ticket = object()
        end = self.clock() + max(0.0, timeout_s)
        with self._cond:
            self._waiting.append(ticket)
            try:
                while not (self._waiting[0] is ticket and len(self._flight) < self.slots):
                    left = end - self.clock()
                    if left <= 0:
                        return None
                    self._cond.wait(min(left, 0.5))
                self._waiting.popleft()
                ahead = list(self._flight.values())
                self._flight[ticket] = rows
                return ticket, ahead
            finally:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                self._cond.notify_all()

    def release(self, ticket: object, call_s: float | None = None) -> None:
        """The call of ``ticket`` ended (after ``call_s`` seconds when it was answered)."""
        with self._cond:
            self._flight.pop(ticket, None)
            if call_s is not None:
                old = self.call_s
                self.call_s = call_s if old is None else old + self.alpha * (call_s - old)
            self._cond.notify_all()

    def retry_after(self) -> int:
        with self._cond:
            return retry_after_s(len(self._waiting), len(self._flight), self.slots, self.call_s)
