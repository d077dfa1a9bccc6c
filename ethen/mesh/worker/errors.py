"""Worker-side errors; :mod:`ethen.mesh.worker.server` maps each to one gRPC status code at its boundary.

They sit in the one exception tree of ``ethen.mesh``
(root :class:`~ethen.mesh.errors.MeshError`).
"""

from __future__ import annotations

import grpc

from ethen.mesh.errors import MeshError

__all__ = [
    "GRPC_STATUS",
    "DeadlineExceededError",
    "PrefixNotCachedError",
    "RequestCancelledError",
    "SessionCapacityError",
    "SessionNotFoundError",
    "WorkerDrainingError",
    "WorkerError",
    "WorkerInputError",
]


class WorkerError(MeshError):
    """Base of the errors a worker reports to its caller."""


class WorkerInputError(WorkerError, ValueError):
    """Bad Forward input (shape, dtype, positions, layer span): ``INVALID_ARGUMENT``."""


class SessionNotFoundError(WorkerError, KeyError):
    """The session is unknown to this worker: ``NOT_FOUND``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


class SessionCapacityError(WorkerError):
    """The session would exceed the worker's KV-cache memory cap or session count: ``RESOURCE_EXHAUSTED``."""


class DeadlineExceededError(WorkerError):
    """The caller's deadline passed before the step was done; it was abandoned: ``DEADLINE_EXCEEDED``."""


class RequestCancelledError(WorkerError):
    """The caller cancelled the RPC; the step was abandoned: ``CANCELLED``."""


class WorkerDrainingError(WorkerError):
    """The worker is draining (SIGTERM): it finishes open sessions but opens no new one: ``UNAVAILABLE`` (the
    orchestrator routes elsewhere)."""


class PrefixNotCachedError(WorkerError):
    """A step asks to seed its session from a prefix this worker does not hold (evicted, never seen, another
    span): ``FAILED_PRECONDITION`` (the orchestrator prefills the whole prompt instead)."""


#: The one error -> gRPC status table (the server's boundary and a chain hop's failed item use it).
GRPC_STATUS: dict[type[WorkerError], grpc.StatusCode] = {
    WorkerInputError: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFoundError: grpc.StatusCode.NOT_FOUND,
    SessionCapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestCancelledError: grpc.StatusCode.CANCELLED,
    WorkerDrainingError: grpc.StatusCode.UNAVAILABLE,
    PrefixNotCachedError: grpc.StatusCode.FAILED_PRECONDITION,
}
