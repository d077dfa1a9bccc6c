"""The ``ethen`` command line: a thin shell that wires sub-commands to the package's cores."""

from __future__ import annotations

import typer

from ethen.admin.cli import certify_command, keys_app, projects_app, usage_command
from ethen.gateway.cli import gateway as gateway_command
from ethen.mesh.cli import app as mesh_app
from ethen.mesh.worker.cli import worker as worker_command
from ethen.up import up as up_command

app = typer.Typer(
    name="ethen",
    help="Ethen: an open LLM routing layer (gateway smart routing + mesh cost-aware routing).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(mesh_app, name="mesh", help="Mesh cost-aware routing over layer fragments.")
app.command("worker")(worker_command)
app.command("gateway")(gateway_command)
app.command("up")(up_command)
app.add_typer(keys_app, name="keys", help="Project API keys (ethen_...), shown once at creation.")
app.add_typer(projects_app, name="projects", help="Projects: allowed providers/models, window budget.")
app.command("usage")(usage_command)
app.command("certify")(certify_command)


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
