"""One compute thread per worker that batches concurrent sessions' decode steps.

Every ``Forward`` becomes a :class:`Job` on a queue; a single compute thread takes jobs in arrival order.
A job that is a *decode step* (one token) gathers every other queued decode step for the same layer span from
other sessions, and the whole group runs as one batched step (one matmul per weight for all of them, see
:meth:`ethen.mesh.worker.backend.FragmentBackend.forward_batch`).  Prefill jobs (several tokens) run alone.

Collection window (the spec is silent): when fewer decode steps are queued than the number of sessions that
sent a decode step recently (within ``active_horizon_s``), the thread waits up to ``window_s`` (default 1 ms)
for the others to arrive.  With a single active session it never waits, so one session pays no batching
latency, and
under load the natural queueing while a step computes fills the next batch.

Serialising all compute on one thread also serialises every access to the session store and KV caches, so
they need no further locking.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["BatchRunner", "Job", "StepBatcher"]

F32 = npt.NDArray[np.float32]


@dataclass(slots=True)
class Job:
    session_id: str
    first_layer: int
    last_layer: int
    positions: list[int]
    hidden: F32  # [T, d]
    enqueued: float = field(default_factory=time.perf_counter)
    future: Future[tuple[F32, float, float, int]] = field(default_factory=Future)

    @property
    def is_decode(self) -> bool:
        return len(self.positions) == 1

    @property
    def span(self) -> tuple[int, int]:
        return (self.first_layer, self.last_layer)


# run(jobs) -> one output (or exception) per job, in order; len(jobs) > 1 only for decode steps of one span.
BatchRunner = Callable[[list[Job]], list[F32 | BaseException]]


class StepBatcher:
    """Queue + single compute thread. ``submit`` returns a future of (hidden, queue_ms, compute_ms, batch)."""

    def __init__(
        self,
        run: BatchRunner,
        max_batch: int = 16,
        window_s: float = 0.001,
        active_horizon_s: float = 0.05,
        on_step: Callable[[float, float], None] | None = None,
        name: str = "ethen-compute",
    ) -> None:
        self._run = run
        self._max_batch = max_batch
        self._window_s = window_s
        self._horizon = active_horizon_s
        self._on_step = on_step
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._held: deque[Job] = deque()  # taken from the queue but not batchable with the current step
        self._recent: dict[str, float] = {}  # session -> last decode-step arrival
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future[tuple[F32, float, float, int]]:
        if self._stopped:
            raise RuntimeError("batcher is stopped")
        self._queue.put(job)
        return job.future

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _next(self, timeout: float | None) -> Job | None:
        if self._held:
            return self._held.popleft()
        try:
            if timeout is None or timeout > 0:
                return self._queue.get(timeout=timeout)
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _expected(self, now: float) -> int:
        for sid in [s for s, t in self._recent.items() if now - t > self._horizon]:
            del self._recent[sid]
        return len(self._recent)

    def _collect(self, first: Job) -> list[Job]:
        batch = [first]
        if not first.is_decode:
            return batch
        sessions = {first.session_id}
        self._recent[first.session_id] = time.perf_counter()
        deadline = time.perf_counter() + self._window_s
        skipped: list[Job] = []
        while len(batch) < self._max_batch:
            now = time.perf_counter()
            waiting = len(batch) < self._expected(now) and now < deadline
            try:
                job = self._queue.get(timeout=deadline - now) if waiting else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)
                break
            if job.is_decode:
                self._recent[job.session_id] = time.perf_counter()
            if job.is_decode and job.span == first.span and job.session_id not in sessions:
                batch.append(job)
                sessions.add(job.session_id)
            else:
                skipped.append(job)
        self._held.extend(skipped)
        return batch

    def _loop(self) -> None:
        while True:
            job = self._next(None)
            if job is None:
                if self._stopped:
                    return
                continue
            batch = self._collect(job)
            start = time.perf_counter()
            try:
                results = self._run(batch)
            except BaseException as exc:  # the runner failed as a whole: every job gets the error
                results = [exc] * len(batch)
            end = time.perf_counter()
            compute_ms = (end - start) * 1000.0
            if self._on_step is not None:
                self._on_step(end, end - start)
            for item, result in zip(batch, results, strict=True):
                queue_ms = (start - item.enqueued) * 1000.0
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result((result, queue_ms, compute_ms, len(batch)))
