"""Batch concurrent sessions' decode steps on a worker, without a hand-off thread (flat combining).

Every ``Forward`` calls :meth:`StepBatcher.run` on its own gRPC thread. The first caller that finds the
batcher idle becomes the *leader*: it takes the queued jobs in arrival order and computes them, while later
callers wait. A job that is a *decode step* (one token) gathers every other queued decode step for the
same layer span from other sessions, and the whole group runs as one batched step (one matmul per weight for
all of them, see :meth:`ethen.mesh.worker.backend.FragmentBackend.forward_batch`). Prefill jobs (several
tokens) run alone. When its own job is done the leader hands over: a waiter whose job is still queued takes
the lead. So a lone session pays no thread hand-off at all (its own thread computes), and under load the
queueing while one step computes fills the next batch.

Collection window (the spec is silent): when fewer decode steps are queued than the number of sessions that
sent a decode step recently (within ``active_horizon_s``), the leader waits up to ``window_s`` (default
1 ms) for the others to arrive. With a single active session it never waits.

Only the leader computes, so compute is serialised: every access to the session store and the KV caches
happens on one thread at a time.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BatchRunner", "Job", "StepBatcher"]

F32 = npt.NDArray[np.float32]


@dataclass(slots=True, eq=False)
class Job:
    session_id: str
    first_layer: int
    last_layer: int
    positions: list[int]
    hidden: F32  # [T, d]
    enqueued: float = field(default_factory=time.perf_counter)
    result: F32 | BaseException | None = None
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    batch_size: int = 0
    done: bool = False
    owner: Any = None  # whatever the submitter needs its runner to see (the orchestrator's session)
    caller: str = ""  # who sent it (a worker: the gRPC peer's host), for per-caller caps
    deadline: float = math.inf  # time.monotonic() after which the caller no longer waits for the result
    is_active: Callable[[], bool] | None = None  # False once the caller cancelled (gRPC context.is_active)

    @property
    def is_decode(self) -> bool:
        return len(self.positions) == 1

    @property
    def span(self) -> tuple[int, int]:
        return (self.first_layer, self.last_layer)


# run(jobs) -> one output (or exception) per job, in order; len(jobs) > 1 only for decode steps of one span.
BatchRunner = Callable[[list[Job]], list[F32 | BaseException]]


class StepBatcher:
    """Leader/follower batching; :meth:`run` returns (hidden, queue_ms, compute_ms, batch size)."""

    def __init__(
        self,
        run: BatchRunner,
        max_batch: int = 16,
        window_s: float = 0.001,
        active_horizon_s: float = 0.05,
        on_step: Callable[[float, float], None] | None = None,
        name: str = "ethen-compute",
    ) -> None:
        self._runner = run
        self._max_batch = max_batch
        self._window_s = window_s
        self._horizon = active_horizon_s
        self._on_step = on_step
        self.name = name
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._busy = False
        self._recent: dict[str, float] = {}  # session -> last decode-step arrival

    def forget(self, session_id: str) -> None:
        """The session ended: stop counting it among the active ones (so no leader waits for it)."""
        with self._cond:
            self._recent.pop(session_id, None)

    def stop(self) -> None:
        """Nothing to stop (no thread of its own); kept so owners can shut down uniformly."""

    def _expected(self, now: float) -> int:
        for sid in [s for s, t in self._recent.items() if now - t > self._horizon]:
            del self._recent[sid]
        return len(self._recent)

    def _take(self) -> list[Job]:
        """Under the lock: the next batch (first queued job + compatible decode steps)."""
        first = self._queue[0]
        if not first.is_decode:
            return [self._queue.popleft()]
        deadline = time.perf_counter() + self._window_s
        while True:
            batch: list[Job] = []
            sessions: set[str] = set()
            for job in self._queue:
                if job.is_decode and job.span == first.span and job.session_id not in sessions:
                    batch.append(job)
                    sessions.add(job.session_id)
                    if len(batch) >= self._max_batch:
                        break
            now = time.perf_counter()
            if len(batch) >= min(self._max_batch, self._expected(now)) or now >= deadline:
                break
            self._cond.wait(deadline - now)  # let the other sessions' steps arrive
        for job in batch:
            self._queue.remove(job)
        return batch

    def run(self, job: Job) -> tuple[F32, float, float, int]:
        """Compute one job (batched with whatever else is queued); raises the job's error."""
        self.run_many([job])
        if isinstance(job.result, BaseException):
            raise job.result
        assert job.result is not None
        return job.result, job.queue_ms, job.compute_ms, job.batch_size

    def run_many(self, jobs: list[Job]) -> None:
        """Compute several jobs that arrived together; each gets ``result`` (an output or an exception)."""
        with self._cond:
            for job in jobs:
                self._queue.append(job)
                if job.is_decode:
                    self._recent[job.session_id] = job.enqueued
            self._cond.notify_all()
            while not all(j.done for j in jobs) and self._busy:
                self._cond.wait()
            if all(j.done for j in jobs):
                return
            self._busy = True  # this thread leads until its own jobs are done
        try:
            self._lead(jobs)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _lead(self, own: list[Job]) -> None:
        while not all(j.done for j in own):
            with self._cond:
                batch = self._take()
            start = time.perf_counter()
            try:
                results = self._runner(batch)
            except BaseException as exc:  # the runner failed as a whole: every job gets the error
                results = [exc] * len(batch)
            end = time.perf_counter()
            if self._on_step is not None:
                self._on_step(end, end - start)
            with self._cond:
                for item, result in zip(batch, results, strict=True):
                    item.result = result
                    item.queue_ms = (start - item.enqueued) * 1000.0
                    item.compute_ms = (end - start) * 1000.0
                    item.batch_size = len(batch)
                    item.done = True
                self._cond.notify_all()
