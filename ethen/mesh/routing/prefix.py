"""``score_route_cached``: the route choice when nodes hold cached prompt prefixes (issue 45 item 3).

The route cost's prompt term (``w_p*10*tokens/1024``, spec §2.2) counts only the prompt positions the route
does **not** hold: a route skips a prefix only when every one of its stages holds it (a stage without it
would need the prefix's hidden states, which the stages before it no longer compute). Workers keep a prefix
per fragment, so ``cached[node][first]`` is the positions of this prompt that ``node`` holds on its fragment
starting at layer ``first`` (already block aligned, leaving one position to compute); a stage holds the
minimum over the node's fragments inside its layers, a route the minimum over its stages. The prompt term then
differs per route, so the plain DP (which leaves it out) is run once per distinct cached amount ``L`` over the
fragments holding at least ``L``, and the best of those, priced with its own cached tokens, wins. This is
exact when a node's fragments do not overlap (as on workers): the optimal route ``R*`` is in the pool of
``L = cached(R*)``, whose DP winner costs at most as much, and no candidate costs less than ``R*``.

Order (as :func:`~ethen.mesh.routing.dp.score_route`): exact cost, then fewest stages, then node ids, then
stage first layers. With no cached prefix the result equals ``score_route``'s. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from fractions import Fraction

from ethen.mesh.routing.dp import DEFAULT_MODEL, score_route
from ethen.mesh.routing.errors import InvalidMeshInput, NoRouteAvailable
from ethen.mesh.routing.route import Rejections, Route, price_stages
from ethen.mesh.routing.state import NodeState, RoutingRequest
from ethen.mesh.routing.weights import RouteWeights

__all__ = ["score_route_cached"]


def _key(route: Route) -> tuple[Fraction, int, tuple[str, ...], tuple[int, ...]]:
    exact = sum((Fraction(t) for s in route.stages for t in (s.node_cost, s.hop_cost, s.prefill_cost)),
                Fraction(0))
    return exact, len(route.stages), route.nodes, tuple(s.first for s in route.stages)


def _held(route: Route, layers: Mapping[str, Sequence[tuple[int, int]]],
          cached: Mapping[str, Mapping[int, int]]) -> int:
    """Positions every stage of ``route`` holds: the minimum over the fragments inside its stages."""
    held = [cached.get(s.node_id, {}).get(a, 0)
            for s in route.stages for a, b in layers.get(s.node_id, ()) if s.first <= a and b <= s.last]
    return min(held, default=0)


def _priced(route: Route, cached_tokens: int, weights: RouteWeights) -> Route:
    segments = [(s.node_id, s.first, s.last) for s in route.stages]
    stages = price_stages(segments, [s.node_cost for s in route.stages], weights,
                          route.prompt_tokens - cached_tokens)
    return replace(route, stages=stages, cached_tokens=cached_tokens)


def score_route_cached(request: RoutingRequest, states: Iterable[NodeState],
                       weights: RouteWeights | None = None, model: str = DEFAULT_MODEL,
                       cached: Mapping[str, Mapping[int, int]] | None = None) -> Route:
    """The cheapest route when ``cached[node][first]`` prompt positions are held by ``node`` on its fragment
    starting at layer ``first`` (absent: 0)."""
    w = weights if weights is not None else RouteWeights()
    pool = tuple(states)
    held = {node: dict(frags) for node, frags in (cached or {}).items()}
    for node, frags in held.items():
        for first, tokens in frags.items():
            if not isinstance(node, str) or isinstance(tokens, bool) or not isinstance(tokens, int) \
                    or not 0 <= tokens <= request.prompt_tokens:
                raise InvalidMeshInput(f"cached[{node!r}][{first!r}] = {tokens!r}: must be an int in "
                                       f"[0, prompt_tokens={request.prompt_tokens}]")
    base = score_route(request, pool, w, model)  # validates everything, raises when no route exists
    levels = sorted({t for frags in held.values() for t in frags.values() if t > 0})
    if not levels:
        return base
    layers = {s.node_id: tuple(s.served_layers) for s in pool}
    window = RoutingRequest(layer_range=base.window, prompt_tokens=request.prompt_tokens)
    best = _priced(base, _held(base, layers, held), w)
    for level in levels:
        subset = tuple(replace(s, served_layers=[(a, b) for a, b in s.served_layers
                                                 if held.get(s.node_id, {}).get(a, 0) >= level])
                       for s in pool)
        try:
            route = score_route(window, subset, w, model)
        except NoRouteAvailable:
            continue
        candidate = _priced(route, _held(route, layers, held), w)
        if _key(candidate) < _key(best):
            best = candidate
    holders = tuple(sorted((n, max(frags.values())) for n, frags in held.items()
                           if frags and max(frags.values()) > 0))
    usable = base.rejected.not_cheapest | set(base.nodes)
    rejected = Rejections(dead=base.rejected.dead, outside_window=base.rejected.outside_window,
                          not_cheapest=frozenset(usable - set(best.nodes)))
    reason = best.reason
    if best.cached_tokens:
        reason += (f"; every stage holds the prompt's first {best.cached_tokens} tokens (the prompt term "
                   f"counts the other {best.prompt_tokens - best.cached_tokens})")
    reason += "; prefix holders: " + ", ".join(f"{n} ({t} tokens)" for n, t in holders)
    return replace(best, prefix_holders=holders, rejected=rejected, reason=reason)
