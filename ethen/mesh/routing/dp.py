"""``score_route``: the cheapest chain of whole fragments covering a layer window (spec §3).

Graph (§3): vertices are the layer boundaries ``first .. last+1``; a fragment ``(L, E)`` of a live node is an
edge from boundary ``L`` to ``E+1``. A fragment that reaches outside the window is not used. Contiguous
fragments of one node form ONE stage (its cost counts once, no hop); a node that reappears later counts
again. The DP state is therefore ``(boundary, node running the current stage)``: continuing with the same
node costs nothing, switching to node ``m`` costs ``cost(m)`` plus the hop term (no hop before the first
stage). Only the best label of a boundary can win a switch: if the best label already runs node ``m``,
continuing it beats any switch into ``m`` (all terms are ``>= 0``, and the best label has the lowest cost and
then the fewest stages). Besides that best label, a boundary keeps the label of node ``m`` only if ``m`` has
a fragment starting there (no other label can ever be extended). So each fragment is relaxed in O(1) and a
call is O(nodes + fragments + distinct start layers * log).

Order of routes (total, so the result never depends on the order of ``states``):

1. lowest cost, compared **exactly**: every term is a float, hence a dyadic rational; the DP scales them to
   integers over a common power-of-two denominator and adds integers. Routes whose costs are equal as real
   numbers compare equal, whatever order their terms were added in (float sums could differ in the last
   ulp and let rounding noise pick the winner);
2. fewest stages;
3. node ids of the stages, compared as a tuple of strings (Python ``str`` order, i.e. by code point);
4. (the spec is silent) the stages' first layers, compared as a tuple: when the same nodes in the same
   order can split the window in several ways at the same cost, the earliest hand-offs win.

The prefill term is the same for every route, so it is added to the result but plays no part in the DP.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from ethen.mesh.routing.errors import InvalidMeshInput, NoRouteAvailable
from ethen.mesh.routing.route import DEFAULT_MODEL, Rejections, Route, price_stages
from ethen.mesh.routing.state import NodeState, RoutingRequest
from ethen.mesh.routing.weights import RouteWeights

__all__ = ["DEFAULT_MODEL", "score_route"]

_DEFAULT_WEIGHTS = RouteWeights()

# A DP label: (exact cost, stages, index of the current stage's node in `used`, boundary where the current
# stage starts, label before the current stage). Continuing a stage reuses the same tuple.
_Label = tuple[int, int, int, int, "_Label | None"]


def _tie_key(label: _Label, used: list[NodeState]) -> tuple[list[str], list[int]]:
    nodes: list[str] = []
    starts: list[int] = []
    lab: _Label | None = label
    while lab is not None and lab[2] >= 0:
        nodes.append(used[lab[2]].node_id)
        starts.append(lab[3])
        lab = lab[4]
    nodes.reverse()
    starts.reverse()
    return nodes, starts


def _before(a: _Label, b: _Label, used: list[NodeState]) -> bool:
    """``a`` strictly precedes ``b`` in the route order of the module docstring."""
    if a[0] != b[0]:
        return a[0] < b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    return _tie_key(a, used) < _tie_key(b, used)


def _exact_ints(costs: list[float], hop: float) -> tuple[list[int], int]:
    """Exact integer images of the non-negative float terms, all over one power-of-two scale ``2**k``.

    ``k`` is chosen from the smallest non-zero term, so that every term times ``2**k`` is an integer
    (a float is a multiple of its own ulp, and a larger float's ulp is a multiple of a smaller one's); the
    multiplication by a power of two is then exact. Extreme ranges (subnormals, overflow) fall back to
    ``float.as_integer_ratio``.
    """
    values = [*costs, hop]
    low = min(values)
    if low == 0.0:
        low = min((v for v in values if v), default=1.0)
    k = 53 - math.frexp(low)[1]
    if k <= 1000:
        scale = 2.0**k
        if math.isfinite(max(values) * scale):
            return [int(c * scale) for c in costs], int(hop * scale)
    ratios = [v.as_integer_ratio() for v in values]
    den = max(d for _, d in ratios)
    ints = [n * (den // d) for n, d in ratios]
    return ints[:-1], ints[-1]


def _check_arguments(request: object, weights: object, model: object) -> None:
    if not isinstance(request, RoutingRequest):
        raise InvalidMeshInput(f"request must be a RoutingRequest, got {type(request).__name__}")
    if not isinstance(weights, RouteWeights):
        raise InvalidMeshInput(f"weights must be RouteWeights, got {type(weights).__name__}")
    if not isinstance(model, str) or not model:
        raise InvalidMeshInput(f"model must be a non-empty string, got {model!r}")


def score_route(
    request: RoutingRequest,
    states: Iterable[NodeState | Mapping[str, Any]] | Mapping[Any, NodeState | Mapping[str, Any]],
    weights: RouteWeights = _DEFAULT_WEIGHTS,
    model: str = DEFAULT_MODEL,
) -> Route:
    """The cheapest route covering ``request``'s window with whole fragments of live nodes.

    ``states`` is an iterable of ``NodeState`` s, or a mapping whose values are (e.g. ``{node_id: state}``);
    an entry may also be a §7 health dict, read with ``NodeState.from_dict``.

    Raises ``NoRouteAvailable`` (window in the message) when no chain covers it, and ``InvalidMeshInput``
    (a ``ValueError``) on malformed input such as duplicate node ids.
    """
    _check_arguments(request, weights, model)
    window = request.layer_range
    lo, hi = window if window is not None else (0, sys.maxsize)

    # One pass over the nodes: check them, and index usable fragments by start layer (absolute), as a flat
    # list of int pairs (no tuple per fragment): starts[L] = [E+1, index of the node in `used`, ...].
    starts: dict[int, list[int]] = {}
    used: list[NodeState] = []
    costs: list[float] = []
    dead: list[str] = []
    outside: list[str] = []
    seen: set[str] = set()
    node_cost = weights.node_cost
    top = -1
    entries = states.values() if isinstance(states, Mapping) else states
    for s in entries:
        if not isinstance(s, NodeState):
            if not isinstance(s, Mapping):
                raise InvalidMeshInput(f"states must hold NodeState objects, got {type(s).__name__}")
            s = NodeState.from_dict(s)
        node_id = s.node_id
        if node_id in seen:
            raise InvalidMeshInput(f"duplicate node_id {node_id!r} in states")
        seen.add(node_id)
        if not s.alive:
            dead.append(node_id)
            continue
        k = -1
        for a, b in s.served_layers:
            if lo <= a and b <= hi:
                if k < 0:
                    k = len(used)
                    used.append(s)
                    costs.append(node_cost(s))
                bucket = starts.get(a)
                if bucket is None:
                    starts[a] = [b + 1, k]
                else:
                    bucket.append(b + 1)
                    bucket.append(k)
                if b > top:
                    top = b
        if k < 0:
            outside.append(node_id)
    if window is not None:
        first, last = window
    elif starts:  # every live fragment lies inside the derived window
        first, last = min(starts), top
    else:
        raise NoRouteAvailable(None, "no live node serves any layer")

    if costs and max(costs) == math.inf:
        worst = used[costs.index(math.inf)].node_id
        raise InvalidMeshInput(f"node {worst!r}: stage cost overflows a float with these weights")
    if weights.hop_cost() == math.inf:
        raise InvalidMeshInput(f"weight hop {weights.hop!r} makes the hop term overflow a float")
    if weights.prefill_cost(request.prompt_tokens) == math.inf:
        raise InvalidMeshInput(
            f"weight prompt {weights.prompt!r} with prompt_tokens {request.prompt_tokens} makes the prefill "
            "term overflow a float"
        )
    exact, hop = _exact_ints(costs, weights.hop_cost())

    # best[b]: best chain ending at boundary b; keep[b][m]: best chain ending at b whose current stage runs
    # node m, for the nodes m with a fragment starting at b. Only boundaries where some fragment starts can
    # be left, so only those are visited (ascending): the work never depends on how large layer numbers are.
    root: _Label = (0, 0, -1, first, None)
    best: dict[int, _Label] = {first: root}
    keep: dict[int, dict[int, _Label]] = {}
    for b in sorted(starts):
        src = best.get(b)
        if src is None:
            continue
        here = keep.get(b)
        pairs = iter(starts[b])
        for end, m in zip(pairs, pairs, strict=True):
            if src[2] == m:
                cand = src  # the best label at b already runs m: continuing it beats any switch into m
            else:
                cost = src[0] + exact[m] + (hop if src[1] else 0)
                cand = (cost, src[1] + 1, m, b, src)
                cont = here.get(m) if here is not None else None
                if cont is not None and (
                    cont[0] < cost or (cont[0] == cost and _before(cont, cand, used))
                ):
                    cand = cont
            old = best.get(end)
            if (
                old is None
                or cand[0] < old[0]
                or (cand[0] == old[0] and old is not cand and _before(cand, old, used))
            ):
                best[end] = cand
            if end in used[m]._starts:  # m can continue at `end`: keep its own best label there
                slot = keep.get(end)
                if slot is None:
                    keep[end] = {m: cand}
                else:
                    old = slot.get(m)
                    if (
                        old is None
                        or cand[0] < old[0]
                        or (cand[0] == old[0] and old is not cand and _before(cand, old, used))
                    ):
                        slot[m] = cand

    final = best.get(last + 1)
    if final is None:
        reached = max(best)
        raise NoRouteAvailable(
            (first, last),
            f"whole fragments of live nodes cover only up to layer {reached - 1}; no usable fragment "
            f"starts at layer {reached}"
            if reached > first
            else f"no live node has a fragment starting at layer {first} that ends inside the window",
            reached=reached,
        )

    segments: list[tuple[str, int, int]] = []
    node_costs: list[float] = []
    end = last + 1
    step: _Label | None = final
    while step is not None and step[2] >= 0:
        segments.append((used[step[2]].node_id, step[3], end - 1))
        node_costs.append(costs[step[2]])
        end = step[3]
        step = step[4]
    segments.reverse()
    node_costs.reverse()

    in_route = {node_id for node_id, _, _ in segments}
    rejected = Rejections(
        dead=frozenset(dead),
        outside_window=frozenset(outside),
        not_cheapest=frozenset(seen.difference(dead, outside, in_route)),
    )
    return Route(
        stages=price_stages(segments, node_costs, weights, request.prompt_tokens),
        model=model,
        window=(first, last),
        prompt_tokens=request.prompt_tokens,
        weights=weights,
        reason=f"cheapest chain of whole fragments covering layers {first}-{last}",
        rejected=rejected,
    )
