"""Connections of slow clients, per client address, and from trusted proxies (``[server]`` keys,
:class:`~ethen.gateway.config.ServerConfig`). uvicorn bounds idle keep-alive connections (5 s) and, with
``limit_concurrency``, concurrent connections, but not how long a client may take to send a request, so a
slowloris client (one header byte a second) held its connection forever.
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

- ``max_connections_per_client`` (default half of ``max_connections``, at most all of it): open connections of
  one address. A new socket past it closes the address's oldest *slow* socket (below), else its oldest socket
  still sending its first request's headers, and takes its place; when the address has neither (all its
  connections are in requests or idle keep-alive), the new socket is refused: 429 ``too_many_connections``
  with ``Retry-After: 1`` is written and the socket closed at once, before uvicorn counts it, so it takes
  nothing from the global budget (then the lingering close below). One address alone holds at most half the
  global cap by default: the rest stays for others.
- The **fair share** (issue 42: two addresses trickling that way held half each, so all 1,000, and a third
  client got 503 on 76 of 113 requests): while ``k`` >= 2 addresses hold connections (the new socket's
  counted), one address may hold at most ``max_connections // (k + 1)`` of them
  (:func:`connection_share`; at most ``max_connections_per_client``, at least 1): the ``k`` addresses share
  ``k / (k + 1)`` of the budget and one share stays free for an address yet to come. An address already
  above its share (it got there while fewer addresses were active) is brought down by the others: when a
  new socket leaves less than one share of ``max_connections`` free, the address holding the most
  connections above its share loses its oldest slow (else header-phase) socket (429, as above). Sockets in
  a request or idle keep-alive are never closed for it: a client with that many requests under way keeps
  them, and only gets no more connections past its share. Two tricklers thus end up with about a third
  each, and ``k`` of them with ``k / (k + 1)`` of the budget, whatever order they came in; a normal client
  on another address finds free connections (the tests: two tricklers and a normal client, and three
  tricklers coming one after another; at 1,000 connections, two addresses trickling 1,000 sockets each for
  60 s, a third was served 316 of 316 requests, 65 of 272 before). The rule costs one length check per
  connection, and a scan of the active addresses only on a connection that leaves less than one share free.
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
reconnecting. Each ``--workers`` child counts for itself (the kernel spreads an address's connections over
the children).

Behind a reverse proxy every client has the proxy's address: list the proxy in ``[server] trusted_proxies``
(IP addresses or CIDR networks, empty by default). Its connections are then not counted per address (the
clients behind it are only known once a request's headers are read: cap per client at the proxy), and its
``X-Forwarded-For`` / ``X-Forwarded-Proto`` headers are believed (uvicorn's ``proxy_headers``, given exactly
that list as ``forwarded_allow_ips``), so the login throttle, the logs and the dashboard see the client's
address. From any other peer, loopback included, forwarded headers are ignored (issue 42: uvicorn trusted
them from 127.0.0.1 by default, so a local client could log any address it liked and dodge the login
throttle by naming a new one each time).

The 408/429/503 bodies are the OpenAI error envelope, written straight to the socket (they never reach the
app). The 408 and 429 are followed by a *lingering close* (nginx's ``lingering_close``): the write side is
shut (the client reads the answer, then end of file), what the client still sends is read and dropped, and the
socket is closed when the client closes or :data:`LINGER_S` later; meanwhile it counts under no cap. Closing
at once with unread input makes the kernel send a reset, which can destroy the answer before the client reads
it (a trickling client that wrote one more byte got ``ECONNRESET`` instead of its 408). The hot path pays two
timer operations per request (arm and cancel of a ``loop.call_later`` handle, as uvicorn's own keep-alive
timer does) and per connection two lookups of its address's record (``connection_made``; ``connection_lost``
deletes it with the last one) and an insert and delete in its header-phase set; the slow set is touched only
by sockets still sending headers after a second.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Callable
from typing import Any, ClassVar

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ethen.gateway.config import ServerConfig

__all__ = ["ClientAddress", "SlowClientProtocol", "client_key", "connection_share", "slow_client_protocol"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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


LINGER_S = 2.0  # how long a refused or timed-out socket is drained before it is closed


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


def connection_share(max_connections: int, per_client: int, active: int) -> int:
    """The most connections one address may hold while ``active`` addresses (it included) hold some: its
    ``per_client`` cap alone, else ``max_connections // (active + 1)`` (one share kept free for a newcomer),
    at most ``per_client`` and at least 1 (module docstring)."""
    if active <= 1:
        return per_client
    return max(1, min(per_client, max_connections // (active + 1)))


def _trusted(peer: Any, networks: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(peer[0].partition("%")[0])
    except (ValueError, TypeError, IndexError):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)


class ClientAddress:
    """One address's connections: how many are open, which are still sending their first request's headers
    (``pending``) and which have been sending headers for over ``slow_after_s`` (``slow``), oldest first."""

    __slots__ = ("open", "pending", "slow")

    def __init__(self) -> None:
        self.open = 0
        self.pending: dict[SlowClientProtocol, None] = {}
        self.slow: dict[SlowClientProtocol, None] = {}

    def victim(self) -> SlowClientProtocol | None:
        """The socket to close to make room: the oldest slow one, else the oldest still sending headers."""
        return next(iter(self.slow or self.pending), None)


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    """ASGI app answering a request beyond ``max_connections`` (uvicorn's own 503 is text/plain)."""
    await send({"type": "http.response.start", "status": 503, "headers": _OVERLOADED_HEADERS})
    await send({"type": "http.response.body", "body": _OVERLOADED_BODY})


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol with a header-read and a body-read deadline per request, and the
    per-address caps and fair share (module docstring)."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 60.0
    slow_after_s: ClassVar[float] = 1.0
    max_connections: ClassVar[int] = 1000
    max_connections_per_client: ClassVar[int] = 500
    max_pending_headers_per_client: ClassVar[int] = 32
    trusted_networks: ClassVar[tuple[Network, ...]] = ()  # [server] trusted_proxies: not counted per address
    clients: ClassVar[dict[str, ClientAddress]] = {}  # one table per server (slow_client_protocol)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._key: str | None = None  # the address this connection counts under (None: not counted)
        self._address: ClientAddress | None = None
        self._pending = False  # listed in _address.pending
        self._slow = False  # listed in _address.slow
        self._admitted = False
        self._lingering = False  # answered and half-closed: input is dropped until the peer closes

    def _arm(self, seconds: float, on_timeout: Callable[[], None]) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(seconds, on_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        key = client_key(peer)
        if key is not None and self.trusted_networks and _trusted(peer, self.trusted_networks):
            key = None  # a trusted reverse proxy: its clients are capped at the proxy
        if key is not None:
            clients = self.clients
            address = clients.get(key)
            active = len(clients) + (address is None)
            share = connection_share(self.max_connections, self.max_connections_per_client, active)
            if address is None:
                address = clients[key] = ClientAddress()
            elif address.open >= share:
                # make room with the address's oldest slow socket, else its oldest one still sending its
                # first headers; none: refused before uvicorn counts it (nothing taken from the global cap)
                victim = address.victim()
                if victim is None:
                    self._close_lingering(transport, _TOO_MANY)
                    return
                victim._evict()
                clients[key] = address  # back in, had the victim been its last connection
            if active > 1 and len(self.server_state.connections) + 1 > self.max_connections - share:
                self._reclaim(share, address)
            address.open += 1
            address.pending[self] = None
            self._key, self._address, self._pending = key, address, True
        self._admitted = True
        super().connection_made(transport)
        self._arm(self.slow_after_s, self._turned_slow)

    def _reclaim(self, share: int, mine: ClientAddress) -> None:
        """Less than one share left free: the address most above its share loses a header-phase socket."""
        worst: ClientAddress | None = None
        for address in self.clients.values():
            if (address.open > share and address is not mine and (address.slow or address.pending)
                    and (worst is None or address.open > worst.open)):
                worst = address
        victim = worst.victim() if worst is not None else None
        if victim is not None:
            victim._evict()

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)

    def _close_lingering(self, transport: asyncio.Transport, answer: bytes | None) -> None:
        """Write ``answer``, shut the write side and drop input until the peer closes (asyncio closes the
        transport at its end of file) or :data:`LINGER_S` later (module docstring)."""
        self._lingering = True
        if self._admitted:  # a closing socket holds no place under the caps (it is closed within LINGER_S)
            self._release()
            self._disarm()
            self.connections.discard(self)
        cycle = self.cycle if self._admitted else None
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() sees a disconnect, its sends are dropped
            cycle.message_event.set()
        if answer is not None:
            transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _closed(self) -> bool:
        return self._lingering or self.transport.is_closing()

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
        if address is not None and not self._closed():
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
        """Close this slow header-phase socket to make room (429 unless a response of an earlier request on
        it is still being written)."""
        self._release()
        self._disarm()
        if not self._closed():
            complete = self.cycle is None or self.cycle.response_complete
            self._close_lingering(self.transport, _TOO_MANY if complete else None)

    def _headers_too_slow(self) -> None:
        self._read_timer = None
        if not self._closed():
            self._close_lingering(self.transport, _HEADER_TIMEOUT)

    def _body_too_slow(self) -> None:
        self._read_timer = None
        if self._closed():
            return
        cycle = self.cycle
        answer = None
        if cycle is not None and not cycle.response_started:
            cycle.response_started = True  # nothing the app sends after this reaches the socket
            answer = _BODY_TIMEOUT
        self._close_lingering(self.transport, answer)


def slow_client_protocol(limits: ServerConfig) -> type[SlowClientProtocol]:
    """:class:`SlowClientProtocol` with ``limits``' timeouts, caps and trusted proxies, and a fresh
    per-address table (uvicorn makes one instance per connection)."""
    return type("SlowClientProtocol", (SlowClientProtocol,), {
        "header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s,
        "slow_after_s": min(1.0, limits.header_timeout_s / 2), "max_connections": limits.max_connections,
        "max_connections_per_client": limits.connections_per_client,
        "max_pending_headers_per_client": limits.max_pending_headers_per_client,
        "trusted_networks": limits.trusted_networks, "clients": {}})
