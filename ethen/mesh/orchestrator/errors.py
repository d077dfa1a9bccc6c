"""Errors of the mesh runtime (orchestrator side), and the one place gRPC errors become mesh errors.

The whole of ``ethen.mesh`` shares one exception tree rooted at
:class:`~ethen.mesh.errors.MeshError`: the router's errors (``NoRouteAvailable``,
``RoutingFailure``, ``InvalidMeshInput``) and the runtime's errors below all derive from it, so a caller (the
gateway's ``mesh`` provider) catches the mesh with one ``except``.

:func:`from_grpc` maps a worker's gRPC status to the tree:

==========================================================  ==========================================
``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``CANCELLED``,       :class:`NodeUnavailable` (fail over)
``UNKNOWN``, ``INTERNAL``, ``ABORTED``
``NOT_FOUND`` (the worker lost the session: restarted,       :class:`SessionLost` (fail over: replay)
expired)
``RESOURCE_EXHAUSTED`` (session or memory cap)               :class:`NodeOverloaded` (fail over)
``INVALID_ARGUMENT`` and the rest                            :class:`NodeRejected` (a bug: no failover)
==========================================================  ==========================================

Each node error keeps the gRPC status name in ``status`` (``"DEADLINE_EXCEEDED"``, ...), so the orchestrator
tells a call that ran out of time (the node may only be busy) from one the node refused or never took.
:class:`MeshSaturated` is the orchestrator's own refusal: the mesh cannot take the request in time (its
workers' queues, their session caps); the gateway answers it before the first byte (issue 42).
"""

from __future__ import annotations

from typing import Any

import grpc

from ethen.mesh.errors import MeshError
from ethen.mesh.routing.route import Route

__all__ = [
    "ChainLost",
    "DegradedRoute",
    "MeshRuntimeError",
    "MeshSaturated",
    "NodeOverloaded",
    "NodeRejected",
    "NodeUnavailable",
    "PrefixMissing",
    "SessionLost",
    "from_grpc",
    "from_status",
]


class MeshRuntimeError(MeshError):
    """Base of the orchestrator's runtime errors."""


class NodeError(MeshRuntimeError):
    def __init__(self, node_id: str, detail: str, status: str = "") -> None:
        self.node_id = node_id
        self.detail = detail
        self.status = status  # the gRPC status name when a worker answered one ("" otherwise)
        self.sent_at: float | None = None  # when the failed call left (the caller's monotonic clock)
        super().__init__(f"node {node_id!r}: {detail}")

    @property
    def timed_out(self) -> bool:
        """The call ran out of time (``DEADLINE_EXCEEDED``): the node is stuck, cut off, or only busy."""
        return self.status == "DEADLINE_EXCEEDED"


class NodeUnavailable(NodeError):
    """The node did not answer (dead, unreachable, timed out): the orchestrator fails over."""


class SessionLost(NodeUnavailable):
    """The node answered but no longer holds the session's KV cache (restarted, expired)."""


class NodeOverloaded(NodeUnavailable):
    """The node refused the session (memory or session cap): the orchestrator fails over."""


class MeshSaturated(MeshRuntimeError):
    """The mesh cannot take this request in time: no worker slot freed within the admission budget, or every
    route's worker refused it (``RESOURCE_EXHAUSTED``: session or memory cap, busy). Raised before the
    generation's first token only; ``retry_after_s`` is when trying again makes sense (whole seconds)."""

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        self.retry_after_s = max(1, int(retry_after_s))
        super().__init__(f"mesh saturated: {detail}")


class NodeRejected(NodeError):
    """The node refused the request as malformed (``INVALID_ARGUMENT``): a bug, never retried elsewhere."""


class PrefixMissing(NodeError):
    """The node no longer holds the prompt prefix the session asked it to seed from (``FAILED_PRECONDITION``:
    evicted since its last Health): the session prefills the whole prompt instead; the node is healthy."""


class ChainLost(MeshRuntimeError):
    """A chained decode step never came back (its delivery failed): which stages advanced is unknown, so the
    session rebuilds every stage by replay (:mod:`ethen.mesh.orchestrator.chain`)."""


class DegradedRoute(MeshRuntimeError):
    """Failover could only build a degraded route (spec §6.4: layers without a live holder). The mesh cannot
    run a pipeline with a gap, so the request fails with this error; ``route`` names the survivors and the
    fallback model, so a caller (the gateway) can retry on that model."""

    def __init__(self, route: Route) -> None:
        self.route = route
        super().__init__(f"no live node serves some layers; degraded route to model {route.model!r}: "
                         f"{route.reason}")


_UNAVAILABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}


def from_status(node_id: str, code_value: int, message: str) -> NodeError:
    """The mesh error for one failed ``ForwardBatch`` item (``code_value`` is a ``grpc.StatusCode`` value)."""
    code = _BY_VALUE.get(code_value, grpc.StatusCode.UNKNOWN)
    return _classify(node_id, code, message)


def from_grpc(node_id: str, exc: Any) -> NodeError:
    """The mesh error for a ``grpc.RpcError`` raised by a call to ``node_id``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _classify(node_id, code, details)


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def _classify(node_id: str, code: Any, details: str) -> NodeError:
    name = str(getattr(code, "name", code))
    text = f"{name}: {details}"
    if code == grpc.StatusCode.NOT_FOUND:
        return SessionLost(node_id, text, name)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return PrefixMissing(node_id, text, name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NodeOverloaded(node_id, text, name)
    if code in _UNAVAILABLE or code is None:
        return NodeUnavailable(node_id, text, "" if code is None else name)
    return NodeRejected(node_id, text, name)
