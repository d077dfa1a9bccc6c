"""The mesh data plane: a gRPC worker serving whole fragments of the model's layers (``ethen worker``).

The names below load lazily (PEP 562), so importing the ``ethen worker`` command does not import NumPy before
it has set its BLAS thread defaults (see :mod:`ethen.mesh.worker.cli`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MAX_PREFILL_TOKENS",
    "MAX_SESSIONS_PER_CALLER",
    "PREFILL_CHUNK_TOKENS",
    "DeadlineExceededError",
    "FragmentBackend",
    "HealthSnapshot",
    "HealthTracker",
    "ModelBackend",
    "RequestCancelledError",
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

_HOME = {
    "MAX_PREFILL_TOKENS": "limits",
    "MAX_SESSIONS_PER_CALLER": "limits",
    "PREFILL_CHUNK_TOKENS": "limits",
    "DeadlineExceededError": "errors",
    "RequestCancelledError": "errors",
    "FragmentBackend": "backend",
    "ModelBackend": "backend",
    "StepBatcher": "batching",
    "SessionCapacityError": "errors",
    "SessionNotFoundError": "errors",
    "WorkerError": "errors",
    "WorkerInputError": "errors",
    "HealthSnapshot": "health",
    "HealthTracker": "health",
    "WorkerConfig": "config",
    "WorkerService": "server",
    "parse_fragments": "config",
    "serve": "server",
    "SessionStore": "sessions",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
