"""The worker's gRPC shell: validates ``Forward`` input, runs it through the step batcher, reports
health.

Error mapping (the one boundary between worker errors and gRPC status codes):

==============================  ======================
:class:`WorkerInputError`       ``INVALID_ARGUMENT``
:class:`SessionNotFoundError`   ``NOT_FOUND``
:class:`SessionCapacityError`   ``RESOURCE_EXHAUSTED``
:class:`DeadlineExceededError`  ``DEADLINE_EXCEEDED``
:class:`RequestCancelledError`  ``CANCELLED``
any other exception             ``INTERNAL`` (logged)
==============================  ======================

Every error is answered with a message naming the field and value, and the worker keeps serving.
``ForwardBatch`` answers each item on its own (a status code and message per item, same mapping), so one
session's bad step never fails the others in its batch.

Choices where the spec is silent:

- A Forward whose first position is 0 opens the session (or continues it at 0 after a close); one whose first
  position is > 0 for a session the worker does not hold gets ``NOT_FOUND`` (expired, closed or restarted).
- The run must start at the first layer of a served fragment and end at the last layer of a served fragment,
  covering only served layers in between (spec §3: a fragment runs complete).
- Positions must be consecutive and start exactly at the session's cached length on those layers; anything
  else would silently corrupt the KV cache (Petals bug #587), so it is refused.

Authentication (see :mod:`ethen.mesh.auth`): :func:`serve` takes TLS server credentials and a
:class:`~ethen.mesh.auth.TokenAuth`; with a token, an interceptor answers every call without it
``UNAUTHENTICATED``. A caller is its token's principal plus its peer host (the peer host alone without
tokens), and each session is keyed by the caller that opened it plus the id it sent: another caller naming
the same id reaches a different (or no) session, so it can neither extend nor close the first one, and learns
nothing of it (``NOT_FOUND`` / ``closed=False``, exactly as for an id nobody used). The orchestrator's ids are
``uuid4`` hex anyway.

Draining (:meth:`WorkerService.drain`, on SIGTERM): a ``Forward`` that would open a new session gets
``UNAVAILABLE`` ("... is draining"; the orchestrator fails over to another replica, replaying), steps of open
sessions go on, and Health answers ``alive=false, draining=true`` so routers stop choosing the worker.
:meth:`WorkerService.wait_drained` waits (bounded) until no session is open.

Limits on one caller (see :mod:`ethen.mesh.worker.limits` for the defaults and why):

- A ``Forward`` carries at most ``max_prefill_tokens`` rows (``INVALID_ARGUMENT`` naming ``hidden.shape[0]``).
- A caller (the gRPC peer's host) holds at most ``max_sessions_per_caller`` sessions (``RESOURCE_EXHAUSTED``).
- The work stops when the caller stops waiting: a step whose deadline passed, or whose RPC was cancelled,
  while it queued is never computed; a step of several rows is computed chunk by chunk and layer by layer,
  checking between layers, and abandoned with ``DEADLINE_EXCEEDED`` / ``CANCELLED``. An abandoned (or
  failed) step leaves the session exactly as it was before it (its caches are truncated back), and a session
  that step opened is dropped, so the next step of any session is served as soon as the layer in progress
  ends.
- Fairness (issue 23, item 5): a step of more than one row is computed one *slice* per turn of the step
  batcher (:data:`~ethen.mesh.worker.batching.MORE`), a slice being layers of one chunk of rows run one layer
  at a time (:meth:`~ethen.mesh.worker.backend.FragmentBackend.forward_layer`): the slice ends at the next
  layer as soon as a job of another session could run (:meth:`StepBatcher.contended`). Between two slices
  the queued decode steps of every caller get a batched turn, and the slices of several steps alternate
  round robin per caller (then per session), so one caller's 2,048-token prefill delays another's decode
  step by at most one layer of one chunk instead of the whole prefill. A step of at most
  ``PREFILL_CHUNK_TOKENS`` rows is one chunk (the bits of one fragment forward); a longer one goes in chunks
  of :func:`~ethen.mesh.worker.limits.chunk_rows` rows, which depend only on positions (never on timing),
  so a replay of the same step sizes gives the same bits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from ethen.mesh.auth import ClientCredentials, TokenAuth, TokenInterceptor
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.worker.backend import F32, FragmentBackend
from ethen.mesh.worker.batching import MORE, Job, StepBatcher
from ethen.mesh.worker.chain import CAPABILITY_BYTES, Capabilities, ChainSender, bind_capability, handle_chain
from ethen.mesh.worker.config import WorkerConfig
from ethen.mesh.worker.errors import (
    GRPC_STATUS,
    DeadlineExceededError,
    PrefixNotCachedError,
    RequestCancelledError,
    SessionNotFoundError,
    WorkerDrainingError,
    WorkerError,
    WorkerInputError,
)
from ethen.mesh.worker.health import HealthTracker
from ethen.mesh.worker.limits import (
    PREFILL_CHUNK_TOKENS,
    chunk_rows,
)
from ethen.mesh.worker.prefixes import PREFIX_BLOCK, PrefixCache
from ethen.mesh.worker.sessions import SessionStore
from ethen.model.errors import ModelInputError
from ethen.model.kv_cache import KVCache

__all__ = ["WorkerService", "caller_of", "serve"]

log = logging.getLogger("ethen.mesh.worker")

_PENDING: F32 = np.empty((0, 0), np.float32)  # placeholder for a result not computed yet

_STATUS = GRPC_STATUS  # ethen.mesh.worker.errors: the one error -> status table


def caller_of(peer: str) -> str:
    """The caller's host from a gRPC peer string (``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``,
    ``ipv6:[::1]:5000`` -> ``[::1]``); anything else (``unix:...``) is kept whole."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return rest.rsplit(":", 1)[0]
    return peer


def _stop_if_abandoned(job: Job) -> None:
    """Raise when ``job``'s caller no longer waits for it (deadline passed or RPC cancelled)."""
    if time.monotonic() >= job.deadline:
        raise DeadlineExceededError(
            f"session {job.session_id!r}: the caller's deadline passed; the step of {len(job.positions)} "
            f"positions was abandoned")
    if job.is_active is not None and not job.is_active():
        raise RequestCancelledError(
            f"session {job.session_id!r}: the caller cancelled; the step of {len(job.positions)} positions "
            f"was abandoned")


@dataclass(frozen=True, slots=True)
class _PrefixAsk:
    """A step's prefix-reuse fields (``Job.owner``): the prompt's block hashes, and the cached prefix length
    to seed a new session with (0: none)."""

    hashes: tuple[str, ...]
    length: int


@dataclass(slots=True, eq=False)
class _Prefill:
    """A long step's progress between its slices (``Job.state``)."""

    fragments: list[int]
    caches: list[KVCache]
    before: list[int]  # each cache's length before the step (restored if it fails)
    opened: bool  # the step opened the session (dropped if it fails)
    row: int = 0  # first row of the chunk in progress
    rows: int = 0  # rows of the chunk in progress
    frag: int = 0  # index in ``fragments`` of the chunk's next fragment
    layer: int = 0  # the chunk's next layer in that fragment (0-based)
    x: F32 = field(default_factory=lambda: _PENDING)  # the chunk's hidden states so far
    outs: list[F32] = field(default_factory=list)  # finished chunks' outputs


class WorkerService(mesh_pb2_grpc.MeshWorkerServicer):
    """Implements the ``MeshWorker`` service over a :class:`FragmentBackend`."""

    def __init__(self, config: WorkerConfig, backend: FragmentBackend, auth: TokenAuth | None = None,
                 peers: ClientCredentials | None = None) -> None:
        self.config = config
        self.backend = backend
        self.auth = auth  # with tokens: sessions belong to the token's principal + peer host
        self.draining = False
        self.model_sha256 = ""  # Health's model_sha256 (ethen.mesh.model_id), set by `ethen worker`
        self._served = set(config.layers)
        self._starts = {first for first, _ in config.fragments}
        self._ends = {last for _, last in config.fragments}
        self._layers = {first: last - first + 1 for first, last in config.fragments}  # fragment -> layers
        self.health = HealthTracker()
        self.store: SessionStore[KVCache] = SessionStore(
            backend.new_cache, config.max_cache_bytes, config.session_ttl_s, config.max_sessions,
            config.max_sessions_per_caller)
        self.prefixes = PrefixCache(config.max_prefix_bytes)  # recent prompt prefixes' KV rows (issue 45)
        self._lock = threading.Lock()  # guards store, prefixes, caps: batch leader vs RPCs
        self.caps = Capabilities(limit=4 * config.max_sessions)  # chain: who may feed a session (chain.py)
        self.chain = ChainSender(config.node_id, peers)  # chain: onward calls with these credentials
        self.batcher = StepBatcher(
            self._run, max_batch=config.max_batch, window_s=config.batch_window_s,
            on_step=self.health.record_busy,
        )

    # ---- validation (request threads) ---------------------------------------------------------------------

    def _job(self, request: mesh_pb2.ForwardRequest, context: Any = None) -> Job:
        if not request.session_id:
            raise WorkerInputError("session_id must be non-empty")
        first, last = request.first_layer, request.last_layer
        if first not in self._starts:
            raise WorkerInputError(
                f"first_layer={first} does not start a served fragment (fragments {self.config.fragments})")
        if last not in self._ends or last < first:
            raise WorkerInputError(
                f"last_layer={last} does not end a served fragment at or after first_layer={first} "
                f"(fragments {self.config.fragments})")
        missing = [layer for layer in range(first, last + 1) if layer not in self._served]
        covered = sum(b - a + 1 for a, b in self.config.fragments if first <= a and b <= last)
        if missing or covered != last - first + 1:
            raise WorkerInputError(
                f"layers {missing} in {first}-{last} are not served by {self.config.node_id!r}")
        tensor = request.hidden
        if tensor.dtype != "float32":
            raise WorkerInputError(f"hidden.dtype={tensor.dtype!r} is not supported (only 'float32')")
        shape = list(tensor.shape)
        d = self.backend.hidden_size
        if len(shape) != 2 or shape[0] < 1 or shape[1] != d:
            raise WorkerInputError(f"hidden.shape={shape} must be [T >= 1, {d}]")
        t = shape[0]
        if t > self.config.max_prefill_tokens:
            raise WorkerInputError(
                f"hidden.shape[0]={t} exceeds this worker's max_prefill_tokens="
                f"{self.config.max_prefill_tokens} (send a long prompt as several Forward steps)")
        if t > self.backend.context_length:
            raise WorkerInputError(
                f"hidden.shape[0]={t} exceeds the context length {self.backend.context_length}")
        if len(tensor.data) != t * d * 4:
            raise WorkerInputError(
                f"hidden.data has {len(tensor.data)} bytes, shape {shape} float32 needs {t * d * 4}")
        positions = list(request.positions)
        if len(positions) != t:
            raise WorkerInputError(f"positions has {len(positions)} entries, hidden has T={t} rows")
        start = positions[0]
        if start < 0 or positions != list(range(start, start + t)):
            raise WorkerInputError(f"positions must be consecutive and >= 0, got {positions[:8]}...")
        if start + t > self.backend.context_length:
            raise WorkerInputError(f"positions end at {start + t - 1}, beyond the context length")
        if request.capability and len(request.capability) < CAPABILITY_BYTES:
            raise WorkerInputError(f"capability has {len(request.capability)} bytes, at least "
                                   f"{CAPABILITY_BYTES} (random) are required")
        hidden: F32 = np.frombuffer(tensor.data, dtype="<f4").reshape(t, d)
        if not np.isfinite(hidden).all():
            raise WorkerInputError("hidden.data contains NaN or infinite values")
        job = Job(session_id=request.session_id, first_layer=first, last_layer=last, positions=positions,
                  hidden=hidden)
        job.owner = self._prefix_ask(request, start)
        if context is not None:
            job.caller = self._caller(context)
            job.session_id = _scoped(job.caller, request.session_id)
            job.is_active = context.is_active
            remaining = context.time_remaining()
            if remaining is not None:
                job.deadline = time.monotonic() + remaining
        return job

    def _prefix_ask(self, request: mesh_pb2.ForwardRequest, start: int) -> _PrefixAsk | None:
        hashes, length = tuple(request.prefix_hashes), request.prefix_length
        if len(hashes) > self.backend.context_length // PREFIX_BLOCK + 1:
            raise WorkerInputError(f"prefix_hashes has {len(hashes)} entries, more than the context length "
                                   f"{self.backend.context_length} has blocks of {PREFIX_BLOCK}")
        if any(not h or len(h) > 128 for h in hashes):
            raise WorkerInputError("prefix_hashes entries must be 1 to 128 characters")
        if length:
            if length < 0 or length % PREFIX_BLOCK or length // PREFIX_BLOCK > len(hashes):
                raise WorkerInputError(
                    f"prefix_length={length} must be a positive multiple of {PREFIX_BLOCK} named by "
                    f"prefix_hashes ({len(hashes)} entries)")
            if start != length:
                raise WorkerInputError(f"prefix_length={length} but positions start at {start}")
        return _PrefixAsk(hashes, length) if hashes else None

    def _remember(self, job: Job, fragments: Sequence[int], caches: Sequence[KVCache]) -> None:
        """Keep the prompt prefix a step just completed (the caller holds the lock)."""
        ask = job.owner
        if isinstance(ask, _PrefixAsk):
            for fragment, kv in zip(fragments, caches, strict=True):
                self.prefixes.remember(ask.hashes, fragment, kv)

    def _caller(self, context: Any) -> str:
        """Who calls: the token's principal and the peer host (the peer host alone without tokens)."""
        host = caller_of(context.peer())
        if self.auth is None:
            return host
        principal = self.auth.principal(context.invocation_metadata())
        if principal is None:  # the interceptor refuses these before any handler: defence in depth
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mesh token")
        return f"{principal}@{host}"

    # ---- compute (batch leader) ----------------------------------------------------------------------

    def _fragments(self, job: Job) -> list[int]:
        return [first for first, last in self.config.fragments
                if job.first_layer <= first and last <= job.last_layer]

    def _admit(self, job: Job, fragments: list[int], now: float) -> list[KVCache]:
        start = job.positions[0]
        if self.draining and job.session_id not in self.store:
            raise WorkerDrainingError(
                f"{self.config.node_id!r} is draining (shutting down): it opens no new session; route "
                f"{job.session_id!r} elsewhere")
        ask = job.owner
        if isinstance(ask, _PrefixAsk) and ask.length and job.session_id not in self.store:
            wanted = ask.hashes[ask.length // PREFIX_BLOCK - 1]
            if not self.prefixes.holds(wanted, fragments):
                raise PrefixNotCachedError(
                    f"{self.config.node_id!r} does not hold the prefix {wanted!r} ({ask.length} positions) "
                    f"on layers {job.first_layer}-{job.last_layer}: send the whole prompt")
            caches = self.store.admit(job.session_id, fragments, ask.length + len(job.positions), now,
                                      job.caller)
            for fragment, kv in zip(fragments, caches, strict=True):
                self.prefixes.seed(wanted, ask.length, fragment, kv)
            self.prefixes.hits += 1
            self.prefixes.tokens_reused += ask.length
            return caches
        if start > 0 and job.session_id not in self.store:
            raise SessionNotFoundError(
                f"unknown session_id {job.session_id!r} on {self.config.node_id!r} (closed, expired or never "
                f"opened); positions start at {start}, so its KV cache is needed")
        cached = self.store.length(job.session_id, fragments)
        if start != cached:
            raise WorkerInputError(
                f"positions start at {start} but session {job.session_id!r} has {cached} cached positions "
                f"on layers {job.first_layer}-{job.last_layer}")
        return self.store.admit(job.session_id, fragments, len(job.positions), now, job.caller)

    def _run(self, jobs: list[Job]) -> list[F32 | BaseException]:
        if len(jobs) == 1 and not jobs[0].is_decode:
            return [self._prefill_slice(jobs[0])]
        results: list[F32 | BaseException] = []
        admitted: list[tuple[int, list[KVCache]]] = []
        opened: set[str] = set()  # sessions this step creates (dropped again if it fails)
        fragments = self._fragments(jobs[0])
        with self._lock:
            now = time.monotonic()
            self.store.evict_idle(now)
            for i, job in enumerate(jobs):
                try:
                    _stop_if_abandoned(job)  # the caller left while it queued: never compute it
                    new = job.session_id not in self.store
                    admitted.append((i, self._admit(job, fragments, now)))
                    if new:
                        opened.add(job.session_id)
                    results.append(_PENDING)
                except WorkerError as exc:
                    results.append(exc)
        if not admitted:
            return results
        lengths = [[kv.length for kv in caches] for _, caches in admitted]
        try:
            if len(jobs) == 1:
                results[0] = self._forward_one(jobs[0], fragments, admitted[0][1])
            else:
                idx = [i for i, _ in admitted]
                hidden = np.concatenate([jobs[i].hidden for i in idx], axis=0)  # [B, d]
                positions = np.asarray([jobs[i].positions[0] for i in idx], np.int64)  # [B]
                out = self.backend.forward_batch(fragments, hidden, positions, [c for _, c in admitted])
                for row, i in enumerate(idx):
                    results[i] = out[row : row + 1]
        except Exception as exc:
            error: BaseException = exc
            if isinstance(exc, ModelInputError):
                error = WorkerInputError(str(exc))
            elif not isinstance(exc, WorkerError):
                log.exception("forward failed on %s", self.config.node_id)
            for (i, caches), before in zip(admitted, lengths, strict=True):
                for kv, n in zip(caches, before, strict=True):
                    kv.truncate(n)  # leave every session as it was
                results[i] = error
            with self._lock:
                for i, _ in admitted:
                    if jobs[i].session_id in opened:
                        self.store.close(jobs[i].session_id)
        with self._lock:
            for i, _ in admitted:
                self.store.refresh(jobs[i].session_id)
        return results

    def _prefill_slice(self, job: Job) -> F32 | BaseException:
        """One slice of a step of several rows: its next layers of its chunk in progress, one layer at a
        time, until the step is done or another session's job is queued (:meth:`StepBatcher.contended`);
        :data:`MORE` until its last slice, then its output. A failure or an abandoned caller leaves the
        session as it was before the step."""
        st: _Prefill | None = job.state
        if st is None:
            fragments = self._fragments(job)
            with self._lock:
                now = time.monotonic()
                self.store.evict_idle(now)
                try:
                    _stop_if_abandoned(job)
                    new = job.session_id not in self.store
                    caches = self._admit(job, fragments, now)
                except WorkerError as exc:
                    return exc
            st = job.state = _Prefill(fragments, caches, [kv.length for kv in caches], new)
        t = len(job.positions)
        try:
            if st.row == 0 and st.frag == 0 and st.layer == 0:
                for kv in st.caches:  # the whole step's room now (admitted): no doubling copy inside a slice
                    kv.reserve(t)
            while True:
                _stop_if_abandoned(job)
                if st.frag == 0 and st.layer == 0:  # a new chunk (rows by position only: limits.chunk_rows)
                    rows = t if t <= PREFILL_CHUNK_TOKENS else chunk_rows(job.positions[st.row])
                    st.rows = min(rows, t - st.row)
                    st.x = job.hidden[st.row : st.row + st.rows]  # [C, d]
                pos = np.asarray(job.positions[st.row : st.row + st.rows], np.int64)
                fragment = st.fragments[st.frag]
                st.x = self.backend.forward_layer(fragment, st.layer, st.x, pos, st.caches[st.frag])
                st.layer += 1
                if st.layer == self._layers[fragment]:
                    st.frag, st.layer = st.frag + 1, 0
                    if st.frag == len(st.fragments):
                        st.outs.append(st.x)
                        st.row, st.frag = st.row + st.rows, 0
                        if st.row == t:
                            break
                if self.batcher.contended(job):
                    return MORE
        except Exception as exc:
            error: BaseException = exc
            if isinstance(exc, ModelInputError):
                error = WorkerInputError(str(exc))
            elif not isinstance(exc, WorkerError):
                log.exception("forward failed on %s", self.config.node_id)
            for kv, n in zip(st.caches, st.before, strict=True):
                kv.truncate(n)  # leave the session as it was
            with self._lock:
                if st.opened:
                    self.store.close(job.session_id)
                else:
                    self.store.refresh(job.session_id)
            job.state = None
            return error
        with self._lock:
            self.store.refresh(job.session_id)
            self._remember(job, st.fragments, st.caches)
        job.state = None
        return np.concatenate(st.outs, axis=0)

    def _forward_one(self, job: Job, fragments: list[int], caches: list[KVCache]) -> F32:
        """One session's decode step (steps of several rows go by :meth:`_prefill_slice`)."""
        return self.backend.forward(fragments, job.hidden, np.asarray(job.positions, np.int64), caches)

    # ---- RPCs ---------------------------------------------------------------------------------------------

    def Forward(self, request: mesh_pb2.ForwardRequest, context: Any) -> mesh_pb2.ForwardResponse:
        t0 = time.perf_counter()
        try:
            job = self._job(request, context)
            out, queue_ms, compute_ms, batch = self.batcher.run(job)
        except WorkerError as exc:
            self.health.record_request((time.perf_counter() - t0) * 1000.0, ok=False)
            context.abort(_STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), str(exc))
            raise AssertionError("unreachable") from exc  # context.abort raises
        except Exception as exc:
            self.health.record_request((time.perf_counter() - t0) * 1000.0, ok=False)
            log.exception("Forward failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            raise AssertionError("unreachable") from exc
        self.health.record_request(queue_ms + compute_ms, ok=True)
        if request.capability:
            bind_capability(self, request.capability, job.session_id)
        return self._reply(out, queue_ms, compute_ms, batch)

    def ForwardBatch(
        self, request: mesh_pb2.ForwardBatchRequest, context: Any
    ) -> mesh_pb2.ForwardBatchResponse:
        t0 = time.perf_counter()
        results: list[mesh_pb2.ForwardItemResult | None] = []
        jobs: list[tuple[int, Job]] = []
        for i, item in enumerate(request.items):
            try:
                jobs.append((i, self._job(item, context)))
                results.append(None)
            except WorkerError as exc:
                results.append(self._error_item(exc))
        self.batcher.run_many([job for _, job in jobs])
        for i, job in jobs:
            if isinstance(job.result, BaseException):
                results[i] = self._error_item(job.result)
            else:
                assert job.result is not None
                if request.items[i].capability:
                    bind_capability(self, request.items[i].capability, job.session_id)
                results[i] = mesh_pb2.ForwardItemResult(reply=self._reply(
                    job.result, job.queue_ms, job.compute_ms, job.batch_size))
        items = [r for r in results if r is not None]
        for r in items:
            failed_ms = (time.perf_counter() - t0) * 1000.0
            ok = r.code == 0
            self.health.record_request(r.reply.queue_ms + r.reply.compute_ms if ok else failed_ms, ok=ok)
        return mesh_pb2.ForwardBatchResponse(items=items)

    def Chain(self, request: mesh_pb2.ChainRequest, context: Any) -> mesh_pb2.ChainAck:
        """One hop of a worker-to-worker chain (:mod:`ethen.mesh.worker.chain`)."""
        return handle_chain(self, request, context)

    def _error_item(self, exc: BaseException) -> mesh_pb2.ForwardItemResult:
        if isinstance(exc, WorkerError):
            code = _STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT)
            message = str(exc)
        else:
            log.error("ForwardBatch item failed: %s: %s", type(exc).__name__, exc)
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        return mesh_pb2.ForwardItemResult(code=code.value[0], message=message)

    @staticmethod
    def _reply(out: F32, queue_ms: float, compute_ms: float, batch: int) -> mesh_pb2.ForwardResponse:
        data = np.ascontiguousarray(out, dtype="<f4")
        return mesh_pb2.ForwardResponse(
            hidden=mesh_pb2.Tensor(data=data.tobytes(), shape=list(data.shape), dtype="float32"),
            compute_ms=compute_ms, queue_ms=queue_ms, batch_size=batch)

    def Health(self, request: mesh_pb2.HealthRequest, context: Any) -> mesh_pb2.HealthResponse:
        snap = self.health.snapshot(time.monotonic())
        with self._lock:
            self.store.evict_idle(time.monotonic())
            sessions, nbytes = len(self.store), self.store.nbytes
            prefixes = self.prefixes.names()
            hits, reused = self.prefixes.hits, self.prefixes.tokens_reused
        return mesh_pb2.HealthResponse(
            node_id=self.config.node_id,
            served_layers=[mesh_pb2.LayerRange(first=a, last=b) for a, b in self.config.fragments],
            latency_ms=snap.latency_ms, load=snap.load, served_requests=snap.served_requests,
            failed_requests=snap.failed_requests, alive=not self.draining,
            capacity_score=self.config.capacity_score, active_sessions=sessions, cache_bytes=nbytes,
            cache_bytes_limit=self.store.max_bytes, draining=self.draining, model_sha256=self.model_sha256,
            cached_prefixes=prefixes, prefix_hits=hits, prefix_tokens_reused=reused,
            max_sessions=self.store.max_sessions, max_sessions_per_caller=self.store.max_per_owner)

    def CloseSession(
        self, request: mesh_pb2.CloseSessionRequest, context: Any
    ) -> mesh_pb2.CloseSessionResponse:
        sid = request.session_id
        key = sid if context is None else _scoped(self._caller(context), sid)
        with self._lock:
            closed = self.store.close(key)
            self.caps.forget(key)
        self.batcher.forget(key)
        return mesh_pb2.CloseSessionResponse(closed=closed)

    def drain(self) -> None:
        """Open no new session from now on (Health says ``draining``); open sessions go on."""
        self.draining = True

    def open_sessions(self) -> int:
        with self._lock:
            self.store.evict_idle(time.monotonic())
            return len(self.store)

    def wait_drained(self, timeout_s: float, poll_s: float = 0.05,
                     give_up: Callable[[], bool] = lambda: False) -> int:
        """Wait until no session is open, ``timeout_s`` passed or ``give_up()``; returns the sessions still
        open."""
        deadline = time.monotonic() + timeout_s
        left = self.open_sessions()
        while left and time.monotonic() < deadline and not give_up():
            time.sleep(poll_s)
            left = self.open_sessions()
        return left

    def stop(self) -> None:
        self.batcher.stop()
        self.chain.close()


def _scoped(caller: str, session_id: str) -> str:
    """The store's key of a caller's session: callers never share a session namespace."""
    return f"{caller}/{session_id}"


def serve(service: WorkerService, host: str, port: int, max_workers: int = 32, *,
          tls: Any = None) -> tuple[Any, int]:
    """Start a gRPC server for ``service``; returns (server, bound port). ``port=0`` picks a free port.
    ``tls``: grpc server credentials (:func:`ethen.mesh.auth.server_credentials`); ``service.auth``, when
    set, is enforced on every call by an interceptor."""
    interceptors = [] if service.auth is None else [TokenInterceptor(service.auth)]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ethen-rpc"),
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                 ("grpc.max_send_message_length", 64 * 1024 * 1024),
                 ("grpc.so_reuseport", 0)],
        interceptors=interceptors,
    )
    mesh_pb2_grpc.add_MeshWorkerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, bound
