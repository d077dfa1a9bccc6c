"""Decode rounds: concurrent sessions' decode steps advance together, one ``ForwardBatch`` RPC per stage.

Each generation runs on its own thread and calls ``MeshSession.step`` once per token. A decode step (one
token) of a session whose stages are all warm joins a *round* through a
:class:`~ethen.mesh.worker.batching.StepBatcher` (leader/follower): the first thread to arrive leads, waits up
to ``window_s`` (default 2 ms) for the other active sessions' steps, then runs the whole round for all of
them: per stage one ``ForwardBatch`` carrying every session on that stage (the worker computes them as one
batched step), then one ``[B, d] x [d, V]`` head matmul. B sessions thus cost one RPC per stage per token
instead of B, and stay in lock-step, so the next round forms again. A lone session never waits, and its
stages use unary ``Forward`` (lighter than a one-item ``ForwardBatch``: ~0.7 ms less per token over three
stages in an interleaved A/B here, medians of 6 rounds).

``lanes`` > 1 splits the sessions into that many independent round groups, so several rounds can be in
flight on different workers at once (pipeline parallelism). On the shared 2-core machine here one lane was
better (8 sessions: 2.5-3.3x one session with 1 lane, 1.8-1.9x with 2), so the default is 1.

A session whose stage fails in a round gets the error back on its own thread, where
:class:`~ethen.mesh.orchestrator.session.MeshSession` fails over and replays as usual (the stages that
already ran in the round keep their result).

**Progress deadline** (a stuck node: its process lives, its sockets accept, it never answers): every stage
call gets a gRPC deadline of :func:`call_timeout`, ``progress_timeout_s`` per started 128-position chunk of
the call's rows (the unit a worker computes at once), capped by the client's ``forward_timeout_s``. A call
that passes it fails with ``DEADLINE_EXCEEDED`` (:class:`~ethen.mesh.orchestrator.errors.NodeUnavailable`),
and the session fails over and replays as for a dead node, so no step waits longer than the deadline for a
stuck node. Health polls do not decide this (a stuck device may still answer them). The deadline counts the
worker's queue time too, so it must exceed a chunk's time on a busy worker (default 5 s; a 128-token chunk
of 10 layers takes well under a second here).

The rounds see a session through :class:`RoundSession` (a Protocol), so this module does not import
:mod:`~ethen.mesh.orchestrator.session` (which imports it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ethen.mesh.orchestrator.client import ForwardResult, WorkerClient
from ethen.mesh.orchestrator.errors import NodeError
from ethen.mesh.routing import Route
from ethen.mesh.worker.batching import Job, StepBatcher
from ethen.mesh.worker.limits import PREFILL_CHUNK_TOKENS

F32 = npt.NDArray[np.float32]

__all__ = ["DEFAULT_PROGRESS_TIMEOUT_S", "DecodeRounds", "Observe", "RoundSession", "call_timeout"]

DEFAULT_PROGRESS_TIMEOUT_S = 5.0


def call_timeout(progress_timeout_s: float | None, rows: int, cap_s: float) -> float:
    """The deadline of a stage call carrying ``rows`` positions (see the module docstring)."""
    if progress_timeout_s is None:
        return cap_s
    return min(cap_s, progress_timeout_s * max(1, math.ceil(rows / PREFILL_CHUNK_TOKENS)))


Observe = Callable[[str, int, float, float], None]


class RoundSession(Protocol):
    """What a decode round needs of a session (:class:`~ethen.mesh.orchestrator.session.MeshSession`)."""

    @property
    def id(self) -> str: ...
    @property
    def route(self) -> Route: ...
    @property
    def length(self) -> int: ...
    def worker_session(self, first: int) -> str: ...
    def record_stage(self, node: str, first: int, last: int, inputs: F32, outputs: F32) -> None: ...

_Item = tuple[str, int, int, F32, int]  # (worker session, first layer, last layer, hidden [1, d], start)


class DecodeRounds:
    def __init__(self, clients: Mapping[str, WorkerClient], head: Callable[[F32], F32],
                 window_s: float = 0.002, active_horizon_s: float = 0.5, lanes: int = 1,
                 progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
                 observe: Observe | None = None) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.clients = clients
        self.progress_timeout_s = progress_timeout_s
        self.observe = observe  # (node, rows, call ms, worker ms): the telemetry's latency samples
        self._head = head
        self.sizes: Counter[int] = Counter()  # sessions per round -> rounds run (diagnostics)
        self._lanes = [StepBatcher(self._round, max_batch=64, window_s=window_s,
                                   active_horizon_s=active_horizon_s, name=f"ethen-rounds-{i}")
                       for i in range(lanes)]
        self._lane_of: dict[str, int] = {}
        self._lock = threading.Lock()

    def _lane(self, session_id: str) -> StepBatcher:
        with self._lock:
            lane = self._lane_of.get(session_id)
            if lane is None:
                load = Counter(self._lane_of.values())
                lane = min(range(len(self._lanes)), key=lambda i: (load[i], i))
                self._lane_of[session_id] = lane
        return self._lanes[lane]

    def forget(self, session_id: str) -> None:
        """The session ended: free its lane slot."""
        with self._lock:
            lane = self._lane_of.pop(session_id, None)
        if lane is not None:
            self._lanes[lane].forget(session_id)

    def step(self, session: RoundSession, hidden: F32) -> F32:
        """One decode step of ``session`` (``hidden`` [1, d] embedded token) -> logits [V]."""
        job = Job(session_id=session.id, first_layer=-1, last_layer=-1, positions=[session.length],
                  hidden=hidden, owner=session)
        logits, _, _, _ = self._lane(session.id).run(job)
        row: F32 = logits[0]
        return row

    def _forward(self, node: str, items: list[_Item]) -> list[ForwardResult | NodeError]:
        """One stage's steps: a unary ``Forward`` for a lone session (a lighter RPC than a one-item
        ``ForwardBatch``), else one ``ForwardBatch``."""
        client = self.clients[node]
        timeout = call_timeout(self.progress_timeout_s, 1, client.forward_timeout_s)  # one row per item
        t0 = time.perf_counter()
        out: list[ForwardResult | NodeError]
        if len(items) > 1:
            out = client.forward_many(items, timeout_s=timeout)
        else:
            try:
                out = [client.forward(*items[0], timeout_s=timeout)]
            except NodeError as exc:
                return [exc]
        ok = [r for r in out if isinstance(r, ForwardResult)]
        if ok and self.observe is not None:
            worker_ms = max(r.queue_ms + r.compute_ms for r in ok)
            self.observe(node, 1, (time.perf_counter() - t0) * 1000.0, worker_ms)
        return out

    def _round(self, jobs: list[Job]) -> list[F32 | BaseException]:
        sessions: list[RoundSession] = [j.owner for j in jobs]
        self.sizes[len(jobs)] += 1
        results: list[F32 | BaseException | None] = [None] * len(jobs)
        cur = [j.hidden for j in jobs]  # [1, d] each: the input of each session's next stage
        nxt = [0] * len(jobs)  # index of each session's next stage
        while True:
            groups: dict[tuple[str, int, int], list[int]] = {}
            for i, s in enumerate(sessions):
                if results[i] is None and nxt[i] < len(s.route.stages):
                    st = s.route.stages[nxt[i]]
                    groups.setdefault((st.node_id, st.first, st.last), []).append(i)
            if not groups:
                break
            for (node, first, last), members in groups.items():
                items = [(sessions[i].worker_session(first), first, last, cur[i], sessions[i].length)
                         for i in members]
                for i, out in zip(members, self._forward(node, items), strict=True):
                    if isinstance(out, NodeError):
                        results[i] = out
                        continue
                    sessions[i].record_stage(node, first, last, cur[i], out.hidden)
                    cur[i] = out.hidden
                    nxt[i] += 1
        ok = [i for i in range(len(jobs)) if results[i] is None]
        if ok:
            logits = self._head(np.concatenate([cur[i] for i in ok], axis=0))  # [B, V]
            for row, i in enumerate(ok):
                results[i] = logits[row : row + 1]
        missing = RuntimeError("a decode round left a session without a result")
        return [r if r is not None else missing for r in results]
