"""One generation's pipeline state: its route, the KV caches it built on each worker, and replay on failover.

:meth:`MeshSession.step` has the model's ``StepFn`` contract ("feed these token ids after everything fed so
far, return the logits of the last one"), so :func:`ethen.model.generate.generate_stream` drives a mesh
session exactly like the single-process model: same sampling, stop handling and streaming.

How a step runs: the orchestrator embeds the tokens, sends the hidden states through the route's stages in
order (one ``Forward`` per stage, star topology: each reply comes back to the orchestrator), and applies the
final norm and head to the last row. A decode step of a session whose stages are all warm goes through a
decode round instead (:mod:`~ethen.mesh.orchestrator.rounds`): the same stages, but one ``ForwardBatch`` per
stage for every concurrent session.

Failover and replay (Petals-style):

- The session keeps, for every stage boundary of its route, the hidden states that entered it at every
  position so far (``[positions, d]`` float32: ~2.3 KB per token per boundary), plus the sizes of the steps
  it took (the prompt, then one token at a time).
- When a stage fails (:class:`~ethen.mesh.orchestrator.errors.NodeUnavailable`: dead, timed out, lost the
  session, over its cap), the node is marked failed (back-off), the route is recomposed with ``failover``
  (:func:`~ethen.mesh.orchestrator.planning.recompose`), and the step is run again on the new route.
  Stages that already ran this step keep their result; a stage whose node has no cache for this session
  (the substitute) gets its cache rebuilt by replaying the boundary history into it with the **original
  positions** ``0 .. P-1`` and the **original step sizes**, then runs the new tokens at positions
  ``P .. P+T-1``. Same sizes mean the same matmul shapes, so the rebuilt cache is bit-identical to the
  lost one and greedy output is token-for-token the same as an uninterrupted run (with a replica of the
  failed layers). ``exact_replay=False`` replays the history in one call instead (faster, may differ in
  the last float bits).
- Each stage uses its own worker session id (``<session>@<first layer>``), so a node that runs two stages of
  a route keeps two independent caches.
- A stage that makes no progress (a stuck node) is a failure too: every stage call carries the progress
  deadline of :func:`~ethen.mesh.orchestrator.rounds.call_timeout` (``progress_timeout_s`` per started
  128-position chunk), so it ends in ``DEADLINE_EXCEEDED`` and fails over like a dead node.
- A busy node is not a dead one (issue 42, :mod:`~ethen.mesh.orchestrator.admission`): multi-row calls
  first take a slot of the node's :class:`~ethen.mesh.orchestrator.admission.NodeGate` (their deadline then
  covers the calls in flight there too); a call that timed out while other calls to its node finished, or
  that the node refused (``RESOURCE_EXHAUSTED``), does not back the node off. Before the session's first
  token (:attr:`MeshSession.accepted`) such a failure, or no slot within ``admission_timeout_s``, is routed
  around for this session or refused with :class:`~ethen.mesh.orchestrator.errors.MeshSaturated`; after
  it, a timed-out busy stage is replayed on the same node.
- With the worker-to-worker chain (:mod:`~ethen.mesh.orchestrator.chain`), each stage's worker session gets
  an unguessable capability (16 random bytes), sent with every ``Forward`` of that stage (which binds it on
  the worker): a chained decode step names it, so only the holders can feed the session. A chained step that
  never came back (:class:`~ethen.mesh.orchestrator.errors.ChainLost`) leaves every stage's cache unknown:
  the step then rebuilds every stage by replay over the star.
- A step longer than ``max_step_tokens`` (default: the workers' default ``--max-prefill-tokens``, 2,048) runs
  as several steps of at most that many tokens (a long prompt is prefilled in pieces), so no ``Forward`` ever
  exceeds a worker's cap; replay reuses those sizes, and a one-call replay (``exact_replay=False``) is cut
  the same way.
- Prefix reuse (issue 45, :mod:`~ethen.mesh.orchestrator.prefix`): a session opened with the prompt's block
  hash chain sends it with every call that computes prompt positions, so each worker keeps the prompt's
  block-aligned prefix. With ``prefix_length`` > 0 (every stage of the route holds that prefix), the first
  step sends only the suffix, each stage seeding its new worker session from its cache. The session then
  has the history of its first boundary only (the token embeddings); a later cold stage rebuilds every stage
  from there, as after a lost chain. A stage that no longer holds the prefix (``PrefixMissing``) or fails
  makes the first step a whole prefill (on the recomposed route after a failure): the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ethen.mesh.errors import MeshError
from ethen.mesh.orchestrator.admission import NodeGate, queued_timeout, stalled
from ethen.mesh.orchestrator.client import ForwardResult, WorkerClient
from ethen.mesh.orchestrator.errors import (
    ChainLost,
    MeshRuntimeError,
    MeshSaturated,
    NodeError,
    NodeOverloaded,
    NodeUnavailable,
    PrefixMissing,
)
from ethen.mesh.orchestrator.rounds import DEFAULT_PROGRESS_TIMEOUT_S, DecodeRounds, Observe
from ethen.mesh.routing import Route, Stage
from ethen.mesh.worker.limits import MAX_PREFILL_TOKENS
from ethen.mesh.worker.prefixes import PREFIX_BLOCK

__all__ = ["FailoverEvent", "MeshSession", "StageTiming"]

log = logging.getLogger("ethen.mesh.orchestrator")

F32 = npt.NDArray[np.float32]
_Key = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class FailoverEvent:
    """A stage failure during a session and the route it continued on."""

    failed_node: str
    error: str
    at_position: int
    route: Route


class _Rows:
    """A growable ``[n, d]`` float32 row buffer: appending a step is amortised O(T), not O(n)."""

    __slots__ = ("_buf", "n")

    def __init__(self, rows: F32) -> None:
        self._buf: F32 = np.array(rows, dtype=np.float32, copy=True)
        self.n = int(rows.shape[0])

    def append(self, rows: F32) -> None:
        need = self.n + int(rows.shape[0])
        if need > self._buf.shape[0]:
            grown = np.empty((max(need, 2 * self._buf.shape[0]), self._buf.shape[1]), np.float32)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : need] = rows
        self.n = need

    def view(self) -> F32:
        return self._buf[: self.n]


# A step's record for one boundary: (True, all inputs [P+T, d]) after a replay, else (False, new rows [T, d]).
_Pending = dict[int, tuple[bool, F32]]


@dataclass(slots=True)
class StageTiming:
    """What one stage (node, layers) of a session cost so far: its calls, the rows they carried, their wall
    time as the orchestrator saw it (wire + queue + compute) and the worker's own queue + compute time;
    ``start``/``end`` are wall-clock epoch seconds of its first call's start and last call's end (the
    request's trace spans, :mod:`ethen.gateway.observation.tracing`)."""

    node: str
    first: int
    last: int
    start: float
    end: float
    calls: int = 0
    rows: int = 0
    call_ms: float = 0.0
    worker_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "layers": [self.first, self.last], "calls": self.calls, "rows": self.rows,
                "call_ms": round(self.call_ms, 3), "worker_ms": round(self.worker_ms, 3),
                "start": self.start, "end": self.end}


class _HistoryMissing(Exception):
    """A cold stage starts at a boundary the session has no history for: replay the whole route."""


class MeshSession:
    """Run one session through a route of workers, with failover + replay. Not thread-safe (one user)."""

    def __init__(
        self,
        route: Route,
        clients: Mapping[str, WorkerClient],
        embed: Callable[[list[int]], F32],
        head: Callable[[F32], F32],
        recompose: Callable[[Route, str], Route],
        on_failure: Callable[[str], None],
        exact_replay: bool = True,
        max_failovers: int = 4,
        session_id: str | None = None,
        rounds: DecodeRounds | None = None,
        max_step_tokens: int = MAX_PREFILL_TOKENS,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        observe: Observe | None = None,
        gate: Callable[[str], NodeGate] | None = None,
        admission_timeout_s: float = 30.0,
        last_progress: Callable[[str], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefix_hashes: Sequence[str] = (),
        prefix_length: int = 0,
    ) -> None:
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        self.id = session_id or uuid.uuid4().hex
        self.max_step_tokens = max_step_tokens
        self.progress_timeout_s = progress_timeout_s
        self._observe = observe  # (node, rows, call ms, worker ms): the telemetry's latency samples
        self.route = route
        self.routes: list[Route] = [route]
        self.failovers: list[FailoverEvent] = []
        self.clients = clients
        self._embed = embed
        self._head = head
        self._recompose = recompose
        self._on_failure = on_failure
        self.exact_replay = exact_replay
        self.max_failovers = max_failovers
        self.length = 0  # positions fed so far
        self.chunks: list[int] = []  # sizes of the steps taken, in order
        self._hist: dict[int, _Rows] = {}  # boundary (a stage's first layer) -> inputs [length, d]
        self._ready: dict[_Key, int] = {}  # stage -> positions its worker cache holds
        self._opened: set[tuple[str, int]] = set()  # (node, first layer) with a worker session
        self._step_out: dict[_Key, F32] = {}  # outputs of stages that already ran the current step
        self.replayed_positions = 0
        self._rounds = rounds
        self._pending: _Pending = {}  # boundary inputs of the step in progress (decode rounds)
        self.stage_timings: dict[_Key, StageTiming] = {}  # per (node, first, last), in first-use order
        self._caps: dict[int, bytes] = {}  # first layer -> the capability bound to that worker session
        self._gate = gate  # node -> its gate for multi-row calls (admission.py), None: ungated
        self._last_progress = last_progress  # node -> when a call to it last finished (the monitor)
        self._clock = clock
        self.admission_timeout_s = admission_timeout_s
        self._admit_by = clock() + admission_timeout_s  # before the first token, no slot wait goes past it
        self.steps = 0  # public steps done (the first one ends with the first token's logits)
        self.retries = 0  # stages replayed on their own (busy) node after a timeout
        self.prefix_hashes = tuple(prefix_hashes)  # the prompt's block hash chain (prefix.py)
        self.prefix_length = prefix_length  # cached positions the first step skips (0: none)
        self.prefix_reused = 0  # positions the first step actually skipped

    @property
    def accepted(self) -> bool:
        """Whether the session produced its first logits (the gateway may have sent bytes since): failures
        before are refused cleanly (:class:`MeshSaturated`), failures after break the stream."""
        return self.steps > 0

    def _wsid(self, stage: Stage) -> str:
        return self.worker_session(stage.first)

    def worker_session(self, first: int) -> str:
        """The worker-side session id of this session's stage starting at layer ``first``."""
        return f"{self.id}@{first}"

    def capability(self, first: int) -> bytes:
        """The capability of this session's stage starting at layer ``first`` (made on first use)."""
        cap = self._caps.get(first)
        if cap is None:
            cap = self._caps[first] = secrets.token_bytes(16)
        return cap

    def _warm(self) -> bool:
        """Every stage's worker holds exactly the positions so far, and the boundary history is complete."""
        return (all(self._ready.get((s.node_id, s.first, s.last)) == self.length for s in self.route.stages)
                and (self.length == 0 or self.route.stages[0].first in self._hist))

    def time_stage(self, node: str, first: int, last: int, rows: int, started: float, call_ms: float,
                   worker_ms: float) -> None:
        """Count one call of stage ``node`` ``first..last`` (``started``: wall-clock epoch seconds)."""
        key = (node, first, last)
        t = self.stage_timings.get(key)
        if t is None:
            t = self.stage_timings[key] = StageTiming(node, first, last, started, started)
        t.calls += 1
        t.rows += rows
        t.call_ms += call_ms
        t.worker_ms += worker_ms
        t.end = max(t.end, started + call_ms / 1000.0)

    def record_stage(self, node: str, first: int, last: int, inputs: F32, outputs: F32) -> None:
        """A decode round ran this session's stage ``first..last`` on ``node``: keep the bookkeeping."""
        self._pending[first] = (False, inputs)
        key = (node, first, last)
        self._ready[key] = self.length + int(inputs.shape[0])
        self._step_out[key] = outputs
        self._opened.add((node, first))

    # ---- one step ---------------------------------------------------------------------------------------

    def step(self, token_ids: Sequence[int]) -> F32:
        """Feed ``token_ids`` after everything fed so far; logits ``[V]`` of the last one. More than
        ``max_step_tokens`` ids run as several steps of at most that many (only the last one's head runs)."""
        ids, n = list(token_ids), self.max_step_tokens
        seed, self.prefix_length = self.prefix_length, 0
        if self.length == 0 and 0 < seed < len(ids):
            end = min(len(ids), seed + n)
            try:
                logits = self._seeded(ids[:end], seed, head=end == len(ids))
                ids = ids[end:]
                if not ids:
                    assert logits is not None
                    self.steps += 1
                    return logits
            except PrefixMissing as exc:
                log.info("session %s: %s; prefilling the whole prompt", self.id, exc)
            except NodeUnavailable as exc:
                self._fail(exc)  # then the whole prompt on the recomposed route
        while len(ids) > n:
            self._step(ids[:n], head=False)
            ids = ids[n:]
        logits = self._step(ids)
        assert logits is not None
        self.steps += 1
        return logits

    def _step(self, token_ids: list[int], head: bool = True) -> F32 | None:
        x = self._embed(token_ids)  # [T, d]
        if x.shape[0] == 1 and self._rounds is not None and self._warm():
            self._pending = {}
            try:
                row = self._rounds.step(self, x)  # [V]
                self._commit(x.shape[0], self._pending)
                return row
            except ChainLost as exc:  # which stages advanced is unknown: rebuild every one below
                log.warning("session %s: %s; replaying every stage", self.id, exc)
                self._ready.clear()
                self._step_out.clear()
            except NodeUnavailable as exc:
                self._fail(exc)  # then run the step alone below (stages done in the round are kept)
        while True:
            try:
                h, pending = self._run_stages(x)
                break
            except _HistoryMissing:  # rebuild every stage from the token embeddings at boundary 0
                if not self._ready and not self._step_out:
                    raise MeshRuntimeError(f"session {self.id}: no input history at the route's first "
                                           f"layer, cannot replay") from None
                self._ready.clear()
                self._step_out.clear()
            except NodeUnavailable as exc:
                self._fail(exc)
        self._commit(x.shape[0], pending)
        if not head:
            return None
        logits: F32 = self._head(h[-1:])[0]  # [V]
        return logits

    def _seeded(self, ids: list[int], seed: int, head: bool) -> F32 | None:
        """The first step with its first ``seed`` positions seeded from every stage's prefix cache: only the
        suffix is computed. Raises :class:`PrefixMissing` / :class:`NodeUnavailable` with every worker
        session it opened closed again (the caller then prefills the whole prompt)."""
        x = self._embed(ids)  # [seed + t, d]
        cur = x[seed:]
        try:
            for stage in self.route.stages:
                cur = self._forward(stage, cur, seed, prefix_length=seed)
                self._ready[(stage.node_id, stage.first, stage.last)] = len(ids)
        except NodeError:
            for stage in self.route.stages:
                if (stage.node_id, stage.first) in self._opened:
                    with contextlib.suppress(NodeError):
                        self.clients[stage.node_id].close_session(self._wsid(stage))
                    self._opened.discard((stage.node_id, stage.first))
            self._ready.clear()
            raise
        self._commit(len(ids), {self.route.stages[0].first: (True, x)})
        n = self.max_step_tokens
        self.chunks[-1:] = [*(min(n, seed - at) for at in range(0, seed, n)), len(ids) - seed]
        self.prefix_reused = seed
        if not head:
            return None
        logits: F32 = self._head(cur[-1:])[0]
        return logits

    def _commit(self, tokens: int, pending: _Pending) -> None:
        hist: dict[int, _Rows] = {}
        for boundary, (complete, rows) in pending.items():
            buf = self._hist.get(boundary)
            if not complete and buf is None and self.length:
                continue  # no history before this step (a seeded prefix): none from here on either
            if complete or buf is None:
                hist[boundary] = _Rows(rows)
            else:
                buf.append(rows)
                hist[boundary] = buf
        self._hist = hist  # boundaries no longer in the route are dropped
        self.length += tokens
        self.chunks.append(tokens)
        self._step_out.clear()

    def _retry_after(self, node: str) -> int:
        return self._gate(node).retry_after() if self._gate is not None else 1

    def _fail(self, exc: NodeError) -> None:
        node = exc.node_id
        full = isinstance(exc, NodeOverloaded)  # it refused (session / memory cap): working, but full
        busy = (exc.timed_out and self._last_progress is not None  # calls to it finished meanwhile: slow
                and not stalled(exc.sent_at, self._last_progress(node)))
        log.warning("session %s: stage on %r failed at position %d: %s%s", self.id, node, self.length, exc,
                    " (the node is busy, not dead)" if busy else "")
        if len(self.failovers) + self.retries >= self.max_failovers:
            if not self.accepted and (full or busy):
                raise MeshSaturated(f"session {self.id}: {exc}", self._retry_after(node)) from exc
            raise MeshRuntimeError(f"session {self.id}: gave up after {len(self.failovers)} failovers and "
                                   f"{self.retries} retries; last error: {exc}") from exc
        if not (full or busy):
            self._on_failure(node)  # dead, cut off or stuck: back it off for every session
        for key in [k for k in self._ready if k[0] == node]:
            del self._ready[key]
        for key in [k for k in self._step_out if k[0] == node]:
            del self._step_out[key]
        if busy and self.accepted:  # the stream is under way: replay that stage on the same (busy) node
            self.retries += 1
            return
        try:
            route = self._recompose(self.route, node)  # raises RoutingFailure / DegradedRoute / ...
        except MeshError as why:
            if not self.accepted and (full or busy):  # nothing sent yet: refuse cleanly
                raise MeshSaturated(f"worker {node!r} is {'full' if full else 'busy'} ({exc.detail}) and no "
                                    f"other route avoids it ({why})", self._retry_after(node)) from exc
            raise
        self.route = route
        self.routes.append(self.route)
        self.failovers.append(FailoverEvent(node, str(exc), self.length, self.route))

    def _run_stages(self, x: F32) -> tuple[F32, _Pending]:
        p, t = self.length, int(x.shape[0])
        pending: _Pending = {}
        cur = x  # [T, d] this step's input at the current boundary
        full: F32 | None = None  # [P+T, d] all inputs at the current boundary, when a replay produced them
        for stage in self.route.stages:
            key = (stage.node_id, stage.first, stage.last)
            past = self._hist.get(stage.first)
            if full is not None:
                pending[stage.first] = (True, full)
            elif past is not None or p == 0:
                pending[stage.first] = (False, cur)
            done = self._step_out.get(key)
            full_out: F32 | None = None
            if done is not None:
                out = done
            elif self._ready.get(key) == p:  # its worker holds exactly the positions before this step
                out = self._forward(stage, cur, p)
            else:  # a cold stage (new in the route, or its cache is unknown): rebuild it
                if full is None:
                    if past is None and p > 0:
                        raise _HistoryMissing
                    full = cur if past is None else np.concatenate([past.view(), cur], axis=0)
                full_out = self._replay(stage, full)
                out = full_out[p:]
            self._ready[key] = p + t
            self._step_out[key] = out
            cur, full = out, full_out
        return cur, pending

    def _admit(self, node: str, rows: int) -> tuple[NodeGate, object, list[int]] | None:
        """A slot on ``node``'s gate for a call of ``rows`` rows (None: ungated); raises
        :class:`MeshSaturated` (before the first token) or :class:`MeshRuntimeError` when none frees in
        time."""
        if self._gate is None or rows < 2:
            return None
        gate = self._gate(node)
        budget = (self._admit_by - self._clock() if not self.accepted
                  else self.clients[node].forward_timeout_s)
        got = gate.acquire(rows, budget)
        if got is None:
            why = (f"no slot for a {rows}-row call on worker {node!r} within {max(0.0, budget):.1f} s "
                   f"({gate.waiting} waiting, {gate.in_flight} in flight)")
            if not self.accepted:
                raise MeshSaturated(why, gate.retry_after())
            raise MeshRuntimeError(f"session {self.id}: {why}")
        return gate, got[0], got[1]

    def _forward(self, stage: Stage, hidden: F32, start: int, prefix_length: int = 0) -> F32:
        client = self.clients[stage.node_id]
        rows = int(hidden.shape[0])
        blocks = min(len(self.prefix_hashes), (start + rows) // PREFIX_BLOCK)
        # the prompt's block names when this call computes prompt positions (the worker keeps their rows)
        named = prefix_length > 0 or (rows > 1 and start < blocks * PREFIX_BLOCK)
        hashes = self.prefix_hashes[:blocks] if named else ()
        slot = self._admit(stage.node_id, rows)
        self._opened.add((stage.node_id, stage.first))
        timeout = queued_timeout(self.progress_timeout_s, rows, () if slot is None else slot[2],
                                 client.forward_timeout_s)
        wall, t0, sent = time.time(), time.perf_counter(), self._clock()
        reply: ForwardResult | None = None
        try:
            extra: dict[str, Any] = ({"prefix_hashes": hashes, "prefix_length": prefix_length}
                                     if hashes else {})  # (test doubles of the client take none)
            reply = client.forward(self._wsid(stage), stage.first, stage.last, hidden, start,
                                   timeout_s=timeout, capability=self.capability(stage.first), **extra)
        except NodeError as exc:
            exc.sent_at = sent
            raise
        finally:
            if slot is not None:
                slot[0].release(slot[1], None if reply is None else time.perf_counter() - t0)
        call_ms, worker_ms = (time.perf_counter() - t0) * 1000.0, reply.queue_ms + reply.compute_ms
        self.time_stage(stage.node_id, stage.first, stage.last, rows, wall, call_ms, worker_ms)
        if self._observe is not None:
            self._observe(stage.node_id, rows, call_ms, worker_ms)
        return reply.hidden

    def _replay(self, stage: Stage, full: F32) -> F32:
        """Rebuild ``stage``'s cache from scratch with ``full`` [P+T, d]; returns its outputs [P+T, d]."""
        node = stage.node_id
        if (node, stage.first) in self._opened:
            try:
                self.clients[node].close_session(self._wsid(stage))
            except NodeError as exc:
                raise NodeUnavailable(node, f"cannot reset the session before replay: {exc.detail}") from exc
            self._opened.discard((node, stage.first))
        for key in [k for k in self._ready if k[0] == node and k[1] == stage.first]:
            del self._ready[key]
        total = int(full.shape[0])
        if self.exact_replay:
            sizes = [*self.chunks, total - self.length]
        else:  # one call, unless that passes the workers' cap
            n = self.max_step_tokens
            sizes = [min(n, total - at) for at in range(0, total, n)]
        outs: list[F32] = []
        at = 0
        for size in sizes:
            outs.append(self._forward(stage, full[at : at + size], at))
            at += size
        if self.length:
            self.replayed_positions += self.length
            log.info("session %s: replayed %d positions into %r layers %d-%d", self.id, self.length, node,
                     stage.first, stage.last)
        return np.concatenate(outs, axis=0)

    def close(self) -> None:
        """Free this session's caches on every worker it used (best effort)."""
        if self._rounds is not None:
            self._rounds.forget(self.id)
        for node, first in sorted(self._opened):
            client = self.clients.get(node)
            if client is None:
                continue
            with contextlib.suppress(NodeError):
                client.close_session(f"{self.id}@{first}")
        self._opened.clear()
        self._ready.clear()
