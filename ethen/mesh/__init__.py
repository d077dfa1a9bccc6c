"""Mesh cost-aware routing (spec ``mesh-cost-aware-routing.es.md``).

This package namespace re-exports the pure routing core only and stays light (no grpc, no numpy): the
worker and orchestrator modules under ``ethen.mesh`` are imported by their own paths.
"""

from ethen.mesh.errors import MeshError
from ethen.mesh.routing import (
    DEFAULT_MODEL,
    InvalidMeshInput,
    MeshRoutingError,
    NodeState,
    NoRouteAvailable,
    Rejections,
    Route,
    RouteWeights,
    RoutingFailure,
    RoutingRequest,
    Stage,
    failover,
    node_states_from_json,
    redundancy_map_from_states,
    score_route,
)

__all__ = [
    "DEFAULT_MODEL",
    "InvalidMeshInput",
    "MeshError",
    "MeshRoutingError",
    "NoRouteAvailable",
    "NodeState",
    "Rejections",
    "Route",
    "RouteWeights",
    "RoutingFailure",
    "RoutingRequest",
    "Stage",
    "failover",
    "node_states_from_json",
    "redundancy_map_from_states",
    "score_route",
]
