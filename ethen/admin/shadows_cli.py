"""``ethen shadows`` (issue 27): the shadow candidates' summaries as a table, and ``ethen shadows promote
--alias A --candidate C`` (the one command that turns a shadow into a canary). Both talk to a running
gateway's admin API (:mod:`ethen.admin.shadows`): a promotion is installed in that gateway process.

The gateway: ``--url``, else ``$ETHEN_GATEWAY_URL``, else the ``[server]`` address of ``--config FILE``,
else ``http://127.0.0.1:8080`` (``ethen up``'s default). ``--config`` may also be an ``ethen up --config``
overlay (a partial config: no ``[[api_keys]]``, ...): it is checked merged as ``ethen up`` merges it
(:func:`load_any_config`), and the gateway is then the running ``ethen up``'s (the ``[server]`` of the
config it wrote, ``<data dir>/up-gateway.toml``), since ``ethen up`` ignores an overlay's ``[server]``.
The admin key: ``--admin-key``, else ``$ETHEN_ADMIN_KEY``, else ``<data dir>/admin_key`` (the one ``ethen
up`` wrote).

``promote --config FILE`` also appends the canary to that file as a ``[[canaries]]`` table (text appended,
the rest of the file untouched, the result validated first), so it survives a restart; a file that already
has a ``[[canaries]]`` entry for that alias and candidate is left alone (exit 2: edit it by hand). Exit
status: 0 done; 1 the gateway refused (409 ``promotion_refused``, the reason printed); 2 bad input or no
gateway.
"""

from __future__ import annotations

import json
import os
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import typer

from ethen.gateway.config import GatewayConfig, load_config, parse_config, parse_overlay, read_overlay
from ethen.gateway.errors import GatewayError
from ethen.paths import data_dir, up_config_path

__all__ = ["append_canary", "check_config", "load_any_config", "ratio", "shadows_app", "table"]

URL_ENV = "ETHEN_GATEWAY_URL"
ADMIN_ENV = "ETHEN_ADMIN_KEY"
DEFAULT_URL = "http://127.0.0.1:8080"

shadows_app = typer.Typer(
    help="Shadow evaluation: summaries of the shadow candidates; promote one to a canary.",
    invoke_without_command=True,
)

_URL = typer.Option(None, "--url", help=f"Gateway base URL (default: ${URL_ENV}, else --config's server "
                                        f"address, else {DEFAULT_URL}).")
_KEY = typer.Option(None, "--admin-key",
                    help=f"Admin key (default: ${ADMIN_ENV}, else <data dir>/admin_key).")
_CONFIG = typer.Option(None, "--config", "-c", help="Gateway TOML config: its server address (promote: "
                                                     "the canary is also appended there).")


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def load_any_config(path: Path) -> tuple[GatewayConfig, bool]:
    """``path`` as a whole gateway config, else as an ``ethen up --config`` overlay (merged as ``ethen up``
    merges it, :func:`~ethen.gateway.config.overlay.parse_overlay`): (the config, whether it is an overlay).
    ``GatewayError``: the whole config's error when the file is neither."""
    try:
        return load_config(path), False
    except GatewayError as exc:
        try:
            return parse_overlay(read_overlay(path), source=str(path)), True
        except GatewayError:
            raise exc from None


def _up_server(default: str) -> str:
    """The address of the running ``ethen up`` (the ``[server]`` of the config it wrote), else ``default``."""
    try:
        srv = load_config(up_config_path()).server
    except GatewayError:
        return default
    host = "127.0.0.1" if srv.host in ("0.0.0.0", "::", "") else srv.host
    return f"http://{host}:{srv.port}"


def _base(url: str | None, config: Path | None) -> str:
    overlay = False
    if config is not None:  # a config without [store] / [[shadows]] cannot serve shadows: say so here
        try:
            cfg, overlay = load_any_config(config)
        except GatewayError as exc:
            raise _fail(exc.message) from None
        if cfg.store is None or not cfg.shadows:
            missing = "no [store] section" if cfg.store is None else "no [[shadows]] rule"
            raise _fail(f"{config}: {missing}: shadow evaluation needs a [store] section and [[shadows]] "
                        "rules (see docs/gateway.md, Shadow evaluation)")
    if url:
        return url.rstrip("/")
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV].rstrip("/")
    if overlay:  # its [server] is ignored by `ethen up`: the gateway is the one `ethen up` runs
        return _up_server(DEFAULT_URL)
    if config is not None:
        srv = cfg.server
        host = "127.0.0.1" if srv.host in ("0.0.0.0", "::", "") else srv.host
        return f"http://{host}:{srv.port}"
    return DEFAULT_URL


def _key(admin_key: str | None) -> str:
    if admin_key:
        return admin_key
    if os.environ.get(ADMIN_ENV):
        return os.environ[ADMIN_ENV]
    path = data_dir() / "admin_key"
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    raise _fail(f"no admin key: pass --admin-key, set ${ADMIN_ENV}, or run `ethen up` (it writes {path})")


def _call(method: str, url: str, key: str, **kw: Any) -> httpx.Response:
    try:
        return httpx.request(method, url, headers={"authorization": f"Bearer {key}"}, timeout=30, **kw)
    except httpx.HTTPError as exc:
        raise _fail(f"cannot reach the gateway at {url}: {type(exc).__name__}") from None


def _error(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
        msg = str(err.get("message"))
        if r.status_code == 404 and msg.endswith(": not found"):  # no such route: the API is not served
            base, path = str(r.request.url.copy_with(query=None)).split("/api/admin/v1/", 1)
            return (f"the gateway at {base} serves no shadows admin API ({r.request.method} /api/admin/v1/"
                    f"{path}: 404): it runs without a [store] section; shadow evaluation needs [store] and "
                    "[[shadows]] rules")
        return f"{err.get('code')}: {msg}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def ratio(v: float | None) -> str:
    """A latency or cost ratio with 3 significant digits (``0.0031``, ``0.25``, ``1.5``, ``12.3``; ``1234``
    from 1000 on): a fixed 2 decimals showed a candidate 300 times faster as ``0.00`` (issue 42)."""
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    text = f"{v:.3g}"
    return format(Decimal(text), "f") if "e" in text else text  # 1e-05 -> 0.00001


def table(rows: list[dict[str, Any]]) -> str:
    """The summaries as a fixed-width table (one line per candidate)."""
    head = ("alias", "candidate", "percent", "n", "success", "latency_x", "cost_x", "exact", "similarity",
            "tools_eq", "schema_ok", "canary", "promotable")
    lines = [head]
    for d in rows:
        s = d["summary"]
        lines.append((d["alias"], d["candidate"], _num(d["percent"], "g"), str(s["n"]),
                      _num(s["success_rate"], ".1%"), ratio(s["latency_ratio"]),
                      ratio(s["cost_ratio"]), _num(s["exact_rate"], ".1%"),
                      _num(s["mean_similarity"], ".3f"), _num(s["tool_calls_equal_rate"], ".1%"),
                      _num(s["schema_valid_rate"], ".1%"), "-" if d["canary"] is None else f"{d['canary']}%",
                      "yes" if d["promotable"] else f"no ({d['promotion']})"))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]])
                     for r in lines)


@shadows_app.callback()
def shadows_list(
    ctx: typer.Context,
    alias: str | None = typer.Option(None, "--alias", help="Only this alias."),
    candidate: str | None = typer.Option(None, "--candidate", help="Only this provider/model."),
    as_json: bool = typer.Option(False, "--json", help="The admin API's answer (summaries and pairs)."),
    url: str | None = _URL,
    admin_key: str | None = _KEY,
    config: Path | None = _CONFIG,
) -> None:
    """Summaries of the [[shadows]] candidates (n, success rate, latency and cost ratios, agreement)."""
    if ctx.invoked_subcommand is not None:
        return
    params = {k: v for k, v in (("alias", alias), ("candidate", candidate)) if v is not None}
    r = _call("GET", f"{_base(url, config)}/api/admin/v1/shadows", _key(admin_key), params=params)
    if r.status_code != 200:
        raise _fail(_error(r))
    out = r.json()
    typer.echo(json.dumps(out, indent=2) if as_json else table(out["data"]))


def _canary_text(alias: str, candidate: str, percent: int, min_success_rate: float, min_samples: int) -> str:
    return (f"\n# promoted from a shadow by `ethen shadows promote` (issue 27)\n[[canaries]]\n"
            f"alias = {json.dumps(alias)}\ncandidate = {json.dumps(candidate)}\npercent = {percent}\n"
            f"min_success_rate = {min_success_rate!r}\nmin_samples = {min_samples}\n")


def check_config(path: Path, alias: str, candidate: str) -> str:
    """The config file's text, once checked: valid TOML without a ``[[canaries]]`` entry for ``alias`` and
    ``candidate`` (``GatewayError`` naming the entry otherwise)."""
    try:
        old = path.read_text(encoding="utf-8")
        data = tomllib.loads(old)
    except (OSError, UnicodeDecodeError) as exc:
        raise GatewayError(f"--config = {str(path)!r}: cannot read it ({type(exc).__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise GatewayError(f"{path}: not valid TOML: {exc}") from None
    for i, c in enumerate(data.get("canaries") or ()):
        if c.get("alias") == alias and c.get("candidate") == candidate:
            raise GatewayError(f"{path}: canaries[{i}] is already {alias!r} -> {candidate!r} "
                               f"(percent = {c.get('percent')!r}); edit it by hand")
    return old


def append_canary(path: Path, canary: dict[str, Any]) -> None:
    """Append ``canary`` to the config file at ``path`` as a ``[[canaries]]`` table, after checking the file
    (:func:`check_config`) and that the result is a valid config (``GatewayError`` otherwise)."""
    old = check_config(path, canary["alias"], canary["candidate"])
    new = old + ("" if old.endswith("\n") or not old else "\n") + _canary_text(
        canary["alias"], canary["candidate"], canary["percent"], canary["min_success_rate"],
        canary["min_samples"])
    _, overlay = load_any_config(path)  # a whole config, or an `ethen up` overlay (else its error)
    (parse_overlay if overlay else parse_config)(tomllib.loads(new), source=str(path))  # and it still is
    path.write_text(new, encoding="utf-8")


@shadows_app.command("promote")
def shadows_promote(
    alias: str = typer.Option(..., "--alias", help="The alias, e.g. ethen/coding."),
    candidate: str = typer.Option(..., "--candidate", help="The shadow's provider/model."),
    percent: int | None = typer.Option(None, "--percent", help="Canary percent: 0, 1, 5, 20, 50 or 100 "
                                                               "(default 5)."),
    url: str | None = _URL,
    admin_key: str | None = _KEY,
    config: Path | None = _CONFIG,
) -> None:
    """Turn a shadow into a canary of its alias, if its pairs meet min_samples / min_success_rate."""
    if config is not None:  # the file must be able to take the canary before the gateway does
        try:
            check_config(config, alias, candidate)
        except GatewayError as exc:
            raise _fail(exc.message) from None
    body: dict[str, Any] = {"alias": alias, "candidate": candidate}
    if percent is not None:
        body["percent"] = percent
    r = _call("POST", f"{_base(url, config)}/api/admin/v1/shadows/promote", _key(admin_key), json=body)
    if r.status_code == 409:
        raise _fail(_error(r), 1)
    if r.status_code != 200:
        raise _fail(_error(r))
    out = r.json()
    c = out["canary"]
    typer.echo(f"promoted: {c['candidate']} is now a canary of {c['alias']} at {c['percent']}% in the "
               f"running gateway ({out['reason']})")
    if config is not None:
        try:
            append_canary(config, c)
        except GatewayError as exc:
            raise _fail(exc.message) from None
        typer.echo(f"written to {config} as [[canaries]] (kept after a restart)")
    else:
        typer.echo("not written to a config file: pass --config FILE to keep it after a restart")
