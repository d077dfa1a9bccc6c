"""The workers of ``ethen up`` (``--layout FILE`` or the defaults derived from the model's layer count), and
the check that refuses a layout that does not fit the model before any worker starts."""

from __future__ import annotations

import tomllib
from pathlib import Path

import typer

from ethen.mesh.errors import MeshError

__all__ = ["DEFAULT_LAYOUT", "MODEL", "check_layout", "default_layout", "load_layout"]

DEFAULT_LAYOUT: tuple[tuple[str, str, float], ...] = (
    ("gpu", "0-9", 10.0),
    ("mini", "0-9,10-19", 6.0),
    ("laptop", "10-19,20-29", 3.0),
)
MODEL = "smollm2-135m-instruct"


def default_layout(n_layers: int) -> list[tuple[str, str, float]]:
    """The default workers for a model of ``n_layers`` blocks (issue 24): the layers split into three
    contiguous parts as equal as possible (the first ones one layer longer), gpu serves the first part, mini
    the first two, laptop the last two (each part a fragment), as :data:`DEFAULT_LAYOUT` does for 30 layers.
    With 2 layers: gpu layer 0 and mini layers 0 and 1 (laptop would repeat a part); 1 layer: gpu alone."""
    if n_layers < 1:
        raise ValueError(f"a model needs at least one layer, got {n_layers}")
    sizes = [n_layers // 3 + (1 if i < n_layers % 3 else 0) for i in range(3)]
    parts: list[str] = []
    start = 0
    for size in sizes:
        if size:
            parts.append(f"{start}-{start + size - 1}")
            start += size
    out = [("gpu", parts[0], 10.0)]
    if len(parts) >= 2:
        out.append(("mini", ",".join(parts[:2]), 6.0))
    if len(parts) == 3:
        out.append(("laptop", ",".join(parts[1:]), 3.0))
    return out


def check_layout(workers: list[tuple[str, str, float]], n_layers: int, source: str,
                 partial: bool = False) -> None:
    """Refuse (``typer.BadParameter``, naming the model's layer count) a layout that does not fit a model
    of ``n_layers`` blocks: a fragment past its last layer, or (unless ``partial``: workers may join)
    fragments from which no chain of whole fragments covers layers 0..n-1."""
    from ethen.mesh.orchestrator.planning import plan_route
    from ethen.mesh.routing import NodeState, RouteWeights
    from ethen.mesh.worker.config import parse_fragments

    states = []
    for node, layers, score in workers:
        frags = parse_fragments(layers)
        if frags[-1][1] >= n_layers:
            raise typer.BadParameter(f"{source}: worker {node!r} layers {layers!r} go past the model's last "
                                     f"layer: the model has {n_layers} layers (0-{n_layers - 1})")
        states.append(NodeState(node, 1.0, 0.0, score, tuple(frags)))
    if partial:
        return
    try:
        plan_route(states, n_layers, 1, RouteWeights(), MODEL)
    except MeshError as exc:
        raise typer.BadParameter(f"{source}: no chain of whole fragments of these workers covers layers "
                                 f"0-{n_layers - 1} (the model has {n_layers} layers): {exc}") from None


def load_layout(path: Path | None) -> list[tuple[str, str, float]]:
    """Workers of a layout TOML file (``[[workers]] node_id, layers, capacity_score``), or the defaults
    (for 30 layers; ``ethen up`` derives them from the model, :func:`default_layout`)."""
    if path is None:
        return list(DEFAULT_LAYOUT)
    from ethen.mesh.worker.config import parse_fragments

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"--layout {path}: {exc}") from None
    workers = doc.get("workers")
    if not isinstance(workers, list) or not workers:
        raise typer.BadParameter(f"--layout {path}: needs at least one [[workers]] table")
    out: list[tuple[str, str, float]] = []
    for i, w in enumerate(workers):
        node, layers, score = w.get("node_id"), w.get("layers"), w.get("capacity_score", 1.0)
        if not isinstance(node, str) or not node or not isinstance(layers, str):
            raise typer.BadParameter(f"--layout {path}: workers[{i}] needs node_id and layers strings")
        try:
            parse_fragments(layers)
        except ValueError as exc:
            raise typer.BadParameter(f"--layout {path}: workers[{i}].{exc}") from None
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise typer.BadParameter(f"--layout {path}: workers[{i}].capacity_score must be a number")
        out.append((node, layers, float(score)))
    return out
