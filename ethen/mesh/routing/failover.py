"""``failover``: recompose a route after one of its nodes failed (spec §6, steps 1-4).

1. ``failed_node`` not in the route: the route comes back unchanged (it compares ``==`` to the input, since
   ``Route.reason`` takes no part in equality), with a reason containing the spec's phrase "no participa en
   la ruta" (not an error: the orchestrator may probe idle nodes).
2. The failed node's layers come from its ``NodeState.served_layers`` when ``states`` holds one with
   fragments, else from ``redundancy_map`` (the layers listing it), clipped to the route's window.
   *Choice:* a route records the layers each stage ran, so the layers that need a substitute are those of
   the failed node's stages. Layers the node serves but which other stages run keep their stage; a layer a
   failed stage ran that stale telemetry no longer lists is re-homed too (coverage is never lost). The
   layers found in this step are reported in ``Route.reason``.
3. For each of those layers, the cheapest live holder other than the failed node. Holders come from
   ``redundancy_map``. A holder with a ``NodeState`` in ``states`` is live when ``alive=True`` and priced
   by the §2.1 node term under ``weights``; these are preferred, cheapest first, ties by node id. A holder
   with no ``NodeState`` at all (``states`` may be empty or omitted) is taken as live but *unpriced*: it is
   used only when no priced live holder exists for that layer, ties by node id. A holder whose
   ``NodeState`` says ``alive=False`` is never used. When every layer has a substitute, the substitutes
   take the failed node's place, one stage per run of consecutive layers with the same substitute. Only
   consecutive duplicates collapse (two neighbouring stages of one node covering adjacent layers become one
   stage): a substitute already present later in the route reappears there, so no coverage is lost.
   *Choice:* failover works per layer, as the redundancy map does; it does not re-check that the
   substitute's fragments start at the hand-off layer. Calling ``score_route`` again, without the failed
   node, gives a whole-fragment route for the next requests.
4. When some layer has no live holder: with ``fallback_model`` the result is a degraded route
   (``degraded=True``, ``model=fallback_model``) made of the surviving stages only, leaving the gap, with
   the missing layers in ``reason``; without it, ``RoutingFailure`` is raised naming the node and layers.

``redundancy_map`` has one of two shapes: layer -> node ids (``{4: ["b", "c"], ...}``, what
:func:`redundancy_map_from_states` builds), or node id -> the layers it holds (``{"b": [(4, 7)], "c": [4,
5]}``: ``(first, last)`` pairs and/or single layers), recognised by its string keys and inverted (only
over the route's window). A malformed map raises ``InvalidMeshInput`` naming the key and value.

Costs of the new route are recomputed under ``weights``: a node with a ``NodeState`` in ``states`` is
priced from it; a node without one keeps its old node term if it already had a stage in the route, and an
unpriced substitute that had none gets a node term of 0.0 (nothing is known about its cost; the reason
names it). ``prompt_tokens`` and ``window`` are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ethen.mesh.routing._checks import MAX_INDEX, check_count, check_layer_pair
from ethen.mesh.routing.errors import InvalidMeshInput, RoutingFailure
from ethen.mesh.routing.route import Rejections, Route, Stage, price_stages
from ethen.mesh.routing.state import NodeState
from ethen.mesh.routing.weights import RouteWeights

__all__ = ["failover", "layer_spans", "redundancy_map_from_states"]

_DEFAULT_WEIGHTS = RouteWeights()


def redundancy_map_from_states(states: Iterable[NodeState]) -> dict[int, tuple[str, ...]]:
    """Layer -> ids of the live nodes serving it (sorted), built from telemetry."""
    holders: dict[int, set[str]] = {}
    for s in states:
        if s.alive:
            for a, b in s.served_layers:
                for layer in range(a, b + 1):
                    holders.setdefault(layer, set()).add(s.node_id)
    return {layer: tuple(sorted(ids)) for layer, ids in sorted(holders.items())}


def layer_spans(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (duplicates ignored; no layers: ``""``)."""
    out: list[str] = []
    run: list[int] = []
    for layer in sorted(set(layers)):
        if run and layer != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(layer)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _spans(layers: Iterable[int]) -> str:
    return layer_spans(layers) or "none"


def _node_layers(node_id: str, value: object) -> list[tuple[int, int]]:
    """The ``(first, last)`` spans of one entry of a node-keyed map (pairs or single layers)."""
    field = f"redundancy_map[{node_id!r}]"
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidMeshInput(
            f"{field} must be a collection of layers or (first, last) pairs, got {value!r}"
        )
    spans: list[tuple[int, int]] = []
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool):
            layer = check_count(f"{field} layer", item, MAX_INDEX)
            spans.append((layer, layer))
        elif isinstance(item, list | tuple):
            spans.append(check_layer_pair(f"{field} entry", item))
        else:
            raise InvalidMeshInput(f"{field} must hold layers or (first, last) pairs, got {item!r}")
    return spans


def _check_map(redundancy_map: object, clip: tuple[int, int]) -> Mapping[int, tuple[str, ...]]:
    """The map as layer -> node ids; a node-keyed map is inverted, over the layers of ``clip`` only."""
    if not isinstance(redundancy_map, Mapping):
        kind = type(redundancy_map).__name__
        raise InvalidMeshInput(f"redundancy_map must map layers to node ids, got {kind}")
    checked: dict[int, tuple[str, ...]] = {}
    if redundancy_map and isinstance(next(iter(redundancy_map)), str):  # node id -> layers
        holders: dict[int, list[str]] = {}
        for node_id, value in redundancy_map.items():
            if not isinstance(node_id, str) or not node_id:
                raise InvalidMeshInput(
                    f"redundancy_map keyed by node ids has an invalid node id key {node_id!r}"
                )
            for first, last in _node_layers(node_id, value):
                for layer in range(max(first, clip[0]), min(last, clip[1]) + 1):
                    ids = holders.setdefault(layer, [])
                    if node_id not in ids:
                        ids.append(node_id)
        return {layer: tuple(ids) for layer, ids in holders.items()}
    for layer, ids in redundancy_map.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise InvalidMeshInput(f"redundancy_map key must be a layer number >= 0, got {layer!r}")
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise InvalidMeshInput(f"redundancy_map[{layer}] must be a collection of node ids, got {ids!r}")
        items = tuple(ids)
        for node_id in items:
            if not isinstance(node_id, str) or not node_id:
                raise InvalidMeshInput(f"redundancy_map[{layer}] holds an invalid node id {node_id!r}")
        checked[layer] = items
    return checked


def _collapse(segments: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Merge neighbouring segments of one node over adjacent layers (consecutive duplicates only)."""
    out: list[tuple[str, int, int]] = []
    for node_id, first, last in segments:
        if out and out[-1][0] == node_id and out[-1][2] + 1 == first:
            out[-1] = (node_id, out[-1][1], last)
        else:
            out.append((node_id, first, last))
    return out


def failover(
    route: Route,
    redundancy_map: Mapping[int, Iterable[str]] | Mapping[str, Iterable[Any]],
    failed_node: str,
    states: Iterable[NodeState] = (),
    weights: RouteWeights = _DEFAULT_WEIGHTS,
    fallback_model: str | None = None,
) -> Route:
    """Route around ``failed_node`` following spec §6 (see the module docstring for each step)."""
    if not isinstance(route, Route):
        raise InvalidMeshInput(f"route must be a Route, got {type(route).__name__}")
    if not isinstance(failed_node, str) or not failed_node:
        raise InvalidMeshInput(f"failed_node must be a non-empty node id, got {failed_node!r}")
    if not isinstance(weights, RouteWeights):
        raise InvalidMeshInput(f"weights must be RouteWeights, got {type(weights).__name__}")
    if fallback_model is not None and (not isinstance(fallback_model, str) or not fallback_model):
        raise InvalidMeshInput(f"fallback_model must be a non-empty string or None, got {fallback_model!r}")
    if route.stages:
        clip = (min(st.first for st in route.stages), max(st.last for st in route.stages))
        if route.window is not None:
            clip = (min(clip[0], route.window[0]), max(clip[1], route.window[1]))
    else:
        clip = route.window if route.window is not None else (0, -1)
    holders_of = _check_map(redundancy_map, clip)
    by_id: dict[str, NodeState] = {}
    for s in states:
        if not isinstance(s, NodeState):
            raise InvalidMeshInput(f"states must hold NodeState objects, got {type(s).__name__}")
        if s.node_id in by_id:
            raise InvalidMeshInput(f"duplicate node_id {s.node_id!r} in states")
        by_id[s.node_id] = s

    # Step 1.
    if failed_node not in route.nodes:
        return replace(
            route,
            reason=f"node {failed_node!r} no participa en la ruta (does not take part in the route); "
            "route unchanged",
        )

    # Step 2.
    lo = min(st.first for st in route.stages)
    hi = max(st.last for st in route.stages)
    window = route.window if route.window is not None else (lo, hi)
    own = by_id.get(failed_node)
    if own is not None and own.served_layers:
        held = {layer for a, b in own.served_layers for layer in range(a, b + 1)}
        source = "its telemetry"
    else:
        held = {layer for layer, ids in holders_of.items() if failed_node in ids}
        source = "the redundancy map"
    held = {layer for layer in held if window[0] <= layer <= window[1]}
    needed = [n for st in route.stages if st.node_id == failed_node for n in range(st.first, st.last + 1)]

    # Step 3.
    def price(node_id: str) -> float:
        return weights.node_cost(by_id[node_id])

    substitute: dict[int, str] = {}
    missing: list[int] = []
    for layer in needed:
        holders = [h for h in holders_of.get(layer, ()) if h != failed_node]
        live = [h for h in holders if h in by_id and by_id[h].alive]
        unpriced = [h for h in holders if h not in by_id]
        if live:
            substitute[layer] = min(live, key=lambda h: (price(h), h))
        elif unpriced:
            substitute[layer] = min(unpriced)
        else:
            missing.append(layer)

    old_cost = {s.node_id: s.node_cost for s in route.stages}

    def rejected(kept: set[str]) -> Rejections:
        r = route.rejected
        return Rejections(
            dead=r.dead | {failed_node},
            outside_window=r.outside_window - kept,
            not_cheapest=r.not_cheapest - kept,
        )

    def rebuild(segments: list[tuple[str, int, int]]) -> tuple[Stage, ...]:
        merged = _collapse(segments)
        costs = [price(n) if n in by_id else old_cost.get(n, 0.0) for n, _, _ in merged]
        return price_stages(merged, costs, weights, route.prompt_tokens)

    span = f"{window[0]}-{window[1]}"
    lost = f"node {failed_node!r} failed (held layers {_spans(held)} of window {span} per {source})"
    if not missing:
        segments: list[tuple[str, int, int]] = []
        for st in route.stages:
            if st.node_id != failed_node:
                segments.append((st.node_id, st.first, st.last))
            else:
                segments.extend((substitute[layer], layer, layer) for layer in range(st.first, st.last + 1))
        moved = sorted({substitute[layer] for layer in needed})
        blind = [n for n in moved if n not in by_id]
        note = f" ({', '.join(blind)} without telemetry, so unpriced)" if blind else ""
        return replace(
            route,
            stages=rebuild(segments),
            weights=weights,
            rejected=rejected({n for n, _, _ in segments}),
            reason=f"{lost}; layers {_spans(needed)} moved to {', '.join(moved)}{note}",
        )

    # Step 4.
    detail = f"{lost}; no live holder for layers {_spans(missing)}"
    if fallback_model is None:
        raise RoutingFailure(failed_node, tuple(missing), detail)
    survivors = [(st.node_id, st.first, st.last) for st in route.stages if st.node_id != failed_node]
    return replace(
        route,
        stages=rebuild(survivors),
        model=fallback_model,
        weights=weights,
        degraded=True,
        rejected=rejected({n for n, _, _ in survivors}),
        reason=f"{detail}; degraded to fallback model {fallback_model!r} with the surviving stages",
    )
