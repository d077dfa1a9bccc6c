"""OpenAI-compatible provider: any ``base_url`` serving ``POST {base_url}/chat/completions`` (OpenAI,
DeepSeek, Groq, OpenRouter, vLLM, a llama.cpp server, Ollama's ``/v1``).

- Pooling and timeouts: :class:`~ethen.gateway.providers.http.HttpPool` (one pooled client per provider).
- Streams pass through: each upstream ``data:`` payload is handed on as the same bytes. Only chunks that carry
  a non-null ``usage`` or an ``error`` key are parsed. The gateway always asks the upstream for
  ``stream_options.include_usage`` (for telemetry); the usage-only chunk is held back and the executor puts
  the usage on its terminal chunk when the client asked for it.
- A stream counts as complete only when ``data: [DONE]`` arrives (every server listed above sends it); EOF
  without it is a cut (:class:`UpstreamStreamError`).
- Prompt caching: a call without ``prompt_cache_key`` gets the conversation's (a hash of its tools and
  leading messages, the same every turn) unless ``[prompt_cache] auto_breakpoints = false``.
- Status mapping and credential masking: :func:`~ethen.gateway.providers.http.error_for_status`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ethen.gateway.api.sse import DONE_PAYLOAD, dumps
from ethen.gateway.errors import UpstreamError, UpstreamInvalidResponseError, UpstreamServerError
from ethen.gateway.providers.base import Completion, Embeddings, ProviderStream, UpstreamCall, Usage
from ethen.gateway.providers.http import (
    HttpProvider,
    SSEStream,
    error_for_status,
    redact,
    upstream_message,
)
from ethen.gateway.providers.prompt_cache import conversation_key

__all__ = ["OpenAICompatProvider", "error_for_status", "redact", "upstream_message"]

def upstream_body(call: UpstreamCall, *, stream: bool, cache_key: bool = False) -> dict[str, Any]:
    """The body sent upstream; ``cache_key``: add the conversation's ``prompt_cache_key`` when the client set
    none (:func:`~ethen.gateway.providers.prompt_cache.conversation_key`)."""
    body = dict(call.body)
    body["model"] = call.upstream_model
    if cache_key and body.get("prompt_cache_key") is None:
        key = conversation_key(body)
        if key is not None:
            body["prompt_cache_key"] = key
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


class _OpenAIStream(SSEStream):
    end_marker = "[DONE]"

    async def __anext__(self) -> bytes:
        while True:
            ev = await self._next_event()
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


class OpenAICompatProvider(HttpProvider):
    """Calls ``{base_url}/chat/completions`` with ``Authorization: Bearer <api_key>`` when a key is set.
    Subclasses with another URL scheme or error dialect (Azure) override :meth:`chat_path`,
    :meth:`embeddings_path` / :meth:`error`."""

    #: whether the upstream takes OpenAI's ``prompt_cache_key`` (Azure's API versions do not all take it)
    takes_prompt_cache_key = True

    def cache_key(self) -> bool:
        """Whether a call gets the conversation's ``prompt_cache_key`` when the client set none."""
        return self.auto_breakpoints and self.takes_prompt_cache_key

    def chat_path(self, upstream_model: str) -> str:
        """The chat-completions path under ``base_url`` for that model."""
        return "chat/completions"

    def embeddings_path(self, upstream_model: str) -> str:
        """The embeddings path under ``base_url`` for that model."""
        return "embeddings"

    def error(self, status: int, content: bytes) -> UpstreamError:
        """The gateway error for an upstream error answer."""
        return error_for_status(self.name, status, content, self._secret)

    async def complete(self, call: UpstreamCall) -> Completion:
        payload = dumps(upstream_body(call, stream=False, cache_key=self.cache_key()))
        status, content = await self._pool.post(self.chat_path(call.upstream_model), payload)
        if status >= 400:
            raise self.error(status, content)
        obj = _loads(content)
        if obj is None or not isinstance(obj.get("choices"), list):
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {status} without a chat completion", self.name
            )
        return Completion(obj, Usage.from_openai(obj.get("usage")))

    supports_embeddings = True

    async def embed(self, call: UpstreamCall) -> Embeddings:
        """``POST {base_url}/embeddings`` with the body as the client sent it (model replaced)."""
        body = {**call.body, "model": call.upstream_model}
        status, content = await self._pool.post(self.embeddings_path(call.upstream_model), dumps(body))
        if status >= 400:
            raise self.error(status, content)
        obj = _loads(content)
        if obj is None or not isinstance(obj.get("data"), list):
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {status} without an embeddings list", self.name
            )
        usage = obj.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        return Embeddings(obj, Usage.of(prompt, 0))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        deadline = self.deadline()
        body = dumps(upstream_body(call, stream=True, cache_key=self.cache_key()))
        resp = await self._pool.stream(self.chat_path(call.upstream_model), body)
        if resp.status >= 400:
            try:
                content = await resp.read()
            except UpstreamError:
                content = b""
            raise self.error(resp.status, content)
        return _OpenAIStream(self.name, resp, deadline, self._secret)
