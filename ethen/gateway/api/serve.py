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

Per client address (issue 23: one host reopening 1,000 trickling sockets as they were closed held the whole
``max_connections`` budget, and 111 of 116 other requests got 503). One record per address
(:class:`ClientAddress`), kept by the protocol:

- ``max_connections_per_client`` (default half of ``max_connections``, at most all of it): open connections
  of one address. A new socket past it closes the address's oldest *slow* socket (below), else its oldest
  socket still sending its first request's headers, and takes its place; when the address has neither (all
  its connections are in requests or idle keep-alive), the new socket is refused: 429
  ``too_many_connections`` with ``Retry-After: 1`` is written and the socket closed at once, before uvicorn
  counts it, so it takes nothing from the global budget (a client that already sent its request may see a
  reset instead). One address thus holds at most half the global cap by default: the rest stays for others.
- ``max_pending_headers_per_client`` (32): sockets of one address still sending a request's headers
  :attr:`~SlowClientProtocol.slow_after_s` (1 s, at most half of ``header_timeout_s``) after the connection
  opened (or after the first byte of a next request on a keep-alive connection): *slow* sockets. When one
  more turns slow, the address's oldest slow socket gets 429 ``too_many_connections`` and is closed. A fast
  client's headers arrive well within that second, so a burst of new connections from one address (a pool
  opening 200 at once) is never cut by it.

An address is the IPv4 address; an IPv4-mapped IPv6 address counts as its IPv4; an IPv6 address counts as
its /64 (one host is commonly given a whole /64, and could otherwise open each socket from a new address).

Choice where a trickler and a well-behaved client **share one address** (a NAT, one host): at most 32 of the
trickler's sockets stay slow, and the address's connection cap holds the rest; a new socket of the
well-behaved client arriving while the address is at its cap closes the trickler's oldest header-phase socket
instead of being refused, and its own headers, complete within milliseconds, take it out of the header phase
before the trickler's next sockets could pick it; requests on connections already open are served whatever
the trickler does. So the well-behaved client is served (>= 95% in the test); the trickler keeps
reconnecting. Behind a reverse proxy every client has the proxy's address: set ``max_connections_per_client
= max_connections`` there (and cap per client at the proxy). Each ``--workers`` child counts for itself (the
kernel spreads an address's connections over the children).

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
cancel of a ``loop.call_later`` handle, as uvicorn's own keep-alive timer does) and per connection two
lookups of its address's record (``connection_made``; ``connection_lost`` deletes it with the last one) and
an insert and delete in its header-phase set; the slow set is touched only by sockets still sending headers
after a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
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
from ethen.mesh.worker.launch import PARENT_DEATHSIG_ENV, PARENT_PID_ENV

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


_TOO_MANY = _raw_response(b"429 Too Many Requests\r\nretry-after: 1", _envelope(
    "too_many_connections", "Too many connections from your address are open or still sending headers; "
    "retry shortly.", "rate_limit_error"))


def client_key(peer: Any) -> str | None:
    """The address a connection counts under (module docstring): ``peer`` is the transport's ``peername``;
    ``None`` (not counted) for a peer that is no IP address (a Unix socket)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    host: str = peer[0]
    if ":" not in host:
        return host
    if host.startswith("::ffff:") and "." in host:
        return host[7:]
    try:
        net = ipaddress.IPv6Network((host.partition("%")[0], 64), strict=False)
    except ValueError:
        return host
    return f"{net.network_address}/64"


class ClientAddress:
    """One address's connections: how many are open, which are still sending their first request's headers
    (``pending``) and which have been sending headers for over ``slow_after_s`` (``slow``), oldest first."""

    __slots__ = ("open", "pending", "slow")

    def __init__(self) -> None:
        self.open = 0
        self.pending: dict[SlowClientProtocol, None] = {}
        self.slow: dict[SlowClientProtocol, None] = {}


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    """ASGI app answering a request beyond ``max_connections`` (uvicorn's own 503 is text/plain)."""
    await send({"type": "http.response.start", "status": 503, "headers": _OVERLOADED_HEADERS})
    await send({"type": "http.response.body", "body": _OVERLOADED_BODY})


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol with a header-read and a body-read deadline per request, and the
    per-address caps (module docstring)."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 60.0
    slow_after_s: ClassVar[float] = 1.0
    max_connections_per_client: ClassVar[int] = 500
    max_pending_headers_per_client: ClassVar[int] = 32
    clients: ClassVar[dict[str, ClientAddress]] = {}  # one table per server (slow_client_protocol)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._key: str | None = None  # the address this connection counts under (None: not counted)
        self._address: ClientAddress | None = None
        self._pending = False  # listed in _address.pending
        self._slow = False  # listed in _address.slow
        self._admitted = False

    def _arm(self, seconds: float, on_timeout: Callable[[], None]) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(seconds, on_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        key = client_key(transport.get_extra_info("peername"))
        if key is not None:
            address = self.clients.get(key)
            if address is None:
                address = self.clients[key] = ClientAddress()
            elif address.open >= self.max_connections_per_client:
                # make room with the address's oldest slow socket, else its oldest one still sending its
                # first headers; none: refused before uvicorn counts it (nothing taken from the global cap)
                victim = next(iter(address.slow or address.pending), None)
                if victim is None:
                    transport.write(_TOO_MANY)
                    transport.close()
                    return
                victim._evict()
                self.clients[key] = address  # back in, had the victim been its last connection
            address.open += 1
            address.pending[self] = None
            self._key, self._address, self._pending = key, address, True
        self._admitted = True
        super().connection_made(transport)
        self._arm(self.slow_after_s, self._turned_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._release()
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a next request on a keep-alive connection: its clock starts now
            self._arm(self.slow_after_s, self._turned_slow)

    def on_headers_complete(self) -> None:
        address = self._address
        if address is not None:
            if self._pending:
                self._pending = False
                del address.pending[self]
            if self._slow:
                self._slow = False
                del address.slow[self]
        self._arm(self.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        super()._start_asgi_task(cycle, _overloaded if app is service_unavailable else app)

    def _turned_slow(self) -> None:
        """Headers still incomplete ``slow_after_s`` in: listed as slow; past the address's cap its oldest
        slow socket is closed. Then the rest of the header timeout runs."""
        self._read_timer = None
        address = self._address
        if address is not None and not self.transport.is_closing():
            address.slow[self] = None
            self._slow = True
            if len(address.slow) > self.max_pending_headers_per_client:
                next(iter(address.slow))._evict()  # the oldest: never this one (the cap is at least 1)
        self._arm(self.header_timeout_s - self.slow_after_s, self._headers_too_slow)

    def _release(self) -> None:
        """Stop counting this connection under its address (once)."""
        address, key = self._address, self._key
        if address is None or key is None:
            return
        self._address = self._key = None
        if self._pending:
            self._pending = False
            del address.pending[self]
        if self._slow:
            self._slow = False
            del address.slow[self]
        address.open -= 1
        if not address.open:
            del self.clients[key]

    def _evict(self) -> None:
        """Close this slow header-phase socket to make room for its address (429 unless a response of an
        earlier request on it is still being written)."""
        self._release()
        self._disarm()
        if not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_TOO_MANY)
            self.transport.close()

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
    """:class:`SlowClientProtocol` with ``limits``' timeouts and caps, and a fresh per-address table (uvicorn
    makes one instance per connection)."""
    return type("SlowClientProtocol", (SlowClientProtocol,), {
        "header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s,
        "slow_after_s": min(1.0, limits.header_timeout_s / 2),
        "max_connections_per_client": limits.connections_per_client,
        "max_pending_headers_per_client": limits.max_pending_headers_per_client, "clients": {}})


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
