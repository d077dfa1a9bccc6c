"""``ethen keys``, ``ethen projects``, ``ethen usage``, ``ethen logs`` and ``ethen certify``: manage the store
from a shell (``ethen shadows``, which talks to a running gateway's admin API, is
:mod:`ethen.admin.shadows_cli`).

The database comes from ``--db URL``, else ``$ETHEN_DATABASE_URL``, else the ``[store]`` section of
``--config FILE``, else the store of ``ethen up``: the ``[store]`` of the config it last wrote
(``<data dir>/up-gateway.toml``), else its embedded SQLite file ``<data dir>/ethen.db`` (created if need be;
the data dir is ``$ETHEN_DATA_DIR``, see :mod:`ethen.paths`). So with ``ethen up`` running, every command here
works without flags and acts on the store that gateway serves. ``ethen certify`` probes through the providers
of ``--config``, else of ``ethen up``'s config. ``keys create`` prints the new key alone on stdout (so
``KEY=$(ethen keys create ...)`` works) and its public data on stderr; the key is not shown again. Without
``--project`` the key is for project ``default``, created (no budget, no restriction) on first use. Errors
exit with status 2 and a message naming the field (or flag) and value; a failed probe exits with status 1.

Rate limits (:mod:`ethen.gateway.accounting.ratelimit`): ``--rpm`` / ``--tpm`` on ``projects create``,
``projects set``,
``keys create`` and ``keys set`` (requests / tokens per ``[rate_limits] window_s``; a whole number >= 1, or
``none`` to clear one with ``set``). Running gateways apply a change within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import typer

from ethen.admin.certify import certify, parse_duration
from ethen.admin.shadows_cli import shadows_app
from ethen.gateway.config import load_config, store_url
from ethen.gateway.errors import GatewayError
from ethen.paths import default_store_url, up_config_path
from ethen.store import (
    UNSET,
    Store,
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    parse_key,
    usage_report,
)
from ethen.store.requests import RequestQuery, list_requests, parse_status
from ethen.store.store import MAX_RATE

__all__ = [
    "certify_command", "keys_app", "logs_command", "projects_app", "shadows_app", "usage_command",
]

T = TypeVar("T")
DB_ENV = "ETHEN_DATABASE_URL"

keys_app = typer.Typer(help="API keys of projects (shown once at creation).", no_args_is_help=True)
projects_app = typer.Typer(help="Projects: policy and window budget.", no_args_is_help=True)

_DB = typer.Option(None, "--db", help=f"Database URL (default: ${DB_ENV}, else \\[store] of --config, "
                                      "else the store of `ethen up`).")
_CONFIG = typer.Option(None, "--config", "-c", help="Gateway TOML config (its \\[store] section).")
DEFAULT_PROJECT = "default"
_RPM_HELP = "Requests per rate-limit window (\\[rate_limits] window_s, 60 s)"
_TPM_HELP = "Tokens per rate-limit window"


def _rate(flag: str, value: str | None, *, clearable: bool = False) -> int | None:
    """A ``--rpm`` / ``--tpm`` value: a whole number from 1 to ``MAX_RATE`` (or ``none`` where it clears)."""
    if value is None or (clearable and value.strip().lower() == "none"):
        return None
    v = value.strip()
    if not (v.isascii() and v.isdigit()) or not 1 <= int(v) <= MAX_RATE:
        extra = ", or 'none' to clear it" if clearable else ""
        raise _fail(f"{flag} = {value!r}: a whole number from 1 to {MAX_RATE}{extra}")
    return int(v)


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def _url(db: str | None, config: Path | None) -> str:
    if db:
        return db
    if os.environ.get(DB_ENV):
        return os.environ[DB_ENV]
    if config is not None:
        url = store_url(load_config(config))
        if url:
            return url
        raise _fail(f"{config}: no [store] section")
    written = up_config_path()
    if written.is_file():  # ethen up's config: its [store] (the embedded one unless the user gave one)
        try:
            url = store_url(load_config(written))
        except GatewayError as exc:
            raise _fail(f"{exc.message} (the config `ethen up` wrote; or pass --db URL)") from None
        if url:
            return url
    path = Path(default_store_url().removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    return default_store_url()


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


async def _default_project(st: Store) -> None:
    """Project ``default`` (no budget, no restriction), created if missing."""
    try:
        await st.get_project(DEFAULT_PROJECT)
    except StoreNotFoundError:
        try:
            await st.create_project(DEFAULT_PROJECT)
            typer.echo(f"created project {DEFAULT_PROJECT!r} (no budget, no restriction)", err=True)
        except StoreConflictError:  # created meanwhile by another command
            pass


@keys_app.command("create")
def keys_create(
    project: str | None = typer.Option(
        None, "--project", "-p", help=f"Project the key acts for (default: {DEFAULT_PROJECT!r}, created)."
    ),
    name: str | None = typer.Option(None, "--name", help="A label for the key."),
    rpm: str | None = typer.Option(None, "--rpm", help=f"{_RPM_HELP}, this key alone (default: none)."),
    tpm: str | None = typer.Option(None, "--tpm", help=f"{_TPM_HELP}, this key alone (default: none)."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Create a key: printed once on stdout."""
    r, t = _rate("--rpm", rpm), _rate("--tpm", tpm)

    async def create(st: Store) -> tuple[str, Any]:
        if project is None:
            await _default_project(st)
        return await st.create_key(project or DEFAULT_PROJECT, name=name, rpm=r, tpm=t)

    key, info = _run(db, config, create)
    project = info.project
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
        parsed = parse_key(key_id)
        if parsed is None:
            raise _fail("key: not a well-formed ethen_ key (pass the key id shown by 'ethen keys list')")
        key_id = parsed.key_id
    _print(_run(db, config, lambda st: st.revoke_key(key_id)).to_dict())


@keys_app.command("set")
def keys_set(
    key_id: str = typer.Argument(..., help="The key id (shown by 'ethen keys list')."),
    rpm: str | None = typer.Option(None, "--rpm", help=f"{_RPM_HELP}, or 'none'."),
    tpm: str | None = typer.Option(None, "--tpm", help=f"{_TPM_HELP}, or 'none'."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Change a key's own rate limits (its project's apply too)."""
    if rpm is None and tpm is None:
        raise _fail("nothing to change: give --rpm and/or --tpm")
    given = (("rpm", rpm), ("tpm", tpm))
    changes = {f: _rate(f"--{f}", v, clearable=True) for f, v in given if v is not None}
    _print(_run(db, config, lambda st: st.update_key(key_id, **changes)).to_dict())


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
    rpm: str | None = typer.Option(None, "--rpm", help=f"{_RPM_HELP} (default: none)."),
    tpm: str | None = typer.Option(None, "--tpm", help=f"{_TPM_HELP} (default: none)."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Create a project."""
    b = _budget(budget)
    r, t = _rate("--rpm", rpm), _rate("--tpm", tpm)
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
            rpm=r,
            tpm=t,
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


@projects_app.command("set")
def projects_set(
    name: str = typer.Argument(...),
    budget: str | None = typer.Option(None, "--budget", help="USD per window, or 'none'."),
    window: str | None = typer.Option(None, "--window", help="day or month."),
    rpm: str | None = typer.Option(None, "--rpm", help=f"{_RPM_HELP}, or 'none'."),
    tpm: str | None = typer.Option(None, "--tpm", help=f"{_TPM_HELP}, or 'none'."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Change a project's policy: budget, window, rate limits (the flags given; the rest stays)."""
    changes: dict[str, Any] = {}
    if budget is not None:
        changes["budget_usd"] = _budget(budget)
    if window is not None:
        changes["budget_window"] = window
    for flag, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None:
            changes[flag] = _rate(f"--{flag}", value, clearable=True)
    if not changes:
        raise _fail("nothing to change: give --budget, --window, --rpm and/or --tpm")
    _print(_run(db, config, lambda st: st.update_project(name, **changes)).to_dict())


def usage_command(
    project: str | None = typer.Option(None, "--project", "-p"),
    since: str | None = typer.Option(None, "--since", help="ISO-8601 start (inclusive, UTC if naive)."),
    until: str | None = typer.Option(None, "--until", help="ISO-8601 end (exclusive)."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """Settled usage per project, key and model over a time range, with the prompt-cache tokens read and
    written and what the reads saved."""
    s, u = _time("--since", since), _time("--until", until)
    rows = _run(db, config, lambda st: st.usage(project=project, since=s, until=u))
    _print(usage_report(rows))


def certify_command(
    target: str = typer.Argument(..., help="PROVIDER/MODEL as in the config's \\[\\[routes]]."),
    config: Path | None = typer.Option(  # noqa: B008
        None, "--config", "-c", help="Gateway TOML config (providers, routes; default: `ethen up`'s)."
    ),
    valid_for: str = typer.Option("7d", "--valid-for", help="Receipt lifetime: 30m, 24h, 7d..."),
    db: str | None = _DB,
) -> None:
    """Send a live probe through the configured provider and store a dated certification receipt."""
    try:
        ttl = parse_duration(valid_for)
    except ValueError as exc:
        raise _fail(f"--valid-for: {exc}") from None
    if config is None:
        config = up_config_path()
        if not config.is_file():
            raise _fail(f"no config: pass --config FILE (or run `ethen up`, which writes {config})")
    try:
        cfg = load_config(config)
    except GatewayError as exc:
        raise _fail(exc.message) from None
    receipt = _run(db, config, lambda st: certify(cfg, st, target, valid_for=ttl))
    _print(receipt.to_dict())


def _log_line(r: dict[str, Any]) -> str:
    served = f"{r['selected_provider']}/{r['selected_model']}" if r["selected_model"] else "-"
    tokens = f"{r['prompt_tokens']}+{r['completion_tokens']} tok" if r["prompt_tokens"] is not None else "-"
    if r.get("cache_read_tokens") or r.get("cache_write_tokens"):  # issue 45: the prompt cache's part
        tokens += (f" (cache {r['cache_read_tokens']} read {r['cache_write_tokens']} written, "
                   f"saved ${r.get('saved_usd') or 0.0:.6f})")
    cost = f"${r['cost_usd']:.6f}" if r["cost_usd"] is not None else "-"
    flags = " fallback" if r["fallback_used"] else ""
    flags += " canary" if r["canary_hit"] else ""
    flags += " stream" if r["stream"] else ""
    err = f" {r['error_code']}" if r["error_code"] else ""
    return (f"{r['at']} {r['request_id']} {r['status']} {r['outcome']}{err} project={r['project'] or '-'} "
            f"{r['requested_model'] or '-'} -> {served} {r['latency_ms']:.1f} ms {tokens} {cost}{flags}")


def logs_command(
    project: str | None = typer.Option(None, "--project", "-p"),
    model: str | None = typer.Option(None, "--model", help="Requested or served model."),
    status: str | None = typer.Option(None, "--status", help="HTTP status, or ok / error / stream_error."),
    limit: int = typer.Option(50, "--limit", "-n", min=1, max=500, help="How many of the latest to show."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new requests (Ctrl-C stops)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line, with the receipt."),
    db: str | None = _DB,
    config: Path | None = _CONFIG,
) -> None:
    """The gateway's request log: the latest requests, oldest first (each with its outcome, route, cost)."""
    try:
        st_filter = parse_status(status) if status is not None else None
    except ValueError as exc:
        raise _fail(f"--status: {exc}") from None
    query = RequestQuery(project=project, model=model, status=st_filter, limit=limit)

    def show(rows: list[dict[str, Any]]) -> int | None:
        for r in reversed(rows):
            typer.echo(json.dumps(r, separators=(",", ":")) if as_json else _log_line(r))
        return rows[0]["id"] if rows else None

    async def run(st: Store) -> None:
        last = show(await list_requests(st, query, receipt=as_json))
        while follow:  # until Ctrl-C
            await asyncio.sleep(1.0)
            q = RequestQuery(project=project, model=model, status=st_filter, limit=500, after_id=last or 0)
            last = show(await list_requests(st, q, receipt=as_json)) or last

    with contextlib.suppress(KeyboardInterrupt):  # --follow ends with Ctrl-C
        _run(db, config, run)
