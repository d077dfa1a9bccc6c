"""The ``ethen`` command line: a thin shell that wires sub-commands to the package's cores.

Choice: ``ethen up`` and ``ethen worker`` start without importing the other sub-commands (the admin commands
pull in SQLAlchemy, aiohttp, the gateway: ~2 s on a busy 2-core machine). So ``ethen up`` on a taken port
fails in well under a second, and each mesh worker process loads only what it serves with. :func:`main`
dispatches those two names to a one-command app; everything else (and ``--help``) goes to the full
:data:`app`, built on first use (``from ethen.cli import app`` works as before).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import typer

__all__ = ["app", "main"]  # noqa: F822 - ``app`` is built lazily by the module __getattr__

_SETTINGS: dict[str, Any] = {"add_completion": False, "pretty_exceptions_enable": False}
#: sub-commands run without building the full app: name -> (module, function)
_LIGHT = {"up": ("ethen.up", "up"), "worker": ("ethen.mesh.worker.cli", "worker")}


@functools.cache
def _app() -> typer.Typer:
    from ethen.admin.cli import (
        certify_command,
        keys_app,
        logs_command,
        projects_app,
        shadows_app,
        usage_command,
    )
    from ethen.gateway_cli import gateway as gateway_command
    from ethen.mesh.cli import app as mesh_app
    from ethen.mesh.worker.cli import worker as worker_command
    from ethen.up import up as up_command

    full = typer.Typer(
        name="ethen",
        help="Ethen: an open LLM routing layer (gateway smart routing + mesh cost-aware routing).",
        no_args_is_help=True,
        **_SETTINGS,
    )
    full.add_typer(mesh_app, name="mesh", help="Mesh cost-aware routing over layer fragments.")
    full.command("worker")(worker_command)
    full.command("gateway")(gateway_command)
    full.command("up")(up_command)
    full.add_typer(keys_app, name="keys", help="Project API keys (ethen_...), shown once at creation.")
    full.add_typer(projects_app, name="projects", help="Projects: allowed providers/models, window budget.")
    full.command("usage")(usage_command)
    full.command("logs")(logs_command)
    full.command("certify")(certify_command)
    full.add_typer(shadows_app, name="shadows", help="Shadow evaluation: summaries; promote one to a canary.")
    return full


def __getattr__(name: str) -> Any:
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console-script entry point."""
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name in _LIGHT:
        module, attr = _LIGHT[name]
        one = typer.Typer(name=f"ethen {name}", **_SETTINGS)
        one.command()(getattr(importlib.import_module(module), attr))
        one(args=sys.argv[2:], prog_name=f"ethen {name}")
        return
    _app()()
