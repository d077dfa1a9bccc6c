"""The pure mesh routing core: cost model, route choice (``score_route``) and ``failover``.

No I/O, no clock, no randomness: every decision is a deterministic function of its arguments.

- ``state``: ``NodeState`` (telemetry, §7 health JSON) and ``RoutingRequest``
- ``weights``: ``RouteWeights`` and the §2 cost terms
- ``route``: the decision, ``Route`` of ``Stage`` s with the per-stage cost breakdown and ``Rejections``
- ``dp``: ``score_route``, the §3 DP over fragment boundaries
- ``prefix``: ``score_route_cached``, the route choice when nodes hold the prompt's prefix (issue 45)
- ``failover``: §6 recomposition after a node failure
- ``errors``: the exception tree (``MeshRoutingError``)
"""

from ethen.mesh.routing.dp import DEFAULT_MODEL, score_route
from ethen.mesh.routing.errors import InvalidMeshInput, MeshRoutingError, NoRouteAvailable, RoutingFailure
from ethen.mesh.routing.failover import failover, layer_spans, redundancy_map_from_states
from ethen.mesh.routing.prefix import score_route_cached
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
    "layer_spans",
    "node_states_from_json",
    "redundancy_map_from_states",
    "score_route",
    "score_route_cached",
]
