"""The worker's side of a worker-to-worker chain (``data_plane = "chain"``): capabilities and onward sends.

A chained decode step (``ChainRequest``, see ``mesh.proto``) reaches this worker at hop ``k``; the worker
computes hop ``k`` for every item (one batched step, like ``ForwardBatch``), then sends the request on to hop
``k + 1``'s worker (or, after the last hop, to the orchestrator's receiver, ``deliver_to``) and acks. The
onward call is a ``.future()`` kept here until it completes: the ack never waits for the rest of the chain,
so per token the critical path crosses the network once per hop plus once back to the orchestrator (4
one-way delays for 3 stages, against 6 for the orchestrator-driven star).

Choices:

- **Who may feed a session** (sessions stay bound to their caller): the orchestrator opens each worker
  session itself (prefill is a plain ``Forward``) and binds an unguessable capability to it (``capability``,
  16 random bytes, ``secrets``); :class:`Capabilities` maps it to the session's caller-scoped key. A chain
  item names the session id *and* its capability: a caller that authenticated (the mesh token, as on every
  RPC) but lacks the capability gets ``NOT_FOUND``, exactly as for an unknown id; an unauthenticated caller
  gets ``UNAUTHENTICATED`` from the interceptor before anything. The capability of hop ``k + 1`` travels
  through hop ``k`` (it must feed it), so a chain's workers can feed each other's sessions of that route and
  nothing else. A capability is never rebound to a different live session.
- **Peers**: a worker calls its peers with the credentials it is given (``--ca-file`` verifies their TLS
  certificates, the first token of ``--token-file`` authenticates it), one cached channel per address.
- **Failures travel forward**: an item this worker cannot compute is marked (its gRPC code, message and this
  node id) and travels on uncomputed; a failed onward call (the next worker dead, cut off, or stuck past the
  step's deadline) marks every item still running with the next hop's node id and delivers straight to the
  orchestrator, which thus learns which node failed. The onward call's deadline is what is left of this
  call's, so a stuck worker is detected by the step's progress deadline, not by ping.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import grpc
import numpy as np

from ethen.mesh.auth import ClientCredentials
from ethen.mesh.grpc_options import CHANNEL_OPTIONS
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.worker.batching import Job, StepBatcher
from ethen.mesh.worker.errors import GRPC_STATUS, SessionNotFoundError, WorkerError, WorkerInputError
from ethen.mesh.worker.health import HealthTracker
from ethen.mesh.worker.sessions import SessionStore

__all__ = [
    "CAPABILITY_BYTES", "Capabilities", "ChainSender", "ChainService", "bind_capability", "handle_chain",
]

log = logging.getLogger("ethen.mesh.worker")

CAPABILITY_BYTES = 16  # at least: shorter capabilities are refused (guessable)

_OPTIONS = CHANNEL_OPTIONS  # ethen.mesh.grpc_options: one list for every mesh channel


class Capabilities:
    """capability -> the caller-scoped session key it was bound to (guarded by the service's lock)."""

    def __init__(self, limit: int) -> None:
        self._keys: dict[bytes, str] = {}
        self.limit = limit  # past this many bindings, those of sessions no longer held are dropped

    def bind(self, capability: bytes, key: str, live: Any) -> None:
        """Bind ``capability`` to ``key`` unless it is bound to another session still in ``live``."""
        old = self._keys.get(capability)
        if old is not None and old != key and old in live:
            return
        self._keys[capability] = key
        if len(self._keys) > self.limit:
            self._keys = {c: k for c, k in self._keys.items() if k in live}

    def key(self, capability: bytes) -> str | None:
        return self._keys.get(capability)

    def forget(self, key: str) -> None:
        for cap in [c for c, k in self._keys.items() if k == key]:
            del self._keys[cap]


class ChainSender:
    """Sends chain requests on (next hop or receiver) and keeps each call alive until it completes."""

    def __init__(self, node_id: str, credentials: ClientCredentials | None) -> None:
        self.node_id = node_id
        self.credentials = credentials or ClientCredentials()
        self._md = self.credentials.metadata
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, Any, Any]] = {}
        self._pending: set[Any] = set()  # a dropped future would cancel its call
        self.sent = 0
        self.failed = 0

    def _stub(self, address: str) -> tuple[Any, Any]:
        with self._lock:
            got = self._stubs.get(address)
            if got is None:
                channel = self.credentials.channel(address, _OPTIONS)
                got = (channel, mesh_pb2_grpc.MeshWorkerStub(channel),  # type: ignore[no-untyped-call]
                       mesh_pb2_grpc.MeshChainReceiverStub(channel))  # type: ignore[no-untyped-call]
                self._stubs[address] = got
            return got[1], got[2]

    def send(self, request: mesh_pb2.ChainRequest, timeout_s: float) -> None:
        """Send ``request`` (its ``hop`` already advanced) to its next hop, or deliver it after the last."""
        hop = request.hop
        delivering = hop >= len(request.hops)
        address = request.deliver_to if delivering else request.hops[hop].address
        worker, receiver = self._stub(address)
        call = receiver.Deliver if delivering else worker.Chain
        try:
            future = call.future(request, timeout=max(timeout_s, 0.001), metadata=self._md)
        except Exception as exc:  # a malformed address, a closed channel
            self._failed(request, delivering, grpc.StatusCode.UNAVAILABLE, str(exc))
            return
        with self._lock:
            self._pending.add(future)
            self.sent += 1
        future.add_done_callback(lambda f: self._done(f, request, delivering, timeout_s))

    def _done(self, future: Any, request: mesh_pb2.ChainRequest, delivering: bool, timeout_s: float) -> None:
        with self._lock:
            self._pending.discard(future)
        if future.cancelled():
            self._failed(request, delivering, grpc.StatusCode.CANCELLED, "the onward call was cancelled")
            return
        exc = future.exception()
        if exc is not None:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNAVAILABLE
            details = exc.details() if hasattr(exc, "details") else str(exc)
            self._failed(request, delivering, code, details)

    def _failed(self, request: mesh_pb2.ChainRequest, delivering: bool, code: grpc.StatusCode,
                details: str) -> None:
        with self._lock:
            self.failed += 1
        if delivering:  # nobody left to tell: the orchestrator's deadline catches it
            log.warning("%s: delivering a chain result to %s failed: %s %s", self.node_id, request.deliver_to,
                        code.name, details)
            return
        node = request.hops[request.hop].node_id
        for item in request.items:
            if not item.code:
                item.code = code.value[0]
                item.message = f"chain call from {self.node_id!r} to {node!r}: {code.name}: {details}"
                item.failed_node = node
        request.hop = len(request.hops)
        self.send(request, 5.0)

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for channel, _, _ in stubs:
            channel.close()



class _NodeConfig(Protocol):
    @property
    def node_id(self) -> str: ...


class ChainService(Protocol):
    """What a chain hop uses of the worker's service (:class:`~ethen.mesh.worker.server.WorkerService` is
    one); a protocol, so this module does not import the server that imports it."""

    _lock: threading.Lock
    store: SessionStore[Any]
    caps: Capabilities
    chain: ChainSender
    health: HealthTracker

    @property
    def config(self) -> _NodeConfig: ...
    @property
    def batcher(self) -> StepBatcher: ...

    def _caller(self, context: Any) -> str: ...

    def _job(self, request: mesh_pb2.ForwardRequest, context: Any = None) -> Job: ...


def bind_capability(service: ChainService, capability: bytes, key: str) -> None:
    """After a successful ``Forward`` carrying ``capability``: bind it to the session ``key`` (if held)."""
    with service._lock:
        if key in service.store:
            service.caps.bind(capability, key, service.store)


def handle_chain(service: ChainService, request: mesh_pb2.ChainRequest, context: Any) -> mesh_pb2.ChainAck:
    """``MeshWorker.Chain``: compute this hop for every item still running, send the request on, ack."""
    hop = request.hop
    if not 0 <= hop < len(request.hops):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hop={hop} is not an index of hops "
                                                        f"({len(request.hops)} hops)")
    if not request.deliver_to or len(request.ticket) < CAPABILITY_BYTES:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"deliver_to={request.deliver_to!r} and a ticket of >= {CAPABILITY_BYTES} bytes are "
                      f"required (got {len(request.ticket)} bytes)")
    here = request.hops[hop]
    service._caller(context)  # authenticated (the interceptor refuses the rest first)
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    jobs: list[tuple[mesh_pb2.ChainItem, Job]] = []
    for item in request.items:
        if item.code:
            continue
        try:
            jobs.append((item, _job(service, here, item, hop, len(request.hops), deadline, context)))
        except WorkerError as exc:
            _mark(item, exc, service.config.node_id)
    service.batcher.run_many([job for _, job in jobs])
    for item, job in jobs:
        if isinstance(job.result, BaseException):
            _mark(item, job.result, service.config.node_id)
            continue
        assert job.result is not None
        out = np.ascontiguousarray(job.result, dtype="<f4")
        tensor = mesh_pb2.Tensor(data=out.tobytes(), shape=list(out.shape), dtype="float32")
        item.outputs.append(tensor)
        item.worker_ms.append(job.queue_ms + job.compute_ms)
        item.compute_ms.append(job.compute_ms)
        item.batch_size.append(job.batch_size)
        item.hidden.CopyFrom(tensor)
        service.health.record_request(job.queue_ms + job.compute_ms, ok=True)
    request.hop = hop + 1
    left = None if deadline is None else deadline - time.monotonic()
    service.chain.send(request, 60.0 if left is None else left)
    return mesh_pb2.ChainAck()


def _job(service: ChainService, here: mesh_pb2.ChainHop, item: mesh_pb2.ChainItem, hop: int, hops: int,
         deadline: float | None, context: Any) -> Job:
    if len(item.session_ids) != hops or len(item.capabilities) != hops:
        raise WorkerInputError(f"an item names {len(item.session_ids)} session ids and "
                               f"{len(item.capabilities)} capabilities for {hops} hops")
    sid, cap = item.session_ids[hop], item.capabilities[hop]
    request = mesh_pb2.ForwardRequest(session_id=sid, first_layer=here.first_layer,
                                      last_layer=here.last_layer, positions=[item.position],
                                      hidden=item.hidden)
    job: Job = service._job(request)  # validates layers, shape, positions, values
    with service._lock:
        key = service.caps.key(cap) if len(cap) >= CAPABILITY_BYTES else None
    if key is None or not key.endswith("/" + sid):
        raise SessionNotFoundError(f"unknown session_id {sid!r} or capability on {service.config.node_id!r} "
                                   f"(a chain hop feeds only a session the orchestrator opened and bound to "
                                   f"that capability)")
    job.session_id = key
    job.caller = key[: -len(sid) - 1]  # the session's owner: per-caller caps count it there
    job.is_active = context.is_active
    if deadline is not None:
        job.deadline = deadline
    return job


def _mark(item: mesh_pb2.ChainItem, exc: BaseException, node_id: str) -> None:
    code = GRPC_STATUS.get(type(exc), grpc.StatusCode.INTERNAL) if isinstance(exc, WorkerError) \
        else grpc.StatusCode.INTERNAL
    item.code = code.value[0]
    item.message = f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc)
    item.failed_node = node_id
