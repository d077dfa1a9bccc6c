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
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import (
    UpstreamError,
    UpstreamInvalidResponseError,
    UpstreamServerError,
)
from ethen.gateway.providers.base import Completion, ProviderStream, UpstreamCall
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


class _GeminiStream(SSEStream):
    end_marker = "a finishReason"

    def __init__(self, provider: str, response: StreamingResponse, deadline: float, model: str,
                 secret: str | None) -> None:
        super().__init__(provider, response, deadline, secret)
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
        usage = usage_of(obj.get("usageMetadata"))
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
                usage = usage_of(obj.get("usageMetadata"))
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

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"x-goog-api-key": api_key}

    def _path(self, model: str, method: str) -> str:
        return f"{self._version}models/{quote(model.removeprefix('models/'), safe='-._~')}:{method}"

    async def complete(self, call: UpstreamCall) -> Completion:
        body = dumps(to_gemini(call.body, call.upstream_model))
        status, content = await self._pool.post(self._path(call.upstream_model, "generateContent"), body)
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
        return Completion(from_gemini(obj, call.upstream_model), usage_of(obj.get("usageMetadata")))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        deadline = self.deadline()
        path = self._path(call.upstream_model, "streamGenerateContent") + "?alt=sse"
        body = dumps(to_gemini(call.body, call.upstream_model))
        resp = await open_stream(self._pool, path, body, self._secret)
        return _GeminiStream(self.name, resp, deadline, call.upstream_model, self._secret)
