"""``ethen mesh ...`` commands (placeholder until the mesh router lands)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)

__all__ = ["app"]
