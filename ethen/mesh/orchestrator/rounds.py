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
flight on different workers at once (pipeline parallelism: while lane A's hidden states are on the wire,
a worker computes lane B's step). **Staggering** (on by default with several lanes): lanes whose sessions
start together are in phase, and a worker merges their concurrent calls into one batched step, so they
leave together and stay in phase for good: their wire times never overlap (a probe of 8 sessions in 2 lanes
at 20 ms one-way measured rounds ~160 ms longer than at 0 ms, i.e. no overlap at all). So each lane's
call to a worker first takes a *slot* on it: it leaves no earlier than one compute time (an EWMA of the
worker's compute per round call, from the replies) after the previous lane's call to that worker, so it
reaches the worker when that call's compute is done (same wire both ways) and the lanes run offset by a
stage. Waiting here instead of queueing on the worker costs nothing (the call would wait there anyway);
a worker not measured yet lets every lane go at once. The lanes' head matmuls meet in one flat-combining
batcher (no waiting window: whoever computes takes every head queued meanwhile), so lanes that coincide
still share one read of the head's weights.

Which shape wins depends on where the time goes. ``bench/mesh_hosts.py`` measures 1 and 2 lanes, staggered
or not, with the delays interleaved; on the shared 2-core VM here (saturated, load average 12) 8 sessions
gave 21.6 tok/s with 1 lane at 0 ms and 8.4 / 9.2 with 2 lanes staggered / unstaggered, and 9-12 tok/s for
all three at 20 ms one-way: the workers and the orchestrator are CPU-bound, a lane of 4 costs about what
a lane of 8 does (the weights are streamed once per step), so splitting sessions into lanes multiplies the
work as much as it hides the wire. The orchestrator's default
(:func:`~ethen.mesh.orchestrator.runtime.default_round_lanes`): one lane for a model on the onnx engine, two
on ggml, whose batched steps cost ~3-4x a one-row step, so two workers computing at once pays.

A session whose stage fails in a round gets the error back on its own thread, where
:class:`~ethen.mesh.orchestrator.session.MeshSession` fails over and replays as usual (the stages that
already ran in the round keep their result).

**Progress deadline** (a stuck node: its process lives, its sockets accept, it never answers): every stage
call gets a gRPC deadline of :func:`call_timeout`, ``progress_timeout_s`` per started 128-position chunk of
the call's rows (the unit a worker computes at once), capped by the client's ``forward_timeout_s``. A call
that passes it fails with ``DEADLINE_EXCEEDED`` (:class:`~ethen.mesh.orchestrator.errors.NodeUnavailable`),
and the session fails over and replays as for a dead node, so no step waits longer than the deadline for a
stuck node. Health polls do not decide this (a stuck device may still answer them). Issue 42
(:mod:`~ethen.mesh.orchestrator.admission`): a round's call of B sessions gets a unit per batch of 16 steps
the worker computes (:func:`~ethen.mesh.orchestrator.admission.round_timeout`), a multi-row call also the
units of the calls already in flight to its worker (it waits for a slot first), and a call that timed out
while other calls to its worker finished is a busy worker, not a stuck one (no failover, no back-off).

**Chain** (``chain`` set: ``data_plane = "chain"``): a round's sessions sharing a route go as one
``ChainRequest`` worker to worker (:mod:`~ethen.mesh.orchestrator.chain`) instead of one call per stage from
here; every stage's outputs come back with it, so the sessions record each stage as above. Lanes work the
same (each lane's round is its own chain) and are staggered too: a lane's chain leaves for the first
worker no earlier than one compute time of the route's slowest stage (EWMAs of each hop's compute time,
which the chain carries back per hop) after the previous lane's, so the lanes run a stage apart down the
chain instead of being merged into one batched step at every hop. Measured (``bench/mesh_hosts.py``, 8
sessions in 2 lanes at 20 ms one-way): no gain over unstaggered chained lanes beyond run-to-run noise on the
shared 2-core VM (28.2 vs 30.0 and 25.1 vs 24.4 tok/s), where a lane of 4 costs ~0.8x a lane of 8 in CPU;
kept for consistency with the star and for hosts whose cores are their own.

The rounds see a session through :class:`RoundSession` (a Protocol), so this module does not import
:mod:`~ethen.mesh.orchestrator.session` (which imports it).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ethen.mesh.orchestrator.admission import round_timeout
from ethen.mesh.orchestrator.chain import ChainReceiver, ChainStep
from ethen.mesh.orchestrator.client import ForwardResult, WorkerClient
from ethen.mesh.orchestrator.errors import ChainLost, NodeError, NodeUnavailable, from_status
from ethen.mesh.proto import mesh_pb2
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
    def capability(self, first: int) -> bytes: ...
    def record_stage(self, node: str, first: int, last: int, inputs: F32, outputs: F32) -> None: ...
    def time_stage(self, node: str, first: int, last: int, rows: int, started: float, call_ms: float,
                   worker_ms: float) -> None: ...

_Item = tuple[str, int, int, F32, int]  # (worker session, first layer, last layer, hidden [1, d], start)


class DecodeRounds:
    def __init__(self, clients: Mapping[str, WorkerClient], head: Callable[[F32], F32],
                 window_s: float = 0.002, active_horizon_s: float = 0.5, lanes: int = 1,
                 progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
                 observe: Observe | None = None, stagger: bool = True,
                 chain: ChainReceiver | None = None,
                 observe_step: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.clients = clients
        self.lanes = lanes  # independent round groups (module docstring)
        self.progress_timeout_s = progress_timeout_s
        self.observe = observe  # (node, rows, call ms, worker ms): the telemetry's latency samples
        self.stagger = stagger and lanes > 1
        self.chain = chain  # the receiver of chained steps (data_plane = "chain"), else None: star
        self.observe_step = observe_step  # (node, worker ms) of each chained stage: the telemetry's samples
        self.clock = clock  # when a call left (NodeError.sent_at: busy or stuck, admission.stalled)
        self._head = head
        self.sizes: Counter[int] = Counter()  # sessions per round -> rounds run (diagnostics)
        self.waited_s = 0.0  # time lanes spent waiting for their slot on a worker (diagnostics)
        self.worker_batches: Counter[int] = Counter()  # rows the worker computed with a call's -> calls
        self._lanes = [StepBatcher(functools.partial(self._round, lane=i), max_batch=64, window_s=window_s,
                                   active_horizon_s=active_horizon_s, name=f"ethen-rounds-{i}")
                       for i in range(lanes)]
        # lanes' heads meet here: whoever computes takes every head queued meanwhile (no waiting window)
        self._heads = StepBatcher(self._head_rows, max_batch=64, window_s=0.0, name="ethen-rounds-head")
        self._lane_of: dict[str, int] = {}
        self._lock = threading.Lock()
        self._next_slot: dict[str, float] = {}  # node -> when the next lane's call may leave (perf_counter)
        self._compute_ms: dict[str, float] = {}  # node -> EWMA of a round call's compute time on the worker

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

    def _slot(self, node: str, interval_ms: float | None = None) -> float:
        """Reserve this lane's turn on ``node``: seconds to wait so that its call reaches the worker once
        the calls other lanes sent before it have been computed (one compute time apart, same wire; a chain
        passes ``interval_ms``, its slowest stage's compute time)."""
        with self._lock:
            now = time.perf_counter()
            start = max(now, self._next_slot.get(node, 0.0))
            gap = self._compute_ms.get(node, 0.0) if interval_ms is None else interval_ms
            self._next_slot[node] = start + gap / 1000.0
        return start - now

    def _wait_slot(self, node: str, interval_ms: float | None = None) -> bool:
        """Wait for this lane's slot on ``node`` (:meth:`_slot`); whether it waited."""
        wait = self._slot(node, interval_ms)
        if wait <= 0:
            return False
        time.sleep(wait)
        with self._lock:
            self.waited_s += wait
        return True

    def _computed(self, node: str, compute_ms: float, rows: int) -> None:
        """A call's compute time and batch rows on ``node``: the staggering EWMA and the diagnostics."""
        with self._lock:
            self.worker_batches[rows] += 1
            if self.stagger:
                old = self._compute_ms.get(node)
                self._compute_ms[node] = compute_ms if old is None else old + 0.3 * (compute_ms - old)

    def _forward(self, node: str, items: list[_Item]) -> list[ForwardResult | NodeError]:
        """One stage's steps: a unary ``Forward`` for a lone session (a lighter RPC than a one-item
        ``ForwardBatch``), else one ``ForwardBatch``. With staggered lanes the call first waits for its
        slot on the worker (see the module docstring)."""
        client = self.clients[node]
        timeout = round_timeout(self.progress_timeout_s, len(items), client.forward_timeout_s)
        if self.stagger:
            self._wait_slot(node)
        t0, sent = time.perf_counter(), self.clock()
        out: list[ForwardResult | NodeError]
        if len(items) > 1:
            out = client.forward_many(items, timeout_s=timeout)
        else:
            try:
                out = [client.forward(*items[0], timeout_s=timeout)]
            except NodeError as exc:
                out = [exc]
        for r in out:
            if isinstance(r, NodeError):
                r.sent_at = sent
        ok = [r for r in out if isinstance(r, ForwardResult)]
        if ok:
            self._computed(node, max(r.compute_ms for r in ok), max(r.batch_size for r in ok))
        if ok and self.observe is not None:
            worker_ms = max(r.queue_ms + r.compute_ms for r in ok)
            self.observe(node, 1, (time.perf_counter() - t0) * 1000.0, worker_ms)
        return out

    def _chain_round(self, receiver: ChainReceiver, sessions: list[RoundSession], cur: list[F32],
                     results: list[F32 | BaseException | None]) -> None:
        """Run the round worker to worker: one chain per route; each session's stages are recorded, ``cur``
        gets its last stage's output, or ``results`` its error."""
        groups: dict[tuple[tuple[str, int, int], ...], list[int]] = {}
        for i, s in enumerate(sessions):
            groups.setdefault(tuple((st.node_id, st.first, st.last) for st in s.route.stages), []).append(i)
        first_client = next(iter(self.clients.values()), None)
        cap = first_client.forward_timeout_s if first_client is not None else 60.0
        timeout = round_timeout(self.progress_timeout_s, max(len(m) for m in groups.values()), cap)
        sent: list[tuple[tuple[tuple[str, int, int], ...], list[int], ChainStep]] = []
        wall, t0 = time.time(), time.perf_counter()
        for stages, members in groups.items():
            # staggered: one slot on the first worker, as wide as the route's slowest stage; the step's
            # time starts when it leaves
            gap = max(self._compute_ms.get(n, 0.0) for n, _, _ in stages)
            if self.stagger and self._wait_slot(stages[0][0], gap) and not sent:
                wall, t0 = time.time(), time.perf_counter()
            step = receiver.expect()
            request = mesh_pb2.ChainRequest(
                hops=[mesh_pb2.ChainHop(node_id=n, address=self.clients[n].address, first_layer=a,
                                        last_layer=b) for n, a, b in stages],
                hop=0, deliver_to=receiver.address, ticket=step.ticket,
                items=[mesh_pb2.ChainItem(
                    session_ids=[sessions[i].worker_session(a) for _, a, _ in stages],
                    capabilities=[sessions[i].capability(a) for _, a, _ in stages],
                    position=sessions[i].length,
                    hidden=mesh_pb2.Tensor(data=np.ascontiguousarray(cur[i], "<f4").tobytes(),
                                           shape=list(cur[i].shape), dtype="float32"))
                       for i in members])
            self.clients[stages[0][0]].chain(request, timeout, functools.partial(receiver.fail, step))
            sent.append((stages, members, step))
        receiver.wait([s for _, _, s in sent], 1.25 * timeout + 0.25)
        call_ms = (time.perf_counter() - t0) * 1000.0
        for stages, members, step in sent:
            if step.result is None:
                error: BaseException = step.error or ChainLost(
                    f"a chained step through {[n for n, _, _ in stages]} did not come back within "
                    f"{1.25 * timeout + 0.25:.2f} s")
                for i in members:
                    results[i] = error
                continue
            for h, (node, _, _) in enumerate(stages):
                done = [it for it in step.result.items if len(it.compute_ms) > h and len(it.batch_size) > h]
                if done:
                    self._computed(node, max(it.compute_ms[h] for it in done),
                                   max(it.batch_size[h] for it in done))
            for i, item in zip(members, step.result.items, strict=False):
                results[i] = self._record_chain(sessions[i], stages, item, cur, i, wall, call_ms)
            for i in members[len(step.result.items):]:
                results[i] = NodeUnavailable(stages[-1][0], "the chained step came back without this session")

    def _record_chain(self, session: RoundSession, stages: Sequence[tuple[str, int, int]],
                      item: mesh_pb2.ChainItem, cur: list[F32], i: int, wall: float,
                      call_ms: float) -> BaseException | None:
        """Record the stages ``item`` ran for ``session``; its error, or None with ``cur[i]`` advanced."""
        d = int(cur[i].shape[1])
        for h, out in enumerate(item.outputs):
            if h >= len(stages):
                break
            node, first, last = stages[h]
            if out.dtype != "float32" or len(out.data) != 4 * d:
                return NodeUnavailable(node, f"malformed chain output: {len(out.data)} bytes {out.dtype!r}")
            hidden: F32 = np.frombuffer(out.data, dtype="<f4").reshape(1, d)
            session.record_stage(node, first, last, cur[i], hidden)
            worker_ms = item.worker_ms[h] if h < len(item.worker_ms) else 0.0
            session.time_stage(node, first, last, 1, wall, call_ms / len(stages), worker_ms)
            if self.observe_step is not None:
                self.observe_step(node, worker_ms)
            cur[i] = hidden
        if item.code:
            return from_status(item.failed_node or stages[min(len(item.outputs), len(stages) - 1)][0],
                               item.code, item.message)
        if len(item.outputs) != len(stages):
            return NodeUnavailable(stages[-1][0], f"the chain came back with {len(item.outputs)} of "
                                                  f"{len(stages)} stages")
        return None

    def _head_rows(self, jobs: list[Job]) -> list[F32 | BaseException]:
        """Several lanes' heads in one matmul; each job's rows come back to it."""
        logits = self._head(np.concatenate([j.hidden for j in jobs], axis=0))  # [sum B, V]
        out: list[F32 | BaseException] = []
        at = 0
        for j in jobs:
            n = int(j.hidden.shape[0])
            out.append(logits[at : at + n])
            at += n
        return out

    def head(self, hidden: F32, lane: int) -> F32:
        """Final norm + head of one round's ``hidden`` [B, d] -> logits [B, V] (combined with other lanes'
        heads computed meanwhile when there are several lanes)."""
        if len(self._lanes) == 1:
            return self._head(hidden)
        job = Job(session_id=f"lane-{lane}", first_layer=-1, last_layer=-1, positions=[0], hidden=hidden)
        logits, _, _, _ = self._heads.run(job)
        return logits

    def _round(self, jobs: list[Job], lane: int = 0) -> list[F32 | BaseException]:
        sessions: list[RoundSession] = [j.owner for j in jobs]
        self.sizes[len(jobs)] += 1
        results: list[F32 | BaseException | None] = [None] * len(jobs)
        cur = [j.hidden for j in jobs]  # [1, d] each: the input of each session's next stage
        nxt = [0] * len(jobs)  # index of each session's next stage
        if self.chain is not None:
            self._chain_round(self.chain, sessions, cur, results)
            nxt = [len(s.route.stages) for s in sessions]
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
                wall, t0 = time.time(), time.perf_counter()
                outs = self._forward(node, items)
                call_ms = (time.perf_counter() - t0) * 1000.0
                for i, out in zip(members, outs, strict=True):
                    if isinstance(out, NodeError):
                        results[i] = out
                        continue
                    sessions[i].record_stage(node, first, last, cur[i], out.hidden)
                    sessions[i].time_stage(node, first, last, 1, wall, call_ms, out.queue_ms + out.compute_ms)
                    cur[i] = out.hidden
                    nxt[i] += 1
        ok = [i for i in range(len(jobs)) if results[i] is None]
        if ok:
            logits = self.head(np.concatenate([cur[i] for i in ok], axis=0), lane)  # [B, V]
            for row, i in enumerate(ok):
                results[i] = logits[row : row + 1]
        missing = RuntimeError("a decode round left a session without a result")
        return [r if r is not None else missing for r in results]
