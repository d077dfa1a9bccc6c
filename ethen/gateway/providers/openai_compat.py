"""OpenAI-compatible provider: any ``base_url`` serving ``POST {base_url}/chat/completions`` (OpenAI,
DeepSeek, Groq, OpenRouter, vLLM, a llama.cpp server, Ollama's ``/v1``).

- One shared ``httpx2.AsyncClient`` per provider (connection pool, keep-alive), created at start.
- Timeouts: ``connect`` is the client's connect (and pool) timeout; ``first_byte`` its read timeout, so it
  bounds the wait for the response head and every idle gap between two reads; ``total`` bounds a buffered call
  (``asyncio.timeout``) and is checked between stream chunks.
- Streams pass through: each upstream ``data:`` payload is handed on as the same bytes. Only chunks that carry
  a non-null ``usage`` or an ``error`` key are parsed. The gateway always asks the upstream for
  ``stream_options.include_usage`` (for telemetry); the usage-only chunk is held back and the executor puts
  the usage on its terminal chunk when the client asked for it.
- A stream counts as complete only when ``data: [DONE]`` arrives (every server listed above sends it); EOF
  without it is a cut (:class:`UpstreamStreamError`).
- Status mapping: 429 -> rate limited; 5xx and 408 -> server error; 401/403/404 -> rejected (operator-side,
  retried elsewhere); other 4xx -> bad request (request-caused, not retried, upstream message passed on).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2

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
from ethen.gateway.providers.base import (
    Completion,
    Provider,
    ProviderStream,
    Timeouts,
    UpstreamCall,
    Usage,
)
from ethen.gateway.sse import DONE_PAYLOAD, SSEEvent, dumps, iter_events

__all__ = ["OpenAICompatProvider", "error_for_status", "make_client", "map_transport_error", "redact"]

_MAX_ERROR_MESSAGE = 500


def make_client(
    base_url: str, timeouts: Timeouts, max_connections: int, headers: Mapping[str, str]
) -> httpx2.AsyncClient:
    """The provider's one pooled client."""
    return httpx2.AsyncClient(
        base_url=base_url,
        headers=dict(headers),
        timeout=httpx2.Timeout(
            connect=timeouts.connect,
            read=timeouts.first_byte,
            write=timeouts.first_byte,
            pool=timeouts.connect,
        ),
        limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        follow_redirects=False,
    )


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


def map_transport_error(provider: str, exc: BaseException, *, streaming: bool = False) -> UpstreamError:
    """Map an httpx2 / asyncio failure to the gateway's error tree (the one boundary for transport errors)."""
    if isinstance(exc, httpx2.TimeoutException | TimeoutError):
        phases: dict[type[BaseException], str] = {
            httpx2.ConnectTimeout: "connect",
            httpx2.PoolTimeout: "connection pool",
            httpx2.ReadTimeout: "first byte / read",
            httpx2.WriteTimeout: "write",
        }
        phase = phases.get(type(exc), "total")
        return UpstreamTimeoutError(f"provider {provider!r} timed out ({phase} timeout)", provider)
    if streaming:
        return UpstreamStreamError(f"provider {provider!r} stream broke: {type(exc).__name__}", provider)
    return UpstreamConnectionError(f"provider {provider!r} is unreachable: {type(exc).__name__}", provider)


def upstream_body(call: UpstreamCall, *, stream: bool) -> dict[str, Any]:
    body = dict(call.body)
    body["model"] = call.upstream_model
    if stream:
        body["stream"] = True
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, Mapping) else {}), "include_usage": True}
    else:
        body.pop("stream", None)
        body.pop("stream_options", None)
    return body


class _OpenAIStream(ProviderStream):
    def __init__(self, provider: str, response: httpx2.Response, deadline: float, secret: str | None) -> None:
        self._provider = provider
        self._secret = secret
        self._response = response
        self._deadline = deadline
        self._events: AsyncIterator[SSEEvent] = iter_events(response.aiter_bytes())
        self._closed = False
        self.usage = None
        self.completed = False
        self.receipt_extra = {}

    async def __anext__(self) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                ev = await self._events.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                raise UpstreamStreamError(
                    f"provider {self._provider!r} closed the stream before [DONE]", self._provider
                ) from None
            except (httpx2.HTTPError, OSError) as exc:
                await self.aclose()
                raise map_transport_error(self._provider, exc, streaming=True) from None
            if loop.time() > self._deadline:
                await self.aclose()
                raise UpstreamTimeoutError(
                    f"provider {self._provider!r} timed out (total timeout)", self._provider
                )
            data = ev.data
            if data == DONE_PAYLOAD:
                self.completed = True
                await self.aclose()
                raise StopAsyncIteration
            if b'"error"' in data or ev.event == b"error":
                obj = _loads(data)
                if obj is None or isinstance(obj.get("error"), Mapping | str):
                    await self.aclose()
                    raise UpstreamServerError(
                        f"provider {self._provider!r} sent an error in its stream: "
                        f"{upstream_message(redact(data, self._secret))}",
                        self._provider,
                    )
            if b'"usage"' in data and b'"usage":null' not in data and b'"usage": null' not in data:
                obj = _loads(data)
                if obj is not None:
                    usage = Usage.from_openai(obj.get("usage"))
                    if usage is not None:
                        self.usage = usage
                        if not obj.get("choices"):
                            continue  # usage-only chunk: held back
            return data

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._response.aclose()


def _loads(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class OpenAICompatProvider(Provider):
    """Calls ``{base_url}/chat/completions`` with ``Authorization: Bearer <api_key>`` when a key is set."""

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
        all_headers = {"content-type": "application/json", **(headers or {})}
        if api_key:
            all_headers["authorization"] = f"Bearer {api_key}"
        self._client = make_client(base_url.rstrip("/") + "/", self.timeouts, max_connections, all_headers)

    async def complete(self, call: UpstreamCall) -> Completion:
        content = dumps(upstream_body(call, stream=False))
        try:
            async with asyncio.timeout(self.timeouts.total):
                resp = await self._client.post("chat/completions", content=content)
        except (httpx2.HTTPError, OSError, TimeoutError) as exc:
            raise map_transport_error(self.name, exc) from None
        if resp.status_code >= 400:
            raise error_for_status(self.name, resp.status_code, resp.content, self._secret)
        obj = _loads(resp.content)
        if obj is None or not isinstance(obj.get("choices"), list):
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {resp.status_code} without a chat completion",
                self.name,
            )
        return Completion(obj, Usage.from_openai(obj.get("usage")))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.total
        request = self._client.build_request(
            "POST", "chat/completions", content=dumps(upstream_body(call, stream=True))
        )
        try:
            resp = await self._client.send(request, stream=True)
        except (httpx2.HTTPError, OSError) as exc:
            raise map_transport_error(self.name, exc) from None
        if resp.status_code >= 400:
            try:
                content = await resp.aread()
            except (httpx2.HTTPError, OSError):
                content = b""
            finally:
                await resp.aclose()
            raise error_for_status(self.name, resp.status_code, content, self._secret)
        return _OpenAIStream(self.name, resp, deadline, self._secret)

    async def aclose(self) -> None:
        await self._client.aclose()
