"""The HTTP transport shared by the HTTP providers: one pooled client per provider, timeouts, and the one
boundary where transport exceptions become :class:`~ethen.gateway.errors.UpstreamError`.

Client library: ``aiohttp``. Choice (the issue names no library): in a micro-benchmark on this machine
(2,000 buffered calls at concurrency 20 to the scripted upstream) ``aiohttp`` cost ~0.1 ms CPU per call
against ~0.5 ms for ``httpx2`` and more for ``httpx`` 0.28 (whose pool assignment is quadratic in the number
of connections); the upstream call is most of the gateway's CPU per request, so this is what keeps the
overhead low at hundreds of requests per second on two cores.

- One ``aiohttp.ClientSession`` per provider, created lazily inside the serving event loop (a session is
  bound to its loop) and closed at shutdown. Its connector keeps up to ``max_connections`` keep-alive
  connections to the upstream.
- Timeouts: ``connect`` bounds getting a pooled or new connection; ``first_byte`` is the socket read timeout,
  so it bounds the wait for the response head and every idle gap between two reads of a stream; ``total``
  bounds a buffered call (``asyncio.timeout``) and is checked between stream chunks.
- Streams are read with ``iter_any()``: bytes are handed on as they arrive, never buffered whole.

What every HTTP provider shares also lives here, so a provider module holds only its wire format:
:class:`HttpProvider` (the pooled client, the credential header, ``aclose``), :class:`SSEStream` (a stream
read as server-sent events: total deadline, end-of-stream check, close-once), and the status mapping
:func:`error_for_status` (429 -> rate limited; 5xx and 408 -> server error; 401/403/404 -> rejected,
operator-side, retried elsewhere; other 4xx -> bad request, request-caused, not retried, upstream message
passed on). An upstream error message has the provider's credential masked (an upstream may echo it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp

from ethen.gateway.api.sse import SSEEvent, iter_events
from ethen.gateway.errors import (
    UpstreamBadRequestError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamInvalidResponseError,
    UpstreamRateLimitError,
    UpstreamRejectedError,
    UpstreamServerError,
    UpstreamStreamError,
    UpstreamTimeoutError,
)
from ethen.gateway.providers.base import Provider, ProviderStream, Timeouts
from ethen.gateway.providers.ratelimit import IDLE, REMAINING_HEADERS, blocked_for_s, cloud_capacity
from ethen.gateway.routing.capacity import ProviderCapacity

__all__ = [
    "HttpPool",
    "HttpProvider",
    "SSEStream",
    "StreamingResponse",
    "error_for_status",
    "map_transport_error",
    "open_stream",
    "redact",
    "upstream_message",
]

_MAX_ERROR_MESSAGE = 500

TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


def map_transport_error(provider: str, exc: BaseException, *, streaming: bool = False) -> UpstreamError:
    """Map an aiohttp / asyncio / OS failure to the gateway's error tree."""
    if isinstance(exc, TimeoutError):  # aiohttp's timeout errors subclass it
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            phase = "connect"
        elif isinstance(exc, aiohttp.SocketTimeoutError):
            phase = "first byte / read"
        else:
            phase = "total"
        return UpstreamTimeoutError(f"provider {provider!r} timed out ({phase} timeout)", provider)
    if streaming:
        return UpstreamStreamError(f"provider {provider!r} stream broke: {type(exc).__name__}", provider)
    return UpstreamConnectionError(f"provider {provider!r} is unreachable: {type(exc).__name__}", provider)


class StreamingResponse:
    """An upstream response whose body is read incrementally."""

    def __init__(self, provider: str, response: aiohttp.ClientResponse,
                 on_close: Callable[[], None] | None = None) -> None:
        self.provider = provider
        self.status = response.status
        self._response = response
        self._closed = False
        self._on_close = on_close

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        finally:
            await self.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; transport errors are raised as ``UpstreamError``."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TRANSPORT_ERRORS as exc:
            raise map_transport_error(self.provider, exc, streaming=True) from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()
            # A fully read body returns the connection to the pool; otherwise it is dropped.
            if self._response.content.at_eof():
                self._response.release()
            else:
                self._response.close()


class HttpPool:
    """One provider's pooled HTTP client."""

    def __init__(
        self,
        provider: str,
        base_url: str,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        max_connections: int,
    ) -> None:
        self.provider = provider
        self.base_url = base_url.rstrip("/") + "/"
        self.headers = dict(headers)
        self.timeouts = timeouts
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # issue 44 (.ratelimit): calls in flight, their measured duration, a rate-limit block
        self.in_flight = 0
        self.call_ms: float | None = None
        self.blocked_until: float | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect, sock_connect=timeouts.connect, sock_read=timeouts.first_byte
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=self.max_connections
                ),
                headers=self.headers,
                timeout=self._timeout,
                auto_decompress=True,
            )
        return self._session

    def _note(self, resp: aiohttp.ClientResponse) -> None:
        """Read an answer's rate-limit headers (:func:`~.ratelimit.blocked_for_s`)."""
        status, headers = resp.status, resp.headers
        if status not in (429, 503) and not any(h in headers for h in REMAINING_HEADERS):
            if status < 400:  # nothing blocks (blocked_for_s would say None): no copy of the headers
                self.blocked_until = None
            return
        wait = blocked_for_s(status, {k.lower(): v for k, v in headers.items()}, time.time())
        if wait is not None:
            self.blocked_until = time.monotonic() + wait
        elif resp.status < 400:
            self.blocked_until = None

    def _done(self, started: float) -> None:
        self.in_flight -= 1
        ms = (time.monotonic() - started) * 1000.0
        self.call_ms = ms if self.call_ms is None else self.call_ms + 0.2 * (ms - self.call_ms)

    def capacity(self) -> ProviderCapacity:
        if self.blocked_until is None and self.in_flight < max(1, self.max_connections):
            return IDLE  # what cloud_capacity gives without a block or a queue, without reading the clock
        return cloud_capacity(time.monotonic(), self.blocked_until, self.in_flight, self.max_connections,
                              self.call_ms)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None
                   ) -> tuple[int, bytes]:
        """A buffered POST: (status, body). Bounded by the total timeout. ``headers``: the call's own."""
        started = time.monotonic()
        self.in_flight += 1
        try:
            async with (
                asyncio.timeout(self.timeouts.total),
                self._client().post(self.base_url + path, data=body, headers=headers) as resp,
            ):
                self._note(resp)
                return resp.status, await resp.read()
        except TRANSPORT_ERRORS as exc:
            raise map_transport_error(self.provider, exc) from None
        finally:
            self._done(started)

    async def stream(self, path: str, body: bytes, headers: Mapping[str, str] | None = None
                     ) -> StreamingResponse:
        """A POST whose body is read incrementally; returns once the response head arrived."""
        started = time.monotonic()
        self.in_flight += 1
        try:
            resp = await self._client().post(self.base_url + path, data=body, headers=headers)
        except TRANSPORT_ERRORS as exc:
            self._done(started)
            raise map_transport_error(self.provider, exc) from None
        except BaseException:
            self._done(started)
            raise
        self._note(resp)
        return StreamingResponse(self.provider, resp, lambda: self._done(started))

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def upstream_message(content: bytes) -> str:
    """The ``error.message`` of an upstream error body, or a short prefix of the raw body."""
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    if isinstance(obj, Mapping):
        err = obj.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return str(err["message"])[:_MAX_ERROR_MESSAGE]
        if isinstance(err, str):
            return err[:_MAX_ERROR_MESSAGE]
        if isinstance(obj.get("message"), str):
            return str(obj["message"])[:_MAX_ERROR_MESSAGE]
    return content[:200].decode("utf-8", "replace")


def redact(content: bytes, secret: str | None) -> bytes:
    """``content`` with the provider's credential masked (an upstream may echo it in an error message)."""
    return content.replace(secret.encode(), b"[redacted]") if secret else content


def error_for_status(provider: str, status: int, content: bytes, secret: str | None = None) -> UpstreamError:
    """Map an upstream HTTP error status to the gateway's error tree (``secret`` is masked in messages)."""
    detail = upstream_message(redact(content, secret))
    msg = f"provider {provider!r} answered HTTP {status}: {detail}"
    if status == 429:
        return UpstreamRateLimitError(msg, provider, status)
    if status >= 500 or status == 408:
        return UpstreamServerError(msg, provider, status)
    if status in (401, 403, 404):
        return UpstreamRejectedError(msg, provider, status)
    if 400 <= status < 500:
        return UpstreamBadRequestError(f"upstream rejected the request: {detail}", provider, status)
    return UpstreamInvalidResponseError(msg, provider, status)


async def open_stream(pool: HttpPool, path: str, body: bytes, secret: str | None,
                      headers: Mapping[str, str] | None = None) -> StreamingResponse:
    """POST and wait for the head; an error status is read and raised as ``UpstreamError``."""
    resp = await pool.stream(path, body, headers)
    if resp.status >= 400:
        try:
            content = await resp.read()
        except UpstreamError:
            content = b""
        raise error_for_status(pool.provider, resp.status, content, secret)
    return resp


class SSEStream(ProviderStream):
    """A provider stream read as server-sent events. Subclasses implement ``__anext__`` with
    :meth:`_next_event` and name the event that ends a proper answer in ``end_marker``."""

    end_marker = "its end marker"

    def __init__(
        self, provider: str, response: StreamingResponse, deadline: float, secret: str | None
    ) -> None:
        self._provider = provider
        self._secret = secret
        self._response = response
        self._deadline = deadline
        self._events: AsyncIterator[SSEEvent] = iter_events(response.chunks())
        self._closed = False
        self.usage = None
        self.completed = False
        self.receipt_extra = {}

    async def _fail(self, err: UpstreamError) -> UpstreamError:
        await self.aclose()
        return err

    async def _next_event(self) -> SSEEvent:
        """The next event. ``StopAsyncIteration`` once closed; ``UpstreamError`` (the stream closed first)
        when the transport breaks, the upstream ends before ``end_marker``, or the total deadline passed."""
        if self._closed:
            raise StopAsyncIteration
        try:
            ev = await self._events.__anext__()
        except StopAsyncIteration:
            raise await self._fail(
                UpstreamStreamError(
                    f"provider {self._provider!r} closed the stream before {self.end_marker}", self._provider
                )
            ) from None
        except UpstreamError as exc:
            raise await self._fail(exc) from None
        if asyncio.get_running_loop().time() > self._deadline:
            raise await self._fail(
                UpstreamTimeoutError(f"provider {self._provider!r} timed out (total timeout)", self._provider)
            )
        return ev

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._response.aclose()


class HttpProvider(Provider):
    """A provider reached over HTTP: one :class:`HttpPool` with the provider's headers and credential.
    ``auto_breakpoints``: ``[prompt_cache] auto_breakpoints`` (set by ``build_providers``): whether the
    provider adds prompt-cache hints a request lacks (:mod:`ethen.gateway.providers.prompt_cache`)."""

    auto_breakpoints: bool = True

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None = None,
        *,
        timeouts: Timeouts | None = None,
        max_connections: int = 100,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.timeouts = timeouts or Timeouts()
        self._secret = api_key
        all_headers = {"content-type": "application/json", **self.base_headers(), **(headers or {})}
        if api_key:
            all_headers.update(self.credential_headers(api_key))
        self._pool = HttpPool(name, base_url, all_headers, self.timeouts, max_connections)

    def base_headers(self) -> dict[str, str]:
        """Headers every call carries (the operator's ``headers`` may override them)."""
        return {}

    def credential_headers(self, api_key: str) -> dict[str, str]:
        """How the credential travels (set last: never overridden by configured headers)."""
        return {"authorization": f"Bearer {api_key}"}

    def capacity(self) -> ProviderCapacity:
        """Issue 44: the rate-limit block and the queue for a connection (:mod:`.ratelimit`)."""
        return self._pool.capacity()

    def deadline(self) -> float:
        """The loop time by which a stream started now must have ended (the total timeout)."""
        return asyncio.get_running_loop().time() + self.timeouts.total

    async def aclose(self) -> None:
        await self._pool.aclose()
