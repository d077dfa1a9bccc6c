"""The checks of ``ethen up``'s flags before anything slow loads: the port (:func:`check_port`),
``--join`` / ``--tls-cert`` / ``--tls-key`` (:func:`check_join`) and the ``--config`` overlay
(:func:`check_overlay`); a bad value exits with one line naming it (:func:`say`).

Choices where the issue is silent:
- The port is checked early (bind with ``SO_REUSEADDR`` as uvicorn does, then close): a taken port fails in
  well under a second with the port in the message, before the model and workers load. ``--port 0`` picks a
  free port at that check (the banner prints it).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any

import typer

from ethen.up_config import gateway_document
from ethen.up_state import mesh_token_file

__all__ = ["check_join", "check_overlay", "check_port", "say", "second_port"]


def check_port(host: str, port: int) -> int:
    """Bind ``host:port`` (``SO_REUSEADDR``, as uvicorn does) and close: the port the gateway will get.
    ``port`` 0 returns a free port. Raises ``OSError`` with a message naming the address (or the port, when
    it is not one: 0-65535)."""
    if not 0 <= port <= 65535:
        raise OSError(f"--port {port}: a port is a number from 0 to 65535 (0: a free one)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host!r}: {exc.strerror}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise OSError(f"port {port} on {host} is not available ({exc.strerror}); another process "
                              f"listens there? stop it or pick another with --port") from None
            if port == 0:
                port = int(sock.getsockname()[1])
    return port


def second_port(host: str, port: int) -> int | None:
    """A port for the banner's second ``ethen gateway --config`` (issue 23 item 8): ``port + 1`` if free,
    else one the OS picks (free now; ``None`` if none can be bound)."""
    for candidate in ((port + 1, 0) if port < 65535 else (0,)):
        try:
            return check_port(host, candidate)
        except OSError:
            continue
    return None


def check_join(join: str | None, tls_cert: Path | None, tls_key: Path | None) -> tuple[str, str] | None:
    """``--join`` / ``--tls-cert`` / ``--tls-key`` checked before anything slow loads, by the mesh provider's
    own config rules (a non-loopback registry needs TLS; files must exist): a bad value exits 2 naming it.
    Returns the registry's (certificate, key) paths, ``None`` without TLS."""
    from ethen.gateway.config import parse_config
    from ethen.gateway.errors import GatewayConfigError
    from ethen.mesh.auth import is_loopback

    if join is None and tls_cert is None and tls_key is None:
        return None
    if (tls_cert is None) != (tls_key is None):
        say("error: --tls-cert and --tls-key go together")
        raise typer.Exit(2)
    if join is None:
        say("error: --tls-cert / --tls-key secure the --join registry: give --join HOST:PORT too")
        raise typer.Exit(2)
    tls = None if tls_cert is None or tls_key is None else (str(tls_cert.resolve()), str(tls_key.resolve()))
    doc = gateway_document("127.0.0.1", 1, "x" * 32, {"check": "127.0.0.1:1"}, join=join, tls=tls,
                           token_file=str(mesh_token_file().resolve()))
    try:
        parse_config(doc, source="--join")
    except GatewayConfigError as exc:
        host, _, port = join.rpartition(":")
        if tls is None and port.isdigit() and not is_loopback(host):
            say(f"error: --join {join}: a registry other hosts reach needs --tls-cert and --tls-key "
                 "(make them with `ethen mesh certs`); the mesh token is passed already")
        else:
            say(f"error: {exc.message}")
        raise typer.Exit(2) from None
    return tls


def _read_user_config(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"--config {path}: {exc}") from None


def check_overlay(config: Path, host: str, port: int, model: Path | None) -> dict[str, Any]:
    """The ``--config`` overlay, read and validated merged into a stand-in of the generated config (exit 2
    naming the file, the key and the value): before any file is written or any process starts."""
    from ethen.gateway.config import parse_overlay, stand_in_document
    from ethen.gateway.errors import GatewayConfigError

    user = _read_user_config(config)
    base = stand_in_document(host, port)
    if model is not None:  # a GGUF of another model: its routes name it (checked again with its real name)
        base["providers"][0]["model_path"] = str(model.resolve())
    try:
        parse_overlay(user, source=f"--config {config}", base=base)
    except GatewayConfigError as exc:
        say(f"error: {exc.message}")
        raise typer.Exit(2) from None
    return user


def say(msg: str) -> None:
    with contextlib.suppress(OSError):  # the terminal / pipe is gone: stopping the workers still must happen
        print(msg, file=sys.stderr, flush=True)
