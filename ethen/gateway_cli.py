"""``ethen gateway --config FILE [--host H] [--port P] [--workers N]``: serve the gateway with uvicorn.

``--workers N`` (default 1) runs N gateway processes on the one port
(:func:`ethen.gateway.api.serve.serve_workers`): each is a separate instance; give them ``[shared]`` Redis to
share telemetry and rate limits. ``--fd`` and ``--worker-index`` are how the parent starts each worker
(not for direct use).

The config is validated before the server starts; a bad config prints the error (which names the key and
the value) and exits with status 2. ``--hash-key`` reads a client key on stdin and prints the SHA-256 digest
to put in ``[[api_keys]] sha256`` (the key never appears on the command line or in shell history).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import typer

from ethen.gateway.errors import GatewayConfigError
from ethen.knobs import warn_gone_env

__all__ = ["gateway"]


def gateway(
    config: Path = typer.Option(None, "--config", "-c", help="Gateway TOML config file."),  # noqa: B008
    host: str | None = typer.Option(None, "--host", help="Bind address (default: \\[server].host)."),
    port: int | None = typer.Option(None, "--port", help="Port (default: \\[server].port)."),
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
    log_format: str = typer.Option("text", "--log-format", envvar="ETHEN_LOG_FORMAT",
                                   help="text, or json (one JSON object per line)."),
    hash_key: bool = typer.Option(False, "--hash-key", help="Read a key on stdin, print its SHA-256 digest."),
    workers: int = typer.Option(1, "--workers", min=1, max=256, help="Gateway processes sharing the port."),
    fd: int | None = typer.Option(None, "--fd", hidden=True, help="Serve this inherited listening socket."),
    worker_index: int | None = typer.Option(None, "--worker-index", hidden=True),
    parent_pid: int | None = typer.Option(None, "--parent-pid", hidden=True),
    parent_deathsig: bool = typer.Option(False, "--parent-deathsig", hidden=True),
) -> None:
    """Serve the OpenAI-compatible gateway (/api/gateway/v1) with ethen/* smart routing."""
    from ethen.gateway.accounting.auth import KEY_PREFIX
    from ethen.gateway.accounting.auth import hash_key as digest

    if hash_key:
        key = sys.stdin.readline().strip()
        if not key.startswith(KEY_PREFIX):
            typer.echo(f"error: gateway keys must start with {KEY_PREFIX!r}", err=True)
            raise typer.Exit(2)
        typer.echo(digest(key))
        return
    if config is None:
        typer.echo("error: --config FILE is required", err=True)
        raise typer.Exit(2)
    warn_gone_env()  # ETHEN_CACHE_DIR / ETHEN_ACCURACY / ETHEN_DEVICE: the mesh head no longer reads them

    from ethen.app import create_app
    from ethen.gateway.api.serve import serve, serve_workers
    from ethen.gateway.catalog import Catalog
    from ethen.gateway.config import load_config, skip_providers_without_keys

    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        typer.echo(f"error: --log-level = {log_level!r}: use debug, info, warning or error", err=True)
        raise typer.Exit(2)
    from ethen.gateway.observation.logformat import FORMATS, configure_logging

    if log_format not in FORMATS:
        typer.echo(f"error: --log-format = {log_format!r}: use text or json", err=True)
        raise typer.Exit(2)
    configure_logging(level, log_format)
    if level != "ERROR":  # start-up progress (a mesh provider loading its model) shows at the default level
        logging.getLogger("ethen.gateway.startup").setLevel(logging.INFO)
    sock = None
    if fd is not None:  # a --workers child: die with the parent, serve its socket
        from ethen.mesh.worker.launch import die_with_parent

        die_with_parent(parent_pid, parent_deathsig)
        sock = socket.socket(fileno=fd)
    try:
        cfg = skip_providers_without_keys(load_config(config))  # WARNING per provider whose key is unset
        if workers > 1 and fd is None:
            if not serve_workers(str(config), workers, host=host or cfg.server.host, log_level=log_level,
                                 port=port if port is not None else cfg.server.port):
                raise typer.Exit(3)  # the port was taken (logged)
            return
        if worker_index is not None and cfg.store is not None and cfg.store.instance_id is not None:
            iid = f"{cfg.store.instance_id[:56]}-w{worker_index}"  # two processes never share a lease
            cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"instance_id": iid})})
        app = create_app(cfg, catalog=Catalog.load())
    except GatewayConfigError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    if not serve(app, host=host or cfg.server.host, port=port if port is not None else cfg.server.port,
                 log_level=log_level, limits=cfg.server, sock=sock):
        raise typer.Exit(3)  # the lifespan start-up failed (logged above) or the port was taken
