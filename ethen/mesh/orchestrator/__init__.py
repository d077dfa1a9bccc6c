"""The mesh orchestrator: routes each request over gRPC workers, runs prefill + decode, fails over."""

from ethen.mesh.orchestrator.admission import NodeGate
from ethen.mesh.orchestrator.backoff import Backoff
from ethen.mesh.orchestrator.chain import ChainReceiver
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.orchestrator.errors import (
    ChainLost,
    DegradedRoute,
    MeshRuntimeError,
    MeshSaturated,
    NodeOverloaded,
    NodeRejected,
    NodeUnavailable,
    SessionLost,
    from_grpc,
)
from ethen.mesh.orchestrator.planning import mark_dead, plan_route, recompose, runs_whole_fragments
from ethen.mesh.orchestrator.runtime import MODEL_NAME, MeshGeneration, Orchestrator
from ethen.mesh.orchestrator.session import FailoverEvent, MeshSession
from ethen.mesh.orchestrator.telemetry import HealthMonitor, HealthReply, NodeHealth, state_from_health

__all__ = [
    "MODEL_NAME",
    "Backoff",
    "ChainLost",
    "ChainReceiver",
    "DegradedRoute",
    "FailoverEvent",
    "HealthMonitor",
    "HealthReply",
    "MeshGeneration",
    "MeshRuntimeError",
    "MeshSaturated",
    "MeshSession",
    "NodeGate",
    "NodeHealth",
    "NodeOverloaded",
    "NodeRejected",
    "NodeUnavailable",
    "Orchestrator",
    "SessionLost",
    "WorkerClient",
    "from_grpc",
    "mark_dead",
    "plan_route",
    "recompose",
    "runs_whole_fragments",
    "state_from_health",
]
