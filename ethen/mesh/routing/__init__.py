"""The pure mesh routing core: cost model, route choice (``score_route``) and ``failover``.

No I/O, no clock, no randomness: every decision is a deterministic function of its arguments.
"""

from ethen.mesh.routing.dp import DEFAULT_MODEL, score_route
from ethen.mesh.routing.errors import InvalidMeshInput, MeshRoutingError, NoRouteAvailable, RoutingFailure
from ethen.mesh.routing.failover import failover, redundancy_map_from_states
from ethen.mesh.routing.route import Rejections, Route, Stage
from ethen.mesh.routing.state import NodeState, RoutingRequest, node_states_from_json
from ethen.mesh.routing.weights import RouteWeights

__all__ = [
    "DEFAULT_MODEL",
    "InvalidMeshInput",
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
