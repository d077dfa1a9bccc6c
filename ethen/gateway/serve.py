"""Serve a gateway app with uvicorn: the one server loop of ``ethen gateway --config`` and ``ethen up``.

Choice: SIGINT/SIGTERM start uvicorn's graceful shutdown (the lifespan closes the providers: HTTP pools, the
mesh orchestrator) and :func:`serve` then returns normally. Stock ``uvicorn.Server`` re-raises the signal once
it has shut down, from inside its event loop, where asyncio's own SIGINT handler turned a clean Ctrl-C into a
``KeyboardInterrupt`` traceback logged by the lifespan, and SIGTERM into death by signal before the caller's
clean-up (``ethen up`` stopping its workers) could run. A second Ctrl-C still forces the exit.

Slow clients (``[server]`` keys, :class:`~ethen.gateway.config.ServerConfig`): uvicorn bounds idle keep-alive
connections (5 s) and, with ``limit_concurrency``, concurrent connections, but not how long a client may take
to send a request, so a slowloris client (one header byte a second) held its connection forever.
:class:`SlowClientProtocol` (uvicorn's httptools protocol plus two timers, passed as ``Config(http=...)``):

- ``header_timeout_s`` (10): a request's headers must be complete that long after the connection opens (first
  request) or after its first byte (next requests on a keep-alive connection; the idle time between requests
  stays uvicorn's keep-alive timeout). Else the client gets 408 ``request_timeout`` and the connection closes.
- ``body_timeout_s`` (60): the body must be complete that long after the headers; else 408 (if no response
  started) and the connection closes. A total time, not a minimum rate: it is what bounds how long a client
  holds a connection, and the 32 MB body limit over 60 s already asks only ~0.5 MB/s of a legitimate client.
- ``max_connections`` (1000) is uvicorn's ``limit_concurrency``: a request arriving while that many
  connections (or requests) are open gets 503 ``server_overloaded`` with ``Retry-After: 1``.

``ethen gateway --workers N`` (:func:`serve_workers`): the parent binds the listening socket once and starts N
``ethen gateway`` child processes that inherit it (pre-fork, as gunicorn and uvicorn's own ``--workers`` do:
the kernel hands each connection to one of them; ``--port 0`` works, every worker serves the one port). Each
child is a separate instance (its own telemetry, circuits, budget grants and lease; with ``[shared]`` Redis
they share telemetry and rate limits, like instances on separate hosts). A child that dies is restarted after
1 s (one WARNING line each); SIGINT/SIGTERM to the parent stops them all gracefully; the children also stop
when the parent dies of any signal (``ethen.mesh.worker.launch.die_with_parent``). A ``[store] instance_id``
gets ``-w<i>`` appended per worker (two processes must never share a lease).

The 408/503 bodies are the OpenAI error envelope, written straight to the socket (they never reach the app).
A body cut off by its timeout reaches the app as a client disconnect; uvicorn's "Exception in ASGI
application" log of that ``ClientDisconnect`` is dropped (nothing failed on the server, and a log line per
slow client would let clients flood the log). The hot path pays two timer operations per request (arm and
cancel of a ``loop.call_later`` handle, as uvicorn's own keep-alive timer does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, ClassVar

import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ethen.gateway.config import ServerConfig

__all__ = ["GatewayServer", "SlowClientProtocol", "serve", "serve_workers", "slow_client_protocol"]

log = logging.getLogger("ethen.gateway.serve")

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


def _envelope(code: str, message: str, type_: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def _raw_response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


_HEADER_TIMEOUT = _raw_response(b"408 Request Timeout", _envelope(
    "request_timeout", "The request headers were not received in time.", "invalid_request_error"))
_BODY_TIMEOUT = _raw_response(b"408 Request Timeout", _envelope(
    "request_timeout", "The request body was not received in time.", "invalid_request_error"))
_OVERLOADED_BODY = _envelope(
    "server_overloaded", "The gateway has too many open connections; retry shortly.", "api_error")
_OVERLOADED_HEADERS = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(_OVERLOADED_BODY)).encode()),
                       (b"connection", b"close"), (b"retry-after", b"1")]


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    """ASGI app answering a request beyond ``max_connections`` (uvicorn's own 503 is text/plain)."""
    await send({"type": "http.response.start", "status": 503, "headers": _OVERLOADED_HEADERS})
    await send({"type": "http.response.body", "body": _OVERLOADED_BODY})


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol with a header-read and a body-read deadline per request."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, on_timeout: Callable[[], None]) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(seconds, on_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, self._headers_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a next request on a keep-alive connection: its clock starts now
            self._arm(self.header_timeout_s, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._arm(self.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        super()._start_asgi_task(cycle, _overloaded if app is service_unavailable else app)

    def _headers_too_slow(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.write(_HEADER_TIMEOUT)
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.response_started = True  # nothing the app sends after this reaches the socket
            self.transport.write(_BODY_TIMEOUT)
        self.transport.close()  # the app's receive() sees a disconnect


def slow_client_protocol(limits: ServerConfig) -> type[SlowClientProtocol]:
    """:class:`SlowClientProtocol` with ``limits``' timeouts (uvicorn makes one instance per connection)."""
    return type("SlowClientProtocol", (SlowClientProtocol,), {
        "header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s})


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
    config = uvicorn.Config(app, host=host, port=port, log_level=level, access_log=level == "debug",
                            lifespan="on", http=slow_client_protocol(lim),
                            limit_concurrency=lim.max_connections)
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
    from ethen.mesh.worker.launch import PARENT_DEATHSIG_ENV, PARENT_PID_ENV

    try:
        sock = _listen(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return False
    fd = sock.fileno()
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), PARENT_DEATHSIG_ENV: "1"}

    def spawn(i: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "ethen", "gateway", "--config", config, "--fd", str(fd),
               "--worker-index", str(i), "--log-level", log_level]
        return subprocess.Popen(cmd, pass_fds=(fd,), env=env, stdin=subprocess.PIPE)

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
