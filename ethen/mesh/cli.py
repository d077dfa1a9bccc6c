"""``ethen mesh ...`` commands: a thin shell over :mod:`ethen.mesh.routing`.

``ethen mesh certs --out DIR [--hosts h1,h2]`` writes a CA, a server certificate and a token (see
:mod:`ethen.mesh.certs`).

``ethen mesh route STATES.json [--layers 8-11] [--prompt-tokens N] [--weight hop=0.3 ...] [--json]``
(plus ``--model M``) reads a mesh document (a JSON list of §7 health objects, an object with a
``nodes`` list and an optional ``model``, or one single health object), runs ``score_route`` and prints
the route as a table with the per-stage cost breakdown (or as JSON). Every error (unreadable file, bad
JSON, bad field, no route) is one line on stderr, exit code 2. Options are parsed here rather than by click
so that their errors are one line too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from ethen.mesh.errors import MeshError
from ethen.mesh.routing import (
    DEFAULT_MODEL,
    Route,
    RouteWeights,
    RoutingRequest,
    node_states_from_json,
    score_route,
)

__all__ = ["app", "parse_layers", "parse_weights"]

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


class CliInputError(MeshError, ValueError):
    """A command-line value is malformed (a ``ValueError`` in the mesh package's one exception tree)."""


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def parse_layers(text: str) -> tuple[int, int]:
    """``"8-11"`` -> ``(8, 11)``; ``"5"`` -> ``(5, 5)``."""
    first, sep, last = text.strip().partition("-")
    try:
        pair = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise CliInputError(f"--layers must look like FIRST-LAST (e.g. 8-11), got {text!r}") from None
    return pair


def parse_weights(items: list[str]) -> RouteWeights:
    """``["hop=0.3", "load=2"]`` -> ``RouteWeights`` with those overrides."""
    overrides: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise CliInputError(f"--weight must look like NAME=VALUE (e.g. hop=0.3), got {item!r}")
        try:
            overrides[name.strip()] = float(value)
        except ValueError:
            raise CliInputError(f"--weight {name.strip()} must be a number, got {value!r}") from None
    return RouteWeights().with_overrides(overrides)


def _parse_count(option: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CliInputError(f"{option} must be an integer, got {text!r}") from None


def _load(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else exc
        raise CliInputError(f"cannot read {path}: {reason}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliInputError(f"{path} is not valid JSON: {exc}") from None


def _table(route: Route) -> Table:
    window = f"{route.window[0]}-{route.window[1]}" if route.window else "-"
    table = Table(title=f"mesh route for {route.model}, layers {window}")
    for column in ("#", "node", "layers", "node term", "hop term", "prefill term", "stage cost"):
        table.add_column(column, justify="left" if column in ("node", "layers") else "right")
    for i, s in enumerate(route.stages, 1):
        table.add_row(
            str(i), s.node_id, f"{s.first}-{s.last}",
            f"{s.node_cost:.2f}", f"{s.hop_cost:.2f}", f"{s.prefill_cost:.2f}", f"{s.cost:.2f}",
        )  # fmt: skip
    cost = f"{route.cost:.2f}" if math.isfinite(route.cost) else "inf"
    table.add_section()
    table.add_row("", "total", "", "", "", "", cost)
    return table


@app.command("route")
def route_command(
    states_file: Annotated[
        Path, typer.Argument(metavar="STATES.json", help="Mesh JSON: health objects, or {nodes: [...]}.")
    ],
    layers: Annotated[
        str | None, typer.Option("--layers", metavar="FIRST-LAST", help="Layer window (default: all).")
    ] = None,
    prompt_tokens: Annotated[
        str, typer.Option("--prompt-tokens", metavar="N", help="Prompt size in tokens.")
    ] = "0",
    weight: Annotated[
        list[str] | None,
        typer.Option(
            "--weight", metavar="NAME=VALUE", help="Names: latency, load, capacity, hop, prompt. Repeatable."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", metavar="NAME", help="Model name put on the route.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the route as JSON.")] = False,
) -> None:
    """Choose the cheapest chain of whole fragments covering the layers, and explain its cost."""
    try:
        document = _load(states_file)
        states = node_states_from_json(document)
        if model is None and isinstance(document, dict) and isinstance(document.get("model"), str):
            model = document["model"]
        request = RoutingRequest(
            parse_layers(layers) if layers is not None else None,
            _parse_count("--prompt-tokens", prompt_tokens),
        )
        route = score_route(request, states, parse_weights(weight or []), model or DEFAULT_MODEL)
    except MeshError as exc:  # CliInputError included
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(route.to_dict(), indent=2))
        return
    console = Console()
    console.print(_table(route))
    console.print(
        f"{' -> '.join(route.nodes)}: cost {route.cost:.1f} ms-eq, {route.hops()} hop(s). {route.reason}.",
        highlight=False,
    )
    rejected = route.rejected
    for label, ids in (("dead", rejected.dead), ("no fragment inside the window", rejected.outside_window),
                       ("not on the cheapest chain", rejected.not_cheapest)):  # fmt: skip
        if ids:
            console.print(f"unused ({label}): {', '.join(sorted(ids))}", highlight=False, markup=False)


@app.command("certs")
def certs_command(
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Directory to write into (created).")],
    hosts: Annotated[
        str, typer.Option("--hosts", metavar="H1,H2", help="Worker/gateway addresses or names, for the SANs.")
    ] = "",
) -> None:
    """Make a CA, a server certificate and a token for an authenticated mesh across machines."""
    from ethen.mesh.certs import make_certs, parse_hosts

    try:
        paths = make_certs(out, parse_hosts(hosts))
    except MeshError as exc:  # CredentialsError
        _fail(str(exc))
    except OSError as exc:
        _fail(f"--out {str(out)!r}: {exc.strerror}")
    d = out
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}\n"
               f"on each worker machine (copy {d} there):\n"
               f"  ethen worker ... --host 0.0.0.0 --advertise THIS_HOST:PORT --tls-cert {d / 'server.pem'} "
               f"--tls-key {d / 'server.key'} --token-file {d / 'token'}\n"
               f"in the gateway's mesh provider:\n"
               f"  ca_file = \"{d / 'ca.pem'}\"\n  token_file = \"{d / 'token'}\"")
