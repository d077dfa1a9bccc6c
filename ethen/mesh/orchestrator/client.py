"""A persistent gRPC channel to one worker: Forward / Health / CloseSession with raw float32 bytes.

:meth:`WorkerClient.forward_many` sends several sessions' steps for one node in a single ``ForwardBatch``
RPC (the orchestrator's decode rounds use it: B sessions cost one RPC per stage per token).

Credentials (:class:`~ethen.mesh.auth.ClientCredentials`): with a CA the channel is TLS and checks the
worker's certificate against it; with a token every call carries ``authorization: Bearer <token>``.

Every ``grpc.RpcError`` is turned into the mesh exception tree here (via
:func:`~ethen.mesh.orchestrator.errors.from_grpc`), so nothing above this module sees gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from ethen.mesh.auth import ClientCredentials
from ethen.mesh.grpc_options import CHANNEL_OPTIONS
from ethen.mesh.orchestrator.errors import NodeError, NodeUnavailable, from_grpc, from_status
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["ForwardResult", "WorkerClient"]

F32 = npt.NDArray[np.float32]

_OPTIONS = CHANNEL_OPTIONS  # ethen.mesh.grpc_options: one list for every mesh channel


class ForwardResult:
    __slots__ = ("batch_size", "compute_ms", "hidden", "queue_ms")

    def __init__(self, hidden: F32, compute_ms: float, queue_ms: float, batch_size: int) -> None:
        self.hidden = hidden
        self.compute_ms = compute_ms
        self.queue_ms = queue_ms
        self.batch_size = batch_size


class WorkerClient:
    """Blocking client of one worker (thread-safe: gRPC channels are)."""

    def __init__(self, node_id: str, address: str, forward_timeout_s: float = 60.0,
                 health_timeout_s: float = 0.5, credentials: ClientCredentials | None = None) -> None:
        self.node_id = node_id
        self.address = address
        self.forward_timeout_s = forward_timeout_s
        self.health_timeout_s = health_timeout_s
        creds = credentials or ClientCredentials()
        self._md = creds.metadata
        self._channel = creds.channel(address, _OPTIONS)
        self._stub: Any = mesh_pb2_grpc.MeshWorkerStub(self._channel)  # type: ignore[no-untyped-call]
        self._pending: set[Any] = set()  # chain calls in flight (set.add/discard are atomic)
        self._calls = 0  # Forward / ForwardBatch calls in flight
        self._calls_lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Stage calls to this worker in flight now (its liveness is judged by their progress)."""
        return self._calls + len(self._pending)

    def _count(self, delta: int) -> None:
        with self._calls_lock:
            self._calls += delta

    @staticmethod
    def _request(session_id: str, first: int, last: int, data: F32, start: int,
                 capability: bytes = b"", prefix_hashes: Sequence[str] = (),
                 prefix_length: int = 0) -> mesh_pb2.ForwardRequest:
        t = int(data.shape[0])
        return mesh_pb2.ForwardRequest(
            session_id=session_id, first_layer=first, last_layer=last, positions=range(start, start + t),
            hidden=mesh_pb2.Tensor(data=data.tobytes(), shape=data.shape, dtype="float32"),
            capability=capability, prefix_hashes=prefix_hashes, prefix_length=prefix_length)

    def _check(self, reply: mesh_pb2.ForwardResponse, shape: tuple[int, ...]) -> F32:
        got = tuple(reply.hidden.shape)
        nbytes = 4 * int(np.prod(shape))
        if reply.hidden.dtype != "float32" or got != shape or len(reply.hidden.data) != nbytes:
            raise NodeUnavailable(self.node_id, f"malformed Forward reply: shape {list(got)} dtype "
                                                f"{reply.hidden.dtype!r} ({len(reply.hidden.data)} bytes)")
        out: F32 = np.frombuffer(reply.hidden.data, dtype="<f4").reshape(shape)
        return out

    def forward_many(self, items: list[tuple[str, int, int, F32, int]],
                     timeout_s: float | None = None) -> list[ForwardResult | NodeError]:
        """Several ``(session_id, first, last, hidden, start)`` steps in one ``ForwardBatch`` RPC; each item
        gets its result or its own error (a failed RPC fails every item). ``timeout_s``: this call's
        deadline (default ``forward_timeout_s``)."""
        request = mesh_pb2.ForwardBatchRequest(items=[self._request(*item) for item in items])
        self._count(1)
        try:
            reply = self._stub.ForwardBatch(request, timeout=timeout_s or self.forward_timeout_s,
                                            metadata=self._md)
        except grpc.RpcError as exc:
            return [from_grpc(self.node_id, exc) for _ in items]
        finally:
            self._count(-1)
        if len(reply.items) != len(items):
            text = f"ForwardBatch answered {len(reply.items)} of {len(items)} items"
            return [NodeUnavailable(self.node_id, text) for _ in items]
        out: list[ForwardResult | NodeError] = []
        for (_, _, _, hidden, _), item in zip(items, reply.items, strict=True):
            if item.code:
                out.append(from_status(self.node_id, item.code, item.message))
                continue
            try:
                r = item.reply
                out.append(ForwardResult(self._check(r, tuple(hidden.shape)), r.compute_ms, r.queue_ms,
                                         r.batch_size))
            except NodeUnavailable as exc:
                out.append(exc)
        return out

    def forward(self, session_id: str, first: int, last: int, hidden: F32, start: int,
                timeout_s: float | None = None, capability: bytes = b"", prefix_hashes: Sequence[str] = (),
                prefix_length: int = 0) -> ForwardResult:
        """Run layers ``first..last`` on ``hidden`` [T, d] at positions ``start .. start+T-1``;
        ``capability`` binds the session to it on the worker (a chain's peers may then feed it);
        ``prefix_hashes`` name the prompt's blocks (the worker keeps their KV rows) and ``prefix_length`` > 0
        opens the session from the worker's cached prefix (issue 45)."""
        data: F32 = np.ascontiguousarray(hidden, dtype="<f4")
        self._count(1)
        try:
            reply = self._stub.Forward(self._request(session_id, first, last, data, start, capability,
                                                     prefix_hashes, prefix_length),
                                       timeout=timeout_s or self.forward_timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_grpc(self.node_id, exc) from None
        finally:
            self._count(-1)
        return ForwardResult(self._check(reply, tuple(data.shape)), reply.compute_ms, reply.queue_ms,
                             reply.batch_size)

    def chain(self, request: mesh_pb2.ChainRequest, timeout_s: float,
              on_error: Callable[[NodeError], None]) -> None:
        """Send a chained decode step to this (first) worker without waiting for its ack
        (:mod:`ethen.mesh.orchestrator.chain`); ``on_error`` gets the mesh error if that call fails."""

        def done(future: Any) -> None:
            self._pending.discard(future)
            if future.cancelled():
                on_error(NodeUnavailable(self.node_id, "the chain call was cancelled"))
            elif future.exception() is not None:
                on_error(from_grpc(self.node_id, future.exception()))

        try:
            future = self._stub.Chain.future(request, timeout=timeout_s, metadata=self._md)
        except (grpc.RpcError, ValueError, RuntimeError) as exc:  # a closed channel
            on_error(NodeUnavailable(self.node_id, f"cannot send the chain call: {exc}"))
            return
        self._pending.add(future)  # held until it completes: a dropped future may cancel its call
        future.add_done_callback(done)

    def health(self) -> mesh_pb2.HealthResponse:
        try:
            reply: mesh_pb2.HealthResponse = self._stub.Health(mesh_pb2.HealthRequest(),
                                                               timeout=self.health_timeout_s,
                                                               metadata=self._md)
        except grpc.RpcError as exc:
            raise from_grpc(self.node_id, exc) from None
        return reply

    def close_session(self, session_id: str) -> bool:
        try:
            reply = self._stub.CloseSession(mesh_pb2.CloseSessionRequest(session_id=session_id),
                                            timeout=self.health_timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_grpc(self.node_id, exc) from None
        return bool(reply.closed)

    def close(self) -> None:
        self._channel.close()
