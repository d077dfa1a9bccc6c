"""The mesh data plane: a gRPC worker serving whole fragments of the model's layers (``ethen worker``)."""

from ethen.mesh.worker.backend import FragmentBackend, ModelBackend
from ethen.mesh.worker.batching import StepBatcher
from ethen.mesh.worker.errors import SessionCapacityError, SessionNotFoundError, WorkerError, WorkerInputError
from ethen.mesh.worker.health import HealthSnapshot, HealthTracker
from ethen.mesh.worker.server import WorkerConfig, WorkerService, parse_fragments, serve
from ethen.mesh.worker.sessions import SessionStore

__all__ = [
    "FragmentBackend",
    "HealthSnapshot",
    "HealthTracker",
    "ModelBackend",
    "SessionCapacityError",
    "SessionNotFoundError",
    "SessionStore",
    "StepBatcher",
    "WorkerConfig",
    "WorkerError",
    "WorkerInputError",
    "WorkerService",
    "parse_fragments",
    "serve",
]
