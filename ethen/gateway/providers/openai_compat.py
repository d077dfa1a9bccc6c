"""OpenAI-compatible provider: any ``base_url`` serving ``POST {base_url}/chat/completions`` (OpenAI,
DeepSeek, Groq, OpenRouter, vLLM, a llama.cpp server, Ollama's ``/v1``).

- Pooling and timeouts: :class:`~ethen.gateway.providers.http.HttpPool` (one pooled client per provider).
- Streams pass through: each upstream ``data:`` payload is handed on as the same bytes. Only chunks that carry
  a non-null ``usage`` or an ``error`` key are parsed. The gateway always asks the upstream for
  ``stream_options.include_usage`` (for telemetry); the usage-only chunk is held back and the executor puts
  the usage on its terminal chunk when the client asked for it.
- A stream counts as complete only when ``data: [DONE]`` arrives (every server listed above sends it); EOF
  without it is a cut (:class:`UpstreamStreamError`).
- Status mapping: 429 -> rate limited; 5xx and 408 -> server error; 401/403/404 -> rejected (operator-side,
  retried elsewhere); other 4xx -> bad request (request-caused, not retried, upstream message passed on).
  An upstream error message has the provider's credential masked (an upstream may echo it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ethen.gateway.errors import (
    UpstreamBadRequestError,
    UpstreamError,
    UpstreamInvalidResponseError,
    UpstreamRateLimitError,
    UpstreamRejectedError,
    UpstreamServerError,
    UpstreamStreamError,
    UpstreamTimeoutError,
)
from ethen.gateway.providers.base import Completion, Provider, ProviderStream, Timeouts, UpstreamCall, Usage
from ethen.gateway.providers.http import HttpPool, StreamingResponse
from ethen.gateway.sse import DONE_PAYLOAD, SSEEvent, dumps, iter_events

__all__ = ["OpenAICompatProvider", "error_for_status", "redact", "upstream_message"]

_MAX_ERROR_MESSAGE = 500


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


def _loads(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def open_stream(pool: HttpPool, path: str, body: bytes, secret: str | None) -> StreamingResponse:
    """POST and wait for the head; an error status is read and raised as ``UpstreamError``."""
    resp = await pool.stream(path, body)
    if resp.status >= 400:
        try:
            content = await resp.read()
        except UpstreamError:
            content = b""
        raise error_for_status(pool.provider, resp.status, content, secret)
    return resp


class _OpenAIStream(ProviderStream):
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

    async def __anext__(self) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                ev = await self._events.__anext__()
            except StopAsyncIteration:
                raise await self._fail(
                    UpstreamStreamError(
                        f"provider {self._provider!r} closed the stream before [DONE]", self._provider
                    )
                ) from None
            except UpstreamError as exc:
                raise await self._fail(exc) from None
            if loop.time() > self._deadline:
                raise await self._fail(
                    UpstreamTimeoutError(
                        f"provider {self._provider!r} timed out (total timeout)", self._provider
                    )
                )
            data = ev.data
            if data == DONE_PAYLOAD:
                self.completed = True
                await self.aclose()
                raise StopAsyncIteration
            if b'"error"' in data or ev.event == b"error":
                obj = _loads(data)
                if obj is None or isinstance(obj.get("error"), Mapping | str):
                    raise await self._fail(
                        UpstreamServerError(
                            f"provider {self._provider!r} sent an error in its stream: "
                            f"{upstream_message(redact(data, self._secret))}",
                            self._provider,
                        )
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
        self._pool = HttpPool(name, base_url, all_headers, self.timeouts, max_connections)

    async def complete(self, call: UpstreamCall) -> Completion:
        status, content = await self._pool.post("chat/completions", dumps(upstream_body(call, stream=False)))
        if status >= 400:
            raise error_for_status(self.name, status, content, self._secret)
        obj = _loads(content)
        if obj is None or not isinstance(obj.get("choices"), list):
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {status} without a chat completion", self.name
            )
        return Completion(obj, Usage.from_openai(obj.get("usage")))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        deadline = asyncio.get_running_loop().time() + self.timeouts.total
        body = dumps(upstream_body(call, stream=True))
        resp = await open_stream(self._pool, "chat/completions", body, self._secret)
        return _OpenAIStream(self.name, resp, deadline, self._secret)

    async def aclose(self) -> None:
        await self._pool.aclose()
