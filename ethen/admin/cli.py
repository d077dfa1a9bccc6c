"""``ethen keys``, ``ethen projects``, ``ethen usage`` and ``ethen certify``: manage the store from a shell.

The database comes from ``--db URL``, else ``$ETHEN_DATABASE_URL``, else the ``[store]`` section of
``--config FILE`` (``ethen certify`` always needs ``--config``: the probe goes through the configured
provider). ``keys create`` prints the new key alone on stdout (so ``KEY=$(ethen keys create ...)`` works) and
its public data on stderr; the key is not shown again. Errors exit with status 2 and a message naming the
field and value; a failed probe exits with status 1.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import typer

from ethen.gateway.errors import GatewayError
from ethen.store import UNSET, Store, StoreError

__all__ = ["certify_command", "keys_app", "projects_app", "usage_command"]

T = TypeVar("T")
DB_ENV = "ETHEN_DATABASE_URL"

keys_app = typer.Typer(help="API keys of projects (shown once at creation).", no_args_is_help=True)
projects_app = typer.Typer(help="Projects: policy and window budget.", no_args_is_help=True)

_DB = typer.Option(None, "--db", help=f"Database URL (default: ${DB_ENV}, else [store] of --config).")
_CONFIG = typer.Option(None, "--config", "-c", help="Gateway TOML config (its [store] section).")


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def _url(db: str | None, config: Path | None) -> str:
    if db:
        return db
    if os.environ.get(DB_ENV):
        return os.environ[DB_ENV]
    if config is not None:
        from ethen.gateway.config import load_config, store_url

        url = store_url(load_config(config))
        if url:
            return url
        raise _fail(f"{config}: no [store] section")
    raise _fail(f"no database: pass --db URL, set ${DB_ENV}, or --config FILE with a [store] section")


def _run(db: str | None, config: Path | None, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        store = await Store.open(_url(db, config))
        try:
            return await fn(store)
        finally:
            await store.aclose()

    try:
        return asyncio.run(main())
    except StoreError as exc:
        raise _fail(exc.message) from None
    except GatewayError as exc:  # a CertificationError carries its own exit status
        raise _fail(exc.message, getattr(exc, "exit_code", 2)) from None


def _print(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def _time(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise _fail(f"{name} = {value!r}: not an ISO-8601 date or time") from None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


@keys_app.command("create")
def keys_create(
    project: str = typer.Option(..., "--project", "-p", help="Project the key acts for."),
    name: str | None = typer.Option(None, "--name", help="A label for the key."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Create a key: printed once on stdout."""
    key, info = _run(db, config, lambda st: st.create_key(project, name=name))
    typer.echo(key)
    typer.echo(f"created key {info.key_id} for project {project!r} (shown once; store it now)", err=True)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="The key id (ethen_<key id>_...)."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Revoke a key by its id (or by the full key)."""
    if key_id.startswith("ethen_"):
        from ethen.store import parse_key

        parsed = parse_key(key_id)
        if parsed is None:
            raise _fail("key: not a well-formed ethen_ key (pass the key id shown by 'ethen keys list')")
        key_id = parsed.key_id
    _print(_run(db, config, lambda st: st.revoke_key(key_id)).to_dict())


@keys_app.command("list")
def keys_list(
    project: str | None = typer.Option(None, "--project", "-p"),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """List keys (ids, project, dates; never the key)."""
    _print([k.to_dict() for k in _run(db, config, lambda st: st.list_keys(project))])


def _budget(value: str | None) -> float | None:
    if value is None or value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise _fail(f"--budget = {value!r}: a number of USD, or 'none'") from None


@projects_app.command("create")
def projects_create(
    name: str = typer.Argument(...),
    budget: str | None = typer.Option(None, "--budget", help="USD per window (default: no budget)."),
    window: str = typer.Option("month", "--window", help="day or month (calendar, UTC)."),
    provider: list[str] | None = typer.Option(None, "--provider", help="Allowed provider (repeat)."),  # noqa: B008
    model: list[str] | None = typer.Option(None, "--model", help="Allowed model (repeat)."),  # noqa: B008
    default_alias: str | None = typer.Option(None, "--default-alias", help="e.g. ethen/fast"),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Create a project."""
    b = _budget(budget)
    p = _run(
        db,
        config,
        lambda st: st.create_project(
            name,
            allowed_providers=provider or None,
            allowed_models=model or None,
            budget_usd=b,
            budget_window=window,
            default_alias=default_alias,
        ),
    )
    _print(p.to_dict())


@projects_app.command("list")
def projects_list(db: str | None = _DB, config: Path | None = _CONFIG) -> None:
    """List projects with their current window spend."""

    async def fn(st: Store) -> list[dict[str, Any]]:
        out = []
        for p in await st.list_projects():
            s = await st.spend(p)
            out.append(
                {
                    **p.to_dict(),
                    "window_start": s.window_start.isoformat(),
                    "settled_usd": s.settled_usd,
                    "reserved_usd": s.reserved_usd,
                    "remaining_usd": s.remaining_usd,
                }
            )
        return out

    _print(_run(db, config, fn))


@projects_app.command("set-budget")
def projects_set_budget(
    name: str = typer.Argument(...),
    budget: str = typer.Option(..., "--budget", help="USD per window, or 'none'."),
    window: str | None = typer.Option(None, "--window", help="day or month."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Set a project's window budget."""
    b = _budget(budget)
    p = _run(db, config, lambda st: st.update_project(name, budget_usd=b, budget_window=window or UNSET))
    _print(p.to_dict())


def usage_command(
    project: str | None = typer.Option(None, "--project", "-p"),
    since: str | None = typer.Option(None, "--since", help="ISO-8601 start (inclusive, UTC if naive)."),
    until: str | None = typer.Option(None, "--until", help="ISO-8601 end (exclusive)."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Settled usage per project, key and model over a time range."""
    s, u = _time("--since", since), _time("--until", until)
    rows = _run(db, config, lambda st: st.usage(project=project, since=s, until=u))
    _print({"data": [r.to_dict() for r in rows], "total_cost_usd": sum(r.cost_usd for r in rows)})


def certify_command(
    target: str = typer.Argument(..., help="PROVIDER/MODEL as in the config's [[routes]]."),
    config: Path = typer.Option(..., "--config", "-c", help="Gateway TOML config (providers, routes)."),  # noqa: B008
    valid_for: str = typer.Option("7d", "--valid-for", help="Receipt lifetime: 30m, 24h, 7d..."),
    db: str | None = _DB,
) -> None:
    """Send a live probe through the configured provider and store a dated certification receipt."""
    from ethen.admin.certify import certify, parse_duration
    from ethen.gateway.config import load_config

    try:
        ttl = parse_duration(valid_for)
    except ValueError as exc:
        raise _fail(f"--valid-for: {exc}") from None
    try:
        cfg = load_config(config)
    except GatewayError as exc:
        raise _fail(exc.message) from None
    receipt = _run(db, config, lambda st: certify(cfg, st, target, valid_for=ttl))
    _print(receipt.to_dict())
