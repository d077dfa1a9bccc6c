"""Pure route planning for the orchestrator: the first route of a session, and its recomposition on failure.

- :func:`plan_route` is ``score_route`` over the model's whole layer window.
- :func:`route_options` (issue 44, a bounded queue per chain): that route and the routes planned with some
  of its workers left out (breadth first), cheapest first, one per chain, at most
  :data:`MAX_ROUTE_OPTIONS`: where a generation goes when its preferred chain's queue is full
  (:func:`~ethen.mesh.orchestrator.load.pick_chain`).
- :func:`recompose` follows spec §6 with ``failover``. The router's failover substitutes per layer and does
  not check that a substitute's fragment starts at the hand-off layer, but a worker only runs whole
  fragments (spec §3). So when the failover route asks some node for a span that is not a union of its whole
  fragments, the orchestrator routes afresh with ``score_route`` over the survivors (the failed node marked
  dead): the cheapest route that a worker can actually run. A degraded route (a gap) cannot run a pipeline,
  so it becomes :class:`~ethen.mesh.orchestrator.errors.DegradedRoute`; ``RoutingFailure`` propagates
  unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ethen.mesh.errors import MeshError
from ethen.mesh.orchestrator.errors import DegradedRoute
from ethen.mesh.routing import (
    NodeState,
    Route,
    RouteWeights,
    RoutingRequest,
    failover,
    redundancy_map_from_states,
    score_route,
    score_route_cached,
)

__all__ = ["MAX_ROUTE_OPTIONS", "mark_dead", "plan_route", "recompose", "route_options",
           "runs_whole_fragments"]

MAX_ROUTE_OPTIONS = 8  # chains a generation may try when the preferred one's queue is full


def plan_route(states: Iterable[NodeState], n_layers: int, prompt_tokens: int, weights: RouteWeights,
               model: str, cached: Mapping[str, Mapping[int, int]] | None = None) -> Route:
    """The cheapest route over layers ``0 .. n_layers-1`` (raises ``NoRouteAvailable``); ``cached[node][f]``:
    prompt positions ``node`` holds in its prefix cache on its fragment starting at layer ``f`` (the prompt
    term counts only the rest)."""
    request = RoutingRequest(layer_range=(0, n_layers - 1), prompt_tokens=prompt_tokens)
    if cached:
        return score_route_cached(request, tuple(states), weights, model, cached)
    return score_route(request, tuple(states), weights, model)


def route_options(states: Iterable[NodeState], n_layers: int, prompt_tokens: int, weights: RouteWeights,
                  model: str, cached: Mapping[str, Mapping[int, int]] | None = None,
                  limit: int = MAX_ROUTE_OPTIONS) -> tuple[Route, ...]:
    """:func:`plan_route` (raises ``NoRouteAvailable``) then, cheapest first (ties by nodes), routes on other
    chains (``Route.nodes``), at most ``limit`` in all: planned with a worker of an offered route left out,
    then one of that route's too, and so on (breadth first, at most ``4 x limit`` plans)."""
    states = tuple(states)
    best = plan_route(states, n_layers, prompt_tokens, weights, model, cached)
    found: dict[tuple[str, ...], Route] = {best.nodes: best}
    frontier: list[tuple[frozenset[str], Route]] = [(frozenset(), best)]
    tried: set[frozenset[str]] = {frozenset()}
    plans = 0
    while frontier and len(found) < limit and plans < 4 * limit:
        dead, route = frontier.pop(0)
        for node in dict.fromkeys(route.nodes):
            out = dead | {node}
            if out in tried or plans >= 4 * limit:
                continue
            tried.add(out)
            plans += 1
            try:
                alt = plan_route(mark_dead(states, out), n_layers, prompt_tokens, weights, model, cached)
            except MeshError:
                continue
            if not alt.degraded:
                frontier.append((out, alt))
                found.setdefault(alt.nodes, alt)
    others = sorted((r for c, r in found.items() if c != best.nodes), key=lambda r: (r.cost, r.nodes))
    return (best, *others[: max(0, limit - 1)])


def mark_dead(states: Iterable[NodeState], node_ids: Iterable[str]) -> tuple[NodeState, ...]:
    dead = set(node_ids)
    return tuple(replace(s, alive=False) if s.node_id in dead and s.alive else s for s in states)


def _tiles(fragments: Sequence[tuple[int, int]], first: int, last: int) -> bool:
    inside = sorted((a, b) for a, b in fragments if first <= a and b <= last)
    at = first
    for a, b in inside:
        if a != at:
            return False
        at = b + 1
    return at == last + 1


def runs_whole_fragments(route: Route, states: Iterable[NodeState]) -> bool:
    """Every stage is a union of whole, contiguous fragments of its node (what a worker accepts)."""
    by_id = {s.node_id: s for s in states}
    for stage in route.stages:
        state = by_id.get(stage.node_id)
        if state is None or not _tiles(state.served_layers, stage.first, stage.last):
            return False
    return True


def recompose(route: Route, failed_node: str, states: Iterable[NodeState], weights: RouteWeights,
              fallback_model: str | None) -> Route:
    """The route to continue on after ``failed_node`` failed (see the module docstring)."""
    survivors = mark_dead(states, [failed_node])
    holders = redundancy_map_from_states(survivors)
    new = failover(route, holders, failed_node, survivors, weights, fallback_model)
    if new.degraded:
        raise DegradedRoute(new)
    if runs_whole_fragments(new, survivors):
        return new
    request = RoutingRequest(layer_range=route.window, prompt_tokens=route.prompt_tokens)
    fresh = score_route(request, survivors, weights, route.model)
    return replace(fresh, reason=f"{new.reason}; the per-layer substitutes split a fragment, so the route "
                                 f"was recomputed over whole fragments of the surviving nodes")
