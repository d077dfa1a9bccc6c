"""Serve a gateway app with uvicorn: the one server loop of ``ethen gateway --config`` and ``ethen up``.

Choice: SIGINT/SIGTERM start uvicorn's graceful shutdown (the lifespan closes the providers: HTTP pools, the
mesh orchestrator) and :func:`serve` then returns normally. Stock ``uvicorn.Server`` re-raises the signal once
it has shut down, from inside its event loop, where asyncio's own SIGINT handler turned a clean Ctrl-C into a
``KeyboardInterrupt`` traceback logged by the lifespan, and SIGTERM into death by signal before the caller's
clean-up (``ethen up`` stopping its workers) could run. A second Ctrl-C still forces the exit.

Slow clients, per-address connection caps, the fair share and ``[server] trusted_proxies``: see
:mod:`ethen.gateway.api.connections` (its :class:`SlowClientProtocol` is uvicorn's ``http`` protocol here).

``ethen gateway --workers N`` (:func:`serve_workers`): the parent binds the listening socket once and starts N
``ethen gateway`` child processes that inherit it (pre-fork, as gunicorn and uvicorn's own ``--workers`` do:
the kernel hands each connection to one of them; ``--port 0`` works, every worker serves the one port). Each
child is a separate instance (its own telemetry, circuits, budget grants and lease; with ``[shared]`` Redis
they share telemetry and rate limits, like instances on separate hosts). A child that dies is restarted after
1 s (one WARNING line each); SIGINT/SIGTERM to the parent stops them all gracefully; the children also stop
when the parent dies of any signal (``ethen.mesh.worker.launch.die_with_parent``). A ``[store] instance_id``
gets ``-w<i>`` appended per worker (two processes must never share a lease).

A body cut off by its timeout reaches the app as a client disconnect; uvicorn's "Exception in ASGI
application" log of that ``ClientDisconnect`` is dropped (nothing failed on the server, and a log line per
slow client would let clients flood the log). Every log record has its query-string secrets redacted
(:func:`ethen.gateway.observation.logformat.install_redaction`, installed here too: uvicorn's debug access log
writes each request's path and query).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from starlette.requests import ClientDisconnect

from ethen.gateway.api.connections import ClientAddress, SlowClientProtocol, client_key, slow_client_protocol
from ethen.gateway.config import ServerConfig
from ethen.gateway.observation.logformat import install_redaction
from ethen.mesh.worker.launch import parent_args

__all__ = ["ClientAddress", "GatewayServer", "SlowClientProtocol", "client_key", "serve", "serve_workers",
           "slow_client_protocol"]

log = logging.getLogger("ethen.gateway.api.serve")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` whose signal capture shuts down gracefully without re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class _DropClientDisconnects(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ClientDisconnect)


_QUIET = _DropClientDisconnects()


def serve(app: Any, *, host: str, port: int, log_level: str = "warning",
          on_started: Callable[[], None] | None = None, limits: ServerConfig | None = None,
          sock: socket.socket | None = None) -> bool:
    """Run ``app`` until a signal; ``on_started`` runs (in a thread) once the port accepts connections.
    ``limits``: the slow-client limits (default: :class:`ServerConfig`'s). ``sock``: an already listening
    socket to serve instead of binding ``host:port`` (a ``--workers`` child). Returns whether the server
    started (``False``: the lifespan start-up failed or the port was taken)."""
    level = log_level.lower()
    lim = limits if limits is not None else ServerConfig()
    install_redaction()
    # forwarded headers only from [server] trusted_proxies (uvicorn's default trusts 127.0.0.1 and ::1)
    config = uvicorn.Config(app, host=host, port=port, log_level=level, access_log=level == "debug",
                            lifespan="on", http=slow_client_protocol(lim),
                            limit_concurrency=lim.max_connections, proxy_headers=bool(lim.trusted_proxies),
                            forwarded_allow_ips=list(lim.trusted_proxies))
    logging.getLogger("uvicorn.error").addFilter(_QUIET)  # after Config set uvicorn's logging up; added once
    server = GatewayServer(config)
    if on_started is not None:
        def watch() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                on_started()

        threading.Thread(target=watch, name="ethen-started", daemon=True).start()
    server.run(sockets=[sock] if sock is not None else None)
    return bool(server.started)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_workers(config: str, workers: int, *, host: str, port: int, log_level: str = "warning",
                  on_started: Callable[[int], None] | None = None) -> bool:
    """``ethen gateway --workers N``: bind ``host:port`` once, run N child gateways on it until SIGINT/SIGTERM
    (module docstring). ``on_started(port)`` runs once the socket listens. Returns ``False`` when the port
    cannot be bound (logged)."""
    try:
        sock = _listen(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return False
    fd = sock.fileno()
    parent = parent_args()  # (the main thread's: --parent-deathsig)

    def spawn(i: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "ethen", "gateway", "--config", config, "--fd", str(fd),
               "--worker-index", str(i), "--log-level", log_level, *parent]
        return subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.PIPE)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _SIGNALS}
    procs = [spawn(i) for i in range(workers)]
    restart_at: dict[int, float] = {}
    if on_started is not None:
        on_started(sock.getsockname()[1])
    try:
        while not stop.wait(0.2):
            for i, p in enumerate(procs):
                if p.poll() is None:
                    continue
                if i not in restart_at:
                    log.warning("gateway worker %d (pid %d) exited with status %s; restarting in 1 s",
                                i, p.pid, p.returncode)
                    restart_at[i] = time.monotonic() + 1.0
                elif time.monotonic() >= restart_at[i]:
                    del restart_at[i]
                    procs[i] = spawn(i)
                    log.warning("gateway worker %d restarted (pid %d)", i, procs[i].pid)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return True
