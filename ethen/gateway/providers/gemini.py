"""The native Gemini API provider (``kind = "gemini"``):
``POST {base_url}/v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``, the key
in ``x-goog-api-key``. The wire translation is :mod:`.gemini_wire`.

``base_url`` is the API host (``https://generativelanguage.googleapis.com``); one that already ends in a
version (``/v1beta``, ``/v1``) is used as is.

Streaming: each SSE ``data:`` event is a whole ``GenerateContentResponse`` (there is no ``[DONE]``). Its parts
become OpenAI chunks as they arrive (text -> ``content``, ``functionCall`` -> a complete ``tool_calls``
delta); the last ``usageMetadata`` seen is the usage. The answer is complete once a candidate carries a
``finishReason`` (the finish chunk is sent then) and the upstream closes; EOF before a ``finishReason`` is a
cut; an ``error`` object in the stream is an upstream server error; a blocked prompt is a content-filter
error.

Explicit context caching (issue 45, the split: :mod:`.gemini_cache`): a request carrying the client's
``cache_control`` breakpoints (chat in LiteLLM's form, or a Messages body's blocks; unless ``[prompt_cache]
auto_breakpoints = false``) has its prefix up to the last one put in a ``cachedContents`` resource (``POST
{base}/v1beta/cachedContents``, ``ttl`` the breakpoint's), created once per prefix and remembered until
shortly before its ``expireTime``; the request then names it in ``cachedContent`` and sends only the rest.
The creation's ``usageMetadata.totalTokenCount`` is reported as cache writes (added to the prompt tokens:
Gemini bills them as input). Caching never fails a request: a refused creation (a 4xx, e.g. a prefix under
the model's minimum) is not tried again for an hour, a failed one (5xx, timeout, unreachable) for a minute,
and the request goes as it came; a generate call answering that its cache is gone (a 400/403/404 naming the
cached content) drops it and goes as it came.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ethen.gateway.api.messages import chat_breakpoints
from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import (
    UpstreamError,
    UpstreamInvalidResponseError,
    UpstreamServerError,
)
from ethen.gateway.providers.anthropic_native import NativeBody
from ethen.gateway.providers.base import Completion, ProviderStream, UpstreamCall, Usage
from ethen.gateway.providers.gemini_cache import CacheNames, CacheSplit, expire_epoch, plan
from ethen.gateway.providers.gemini_wire import (
    blocked_error,
    call_of,
    finish_reason,
    from_gemini,
    to_gemini,
    usage_of,
)
from ethen.gateway.providers.http import (
    HttpProvider,
    SSEStream,
    StreamingResponse,
    error_for_status,
    open_stream,
    redact,
    upstream_message,
)

__all__ = ["GeminiProvider"]

log = logging.getLogger("ethen.gateway.providers.gemini")

#: how long a prefix whose cache Gemini refused (4xx) / failed to create (5xx, timeout) is not tried again
REFUSED_S = 3600.0
FAILED_S = 60.0


def _written(usage: Usage | None, tokens: int) -> Usage | None:
    """``usage`` with ``tokens`` written to a cache by this call (billed as input: added to the prompt)."""
    if usage is None or not tokens:
        return usage
    return Usage(usage.prompt_tokens + tokens, usage.completion_tokens, usage.cache_read_tokens,
                 usage.cache_write_tokens + tokens, usage.reasoning_tokens)


def _cache_gone(status: int, content: bytes) -> bool:
    """Whether a generate call naming a cache failed because of it (gone: expired or deleted, Gemini's 403
    "CachedContent not found (or permission denied)"; or refused with it): a 400/403/404 naming it."""
    return status in (400, 403, 404) and "cachedcontent" in upstream_message(content).lower().replace(" ", "")


class _GeminiStream(SSEStream):
    end_marker = "a finishReason"

    def __init__(self, provider: str, response: StreamingResponse, deadline: float, model: str,
                 secret: str | None, written: int = 0) -> None:
        super().__init__(provider, response, deadline, secret)
        self._written = written
        self._id = "chatcmpl-gemini"
        self._model = model
        self._created = int(time.time())
        self._pending: list[bytes] = []
        self._started = False
        self._calls = 0
        self._finished = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return dumps({
            "id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        })

    def _translate(self, obj: Mapping[str, Any]) -> None:
        if isinstance(obj.get("error"), Mapping | str):
            raise UpstreamServerError(
                f"provider {self._provider!r} sent an error in its stream: "
                f"{upstream_message(redact(dumps(obj), self._secret))}", self._provider)
        blocked = blocked_error(obj, self._provider)
        if blocked is not None:
            raise blocked
        usage = _written(usage_of(obj.get("usageMetadata")), self._written)
        if usage is not None:
            self.usage = usage
        if not self._started:
            self._id = str(obj.get("responseId") or self._id)
            self._model = str(obj.get("modelVersion") or self._model)
            self._started = True
            self._pending.append(self._chunk({"role": "assistant", "content": ""}))
        cands = obj.get("candidates")
        cand = cands[0] if isinstance(cands, list) and cands and isinstance(cands[0], Mapping) else {}
        content = cand.get("content")
        parts = content.get("parts") if isinstance(content, Mapping) else None
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, Mapping):
                continue
            call = call_of(part, self._calls)
            if call is not None:
                self._pending.append(self._chunk({"tool_calls": [{"index": self._calls, **call}]}))
                self._calls += 1
            elif isinstance(part.get("text"), str) and part["text"] and not part.get("thought"):
                self._pending.append(self._chunk({"content": part["text"]}))
        if cand.get("finishReason"):
            self._finished = True
            self._pending.append(self._chunk({}, finish_reason(cand["finishReason"], self._calls > 0)))

    async def __anext__(self) -> bytes:
        while True:
            if self._pending:
                return self._pending.pop(0)
            if self._finished:  # the answer is whole: read to EOF for a trailing usage, then stop
                try:
                    ev = await self._next_event()
                except UpstreamError:
                    ev = None
                if ev is None:
                    self.completed = True
                    await self.aclose()
                    raise StopAsyncIteration
            else:
                ev = await self._next_event()
            try:
                obj = json.loads(ev.data)
            except ValueError:
                await self.aclose()
                raise UpstreamInvalidResponseError(
                    f"provider {self._provider!r} sent a non-JSON stream event", self._provider) from None
            if not isinstance(obj, Mapping):
                continue
            if self._finished:
                usage = _written(usage_of(obj.get("usageMetadata")), self._written)
                self.usage = usage or self.usage
                continue
            try:
                self._translate(obj)
            except UpstreamError:
                await self.aclose()
                raise


class GeminiProvider(HttpProvider):
    """Calls the Gemini API's ``generateContent`` with ``x-goog-api-key``."""

    def __init__(self, name: str, base_url: str, api_key: str | None = None, **kw: Any) -> None:
        root = base_url.rstrip("/")
        self._version = "" if root.rsplit("/", 1)[-1] in ("v1", "v1beta", "v1alpha") else "v1beta/"
        super().__init__(name, root, api_key, **kw)
        self._caches = CacheNames()
        self._creating: dict[str, asyncio.Future[tuple[str | None, int]]] = {}

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"x-goog-api-key": api_key}

    def _path(self, model: str, method: str) -> str:
        return f"{self._version}models/{quote(model.removeprefix('models/'), safe='-._~')}:{method}"

    def _split(self, call: UpstreamCall, body: dict[str, Any]) -> CacheSplit | None:
        if not self.auto_breakpoints:
            return None
        # a Messages body's marks, on its blocks (read here: only a Gemini upstream needs them)
        marks = chat_breakpoints(call.body.messages) if isinstance(call.body, NativeBody) else None
        return plan(call.body, body, call.upstream_model, marks)

    async def _cache(self, split: CacheSplit, model: str) -> tuple[str | None, int]:
        """The cache holding ``split``'s prefix (created now if needed) and the tokens written creating it
        here; ``(None, 0)`` when there is none to use."""
        known = self._caches.lookup(split.key, time.time())
        if known is not None:
            return known[0], 0
        pending = self._creating.get(split.key)
        if pending is not None:  # another request is creating it: use it, the write is that request's
            return (await asyncio.shield(pending))[0], 0
        fut: asyncio.Future[tuple[str | None, int]] = asyncio.get_running_loop().create_future()
        self._creating[split.key] = fut
        out: tuple[str | None, int] = (None, 0)
        try:
            out = await self._create(split, model)
        finally:
            del self._creating[split.key]
            fut.set_result(out)
        return out

    async def _create(self, split: CacheSplit, model: str) -> tuple[str | None, int]:
        body = {"model": f"models/{model.removeprefix('models/')}", **split.cached, "ttl": f"{split.ttl_s}s"}
        try:
            status, content = await self._pool.post(f"{self._version}cachedContents", dumps(body))
        except UpstreamError as exc:
            log.warning("provider %r: creating a context cache failed (%s); requests go uncached for %.0f s",
                        self.name, exc, FAILED_S)
            self._caches.refuse(split.key, time.time() + FAILED_S)
            return None, 0
        now = time.time()
        try:
            obj = json.loads(content) if status < 400 else None
        except ValueError:
            obj = None
        name = obj.get("name") if isinstance(obj, Mapping) else None
        if not isinstance(obj, Mapping) or not isinstance(name, str) or not name:
            refused = 400 <= status < 500 and status not in (408, 429)
            wait = REFUSED_S if refused else FAILED_S
            log.log(logging.INFO if refused else logging.WARNING,
                    "provider %r: context cache not created (HTTP %d: %s); prefix uncached for %.0f s",
                    self.name, status, upstream_message(redact(content, self._secret)), wait)
            self._caches.refuse(split.key, now + wait)
            return None, 0
        self._caches.hold(split.key, name, expire_epoch(obj.get("expireTime"), now + split.ttl_s), now)
        meta = obj.get("usageMetadata")
        tokens = meta.get("totalTokenCount") if isinstance(meta, Mapping) else None
        return name, tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0

    def _gone(self, split: CacheSplit, name: str, status: int) -> None:
        log.info("provider %r: context cache %s is gone (HTTP %d); the request goes uncached",
                 self.name, name, status)
        self._caches.drop(split.key)

    def _completion(self, status: int, content: bytes, model: str, written: int) -> Completion:
        if status >= 400:
            raise error_for_status(self.name, status, content, self._secret)
        try:
            obj = json.loads(content)
        except ValueError:
            obj = None
        if not isinstance(obj, Mapping):
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {status} without a GenerateContentResponse", self.name)
        blocked = blocked_error(obj, self.name)
        if blocked is not None:
            raise blocked
        if not isinstance(obj.get("candidates"), list) or not obj["candidates"]:
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered HTTP {status} without a candidate", self.name)
        out = from_gemini(obj, model)
        usage = _written(usage_of(obj.get("usageMetadata")), written)
        if usage is not None and written:
            out["usage"] = usage.to_openai()
        return Completion(out, usage)

    async def complete(self, call: UpstreamCall) -> Completion:
        model = call.upstream_model
        body = to_gemini(call.body, model)
        path = self._path(model, "generateContent")
        split = self._split(call, body)
        written = 0  # tokens this call wrote to a new cache (billed even if the cache is lost right away)
        if split is not None:
            name, written = await self._cache(split, model)
            if name is not None:
                status, content = await self._pool.post(path, dumps({**split.rest, "cachedContent": name}))
                if status < 400 or not _cache_gone(status, content):
                    return self._completion(status, content, model, written)
                self._gone(split, name, status)
        status, content = await self._pool.post(path, dumps(body))
        return self._completion(status, content, model, written)

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        deadline = self.deadline()
        model = call.upstream_model
        path = self._path(model, "streamGenerateContent") + "?alt=sse"
        body = to_gemini(call.body, model)
        split = self._split(call, body)
        written = 0
        if split is not None:
            name, written = await self._cache(split, model)
            if name is not None:
                resp = await self._pool.stream(path, dumps({**split.rest, "cachedContent": name}))
                if resp.status < 400:
                    return _GeminiStream(self.name, resp, deadline, model, self._secret, written)
                try:
                    content = await resp.read()
                except UpstreamError:
                    content = b""
                if not _cache_gone(resp.status, content):
                    raise error_for_status(self.name, resp.status, content, self._secret)
                self._gone(split, name, resp.status)
        resp = await open_stream(self._pool, path, dumps(body), self._secret)
        return _GeminiStream(self.name, resp, deadline, model, self._secret, written)
