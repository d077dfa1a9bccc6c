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

Fairness (issue 23, item 5): a long prefill must not hold the compute for seconds while other callers'
decode steps queue. A runner may compute a prefill job one *slice* at a time (the worker: some layers of one
chunk of rows, see :mod:`ethen.mesh.worker.limits`) and answer :data:`MORE` for it: the job stays queued,
its state in ``Job.state``. The runner asks :meth:`StepBatcher.contended` between two layers and ends the
slice as soon as another session's job could run. Between two slices the leader gives the queued decode
steps a turn (one batched step of every queued decode step of a span), and the prefill slices themselves go
round robin over callers (``Job.caller``: the token principal + peer host), then over a caller's sessions,
so one caller's 2,048-token prefill delays another caller's decode step by at most one layer of one chunk,
and two prefilling callers alternate slice by slice.

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

__all__ = ["MORE", "BatchRunner", "Job", "StepBatcher"]

F32 = npt.NDArray[np.float32]


class _More(Exception):
    """A runner's answer for a prefill job it advanced by one slice: not done, queue it again."""


MORE = _More("more slices to compute")


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
    state: Any = None  # the runner's progress on a prefill it computes slice by slice (see MORE)

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
        self._last_caller: str | None = None  # caller of the last prefill slice (round robin)
        self._last_session: dict[str, str] = {}  # caller -> its session of its last prefill slice
        self._decode_turn = False  # a prefill slice just ran: queued decode steps go next

    def forget(self, session_id: str) -> None:
        """The session ended: stop counting it among the active ones (so no leader waits for it)."""
        with self._cond:
            self._recent.pop(session_id, None)

    def stop(self) -> None:
        """Nothing to stop (no thread of its own); kept so owners can shut down uniformly."""

    def contended(self, job: Job) -> bool:
        """Whether a job of another session is queued that could run now (a prefill, or a decode step whose
        session has no prefill in progress): a runner computing ``job`` in slices then ends its slice."""
        with self._cond:
            busy = {j.session_id for j in self._queue if not j.is_decode}
            return any(j.session_id != job.session_id and (not j.is_decode or j.session_id not in busy)
                       for j in self._queue)

    def _expected(self, now: float) -> int:
        for sid in [s for s, t in self._recent.items() if now - t > self._horizon]:
            del self._recent[sid]
        return len(self._recent)

    def _next_prefill(self) -> Job:
        """Under the lock: the queued prefill job whose turn it is (round robin over callers, then over a
        caller's sessions)."""
        heads: dict[str, dict[str, Job]] = {}
        for job in self._queue:
            if not job.is_decode:
                heads.setdefault(job.caller, {}).setdefault(job.session_id, job)
        callers = sorted(heads)
        after = "" if self._last_caller is None else self._last_caller
        caller = next((c for c in callers if c > after), callers[0])
        sessions = sorted(heads[caller])
        last = self._last_session.get(caller, "")
        session = next((x for x in sessions if x > last), sessions[0])
        self._last_caller = caller
        self._last_session[caller] = session
        if len(self._last_session) > 4 * self._max_batch + 64:  # forget callers gone long ago (bounded)
            self._last_session = {caller: session}
        return heads[caller][session]

    def _take(self) -> list[Job]:
        """Under the lock: the next batch: a prefill job (run alone, maybe one slice), or the first queued
        decode step with every compatible one. After a prefill slice, queued decode steps go first."""
        busy = {j.session_id for j in self._queue if not j.is_decode}  # a session's steps never overlap
        decodes = [j for j in self._queue if j.is_decode and j.session_id not in busy]
        head = self._queue[0]
        if busy and not (decodes and (self._decode_turn or (head.is_decode and head.session_id not in busy))):
            self._decode_turn = True
            return [self._next_prefill()]  # stays queued until done (a runner may answer MORE)
        self._decode_turn = False
        first = decodes[0]
        deadline = time.perf_counter() + self._window_s
        while True:
            batch: list[Job] = []
            sessions: set[str] = set()
            for job in self._queue:
                if (job.is_decode and job.span == first.span and job.session_id not in sessions
                        and job.session_id not in busy):
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
                    if result is MORE:  # one slice of a prefill: it stays queued for its next turn
                        item.compute_ms += (end - start) * 1000.0
                        continue
                    if not item.is_decode:
                        self._queue.remove(item)
                    item.result = result
                    item.compute_ms += (end - start) * 1000.0
                    item.queue_ms = (end - item.enqueued) * 1000.0 - item.compute_ms
                    item.batch_size = len(batch)
                    item.done = True
                self._cond.notify_all()
