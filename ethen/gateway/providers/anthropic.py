"""Anthropic Messages API provider: translates OpenAI chat completions to ``POST {base_url}/messages``
and back.

Request translation (OpenAI -> Anthropic):
- ``system`` / ``developer`` messages -> top-level ``system`` (text parts joined with blank lines);
- user/assistant text and content parts -> content blocks; ``image_url`` parts -> ``image`` blocks (a
  ``data:`` URL becomes a ``base64`` source, any other URL a ``url`` source);
- assistant ``tool_calls`` -> ``tool_use`` blocks (arguments parsed as JSON; unparsable arguments are kept
  under ``{"_raw": ...}``); ``tool`` messages -> ``tool_result`` blocks in a user turn;
- consecutive turns of the same role are merged (Anthropic requires alternating roles);
- ``tools`` -> ``{name, description, input_schema}``; ``tool_choice`` auto/required/none/named ->
  ``auto``/``any``/``none``/``tool``; ``parallel_tool_calls: false`` -> ``disable_parallel_tool_use``;
- ``max_completion_tokens`` / ``max_tokens`` -> ``max_tokens`` (required by Anthropic; default
  :data:`DEFAULT_MAX_TOKENS` when the client sets neither); ``temperature``, ``top_p``, ``stop`` ->
  ``stop_sequences``, ``user`` -> ``metadata.user_id``.
- ``cache_control`` (the client's breakpoints, ``ttl`` included) on a text/image part, a tool, or a message
  (on its last block) is kept; a request with none gets breakpoints placed
  (:func:`~ethen.gateway.providers.prompt_cache.place_breakpoints`) unless ``[prompt_cache]
  auto_breakpoints = false``.
- Not translated (no Messages equivalent): ``response_format``, ``n`` > 1, ``logprobs``, ``seed``,
  ``presence_penalty`` / ``frequency_penalty``; they are dropped. Operators who route structured-output
  requests here should not mark the route ``supports_structured_output``.

Response translation: text blocks -> ``message.content``, ``tool_use`` -> ``tool_calls`` (input re-serialized
as JSON), ``stop_reason`` end_turn/stop_sequence -> ``stop``, max_tokens -> ``length``, tool_use ->
``tool_calls``, refusal -> ``content_filter``; usage ``input_tokens`` (+ cache read/creation tokens) ->
``prompt_tokens`` (reads/creations in ``prompt_tokens_details`` ``cached_tokens`` / ``cache_write_tokens``),
``output_tokens`` -> ``completion_tokens``.

Streaming: Anthropic events become OpenAI chunks as they arrive (message_start -> role chunk, text_delta ->
content, tool_use start / input_json_delta -> ``tool_calls`` deltas, message_delta -> finish_reason, usage
recorded). The stream is complete at ``message_stop``; EOF before it is a cut; an ``error`` event is an
upstream server error. Pooling and timeouts: :class:`~ethen.gateway.providers.http.HttpPool`; status
mapping: that of the OpenAI-compatible provider.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import (
    UpstreamError,
    UpstreamInvalidResponseError,
    UpstreamServerError,
)
from ethen.gateway.providers.base import Completion, ProviderStream, UpstreamCall, Usage
from ethen.gateway.providers.http import (
    HttpProvider,
    SSEStream,
    StreamingResponse,
    error_for_status,
    open_stream,
    redact,
    upstream_message,
)
from ethen.gateway.providers.prompt_cache import place_breakpoints

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "AnthropicProvider",
    "from_anthropic",
    "to_anthropic",
]

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
_STOP = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


def _image_block(part: Mapping[str, Any]) -> dict[str, Any]:
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, Mapping) else iu if isinstance(iu, str) else part.get("url")
    url = str(url or "")
    if url.startswith("data:") and ";base64," in url:
        head, data = url[5:].split(";base64,", 1)
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": head or "image/png", "data": data},
        }
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for part in content if isinstance(content, Sequence) else ():
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            out.append(_marked({"type": "text", "text": str(part.get("text", ""))}, part))
        elif kind in ("image_url", "input_image"):
            out.append(_marked(_image_block(part), part))
    return out


def _marked(block: dict[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """``block`` with the client's ``cache_control`` breakpoint of ``source`` (as sent: its ``ttl`` too)."""
    if isinstance(source.get("cache_control"), Mapping):
        block["cache_control"] = dict(source["cache_control"])
    return block


def _mark_last(blocks: list[dict[str, Any]], msg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A message-level ``cache_control`` (LiteLLM's form) on the message's last block."""
    if blocks and isinstance(msg.get("cache_control"), Mapping) and "cache_control" not in blocks[-1]:
        blocks[-1] = _marked(blocks[-1], msg)
    return blocks


def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    args = fn.get("arguments") if isinstance(fn, Mapping) else None
    try:
        parsed = json.loads(args) if isinstance(args, str) and args else {}
    except ValueError:
        parsed = {"_raw": args}
    if not isinstance(parsed, dict):
        parsed = {"_value": parsed}
    return {
        "type": "tool_use",
        "id": str(call.get("id", "")),
        "name": str(fn.get("name", "")) if isinstance(fn, Mapping) else "",
        "input": parsed,
    }


def to_anthropic(body: Mapping[str, Any], model: str, *, stream: bool) -> dict[str, Any]:
    """An OpenAI chat-completions body as an Anthropic Messages body."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for msg in body.get("messages") or ():
        if not isinstance(msg, Mapping):
            continue
        role = msg.get("role")
        if role in ("system", "developer"):
            content = msg.get("content")
            parts = [b for b in _blocks(content) if b["type"] == "text"] if isinstance(content, list) else []
            if any("cache_control" in b for b in parts):
                system.extend(parts)  # the client's breakpoints: kept on their blocks
            elif text := _text_of(content):
                system.append(_mark_last([{"type": "text", "text": text}], msg)[0])
        elif role == "user":
            add("user", _mark_last(_blocks(msg.get("content")), msg))
        elif role == "assistant":
            blocks = _blocks(msg.get("content"))
            for call in msg.get("tool_calls") or ():
                if isinstance(call, Mapping):
                    blocks.append(_tool_use(call))
            add("assistant", _mark_last(blocks, msg))
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": str(msg.get("tool_call_id", "")),
                      "content": _text_of(msg.get("content"))}
            add("user", _mark_last([result], msg))
    out: dict[str, Any] = {"model": model, "messages": turns}
    if any("cache_control" in b for b in system):
        out["system"] = system
    elif system:
        out["system"] = "\n\n".join(b["text"] for b in system)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    out["max_tokens"] = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p"):
        if isinstance(body.get(key), int | float):
            out[key] = body[key]
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list):
        out["stop_sequences"] = [s for s in stop if isinstance(s, str)]
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        out["tools"] = []
        for t in tools:
            fn = t.get("function") if isinstance(t, Mapping) else None
            if isinstance(fn, Mapping):
                tool: dict[str, Any] = {
                    "name": str(fn.get("name", "")),
                    "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
                }
                if fn.get("description"):
                    tool["description"] = str(fn["description"])
                out["tools"].append(_marked(tool, t))
        choice = body.get("tool_choice")
        tc: dict[str, Any] | None = None
        if choice == "auto":
            tc = {"type": "auto"}
        elif choice == "required":
            tc = {"type": "any"}
        elif choice == "none":
            tc = {"type": "none"}
        elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
            tc = {"type": "tool", "name": str(choice["function"].get("name", ""))}
        if body.get("parallel_tool_calls") is False:
            tc = {**(tc or {"type": "auto"}), "disable_parallel_tool_use": True}
        if tc is not None:
            out["tool_choice"] = tc
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if stream:
        out["stream"] = True
    return out


def _usage(obj: Any) -> Usage | None:
    if not isinstance(obj, Mapping):
        return None
    inp = obj.get("input_tokens")
    out = obj.get("output_tokens")
    if not isinstance(inp, int) or not isinstance(out, int):
        return None
    cached = {k: obj[k] if isinstance(obj.get(k), int) and obj[k] > 0 else 0
              for k in ("cache_creation_input_tokens", "cache_read_input_tokens")}
    base = Usage.of(inp + sum(cached.values()), out)
    if base is None or not any(cached.values()):
        return base
    return Usage(base.prompt_tokens, out, cache_read_tokens=cached["cache_read_input_tokens"],
                 cache_write_tokens=cached["cache_creation_input_tokens"])


def from_anthropic(msg: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic Messages response as an OpenAI ``chat.completion``."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg.get("content") or ():
        if not isinstance(block, Mapping):
            continue
        if block.get("type") == "text":
            text.append(str(block.get("text", "")))
        elif block.get("type") == "tool_use":
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input", {})),
                    },
                }
            )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(text) if text or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    out: dict[str, Any] = {
        "id": str(msg.get("id", "chatcmpl-anthropic")),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(msg.get("model", model)),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _STOP.get(str(msg.get("stop_reason")), "stop"),
                "logprobs": None,
            }
        ],
    }
    usage = _usage(msg.get("usage"))
    if usage is not None:
        out["usage"] = usage.to_openai()
    return out


def _obj(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


class _AnthropicStream(SSEStream):
    end_marker = "message_stop"

    def __init__(
        self, provider: str, response: StreamingResponse, deadline: float, model: str, secret: str | None
    ) -> None:
        super().__init__(provider, response, deadline, secret)
        self._id = "chatcmpl-anthropic"
        self._model = model
        self._created = int(time.time())
        self._input = Usage(0, 0)
        self._tool_index: dict[int, int] = {}  # Anthropic block index -> OpenAI tool_calls index

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return dumps(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
        )

    def _translate(self, ev: Mapping[str, Any]) -> bytes | None:
        kind = ev.get("type")
        if kind == "message_start":
            msg = _obj(ev, "message")
            self._id = str(msg.get("id", self._id))
            self._model = str(msg.get("model", self._model))
            u = _obj(msg, "usage")
            self._input = _usage({**u, "output_tokens": 0}) or Usage(0, 0)
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "content_block_start":
            block = _obj(ev, "content_block")
            if block.get("type") == "tool_use":
                idx = self._tool_index.setdefault(int(ev.get("index", 0)), len(self._tool_index))
                call = {
                    "index": idx,
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {"name": str(block.get("name", "")), "arguments": ""},
                }
                return self._chunk({"tool_calls": [call]})
            return None
        if kind == "content_block_delta":
            delta = _obj(ev, "delta")
            if delta.get("type") == "text_delta":
                return self._chunk({"content": str(delta.get("text", ""))})
            if delta.get("type") == "input_json_delta":
                idx = self._tool_index.get(int(ev.get("index", 0)), 0)
                part = str(delta.get("partial_json", ""))
                return self._chunk({"tool_calls": [{"index": idx, "function": {"arguments": part}}]})
            return None
        if kind == "message_delta":
            delta = _obj(ev, "delta")
            out_tokens = _obj(ev, "usage").get("output_tokens")
            if isinstance(out_tokens, int):
                self.usage = replace(self._input, completion_tokens=out_tokens)
            stop = delta.get("stop_reason")
            if stop is not None:
                return self._chunk({}, _STOP.get(str(stop), "stop"))
            return None
        if kind == "error":
            raise UpstreamServerError(
                f"provider {self._provider!r} sent an error in its stream: "
                f"{upstream_message(redact(dumps(ev), self._secret))}",
                self._provider,
            )
        return None  # ping, content_block_stop, thinking deltas

    async def __anext__(self) -> bytes:
        while True:
            ev = await self._next_event()
            try:
                obj = json.loads(ev.data)
            except ValueError:
                await self.aclose()
                raise UpstreamInvalidResponseError(
                    f"provider {self._provider!r} sent a non-JSON stream event", self._provider
                ) from None
            if not isinstance(obj, Mapping):
                continue
            if obj.get("type") == "message_stop":
                self.completed = True
                await self.aclose()
                raise StopAsyncIteration
            try:
                out = self._emit(obj, self._translate(obj))
            except UpstreamError:
                await self.aclose()
                raise
            if out is not None:
                return out

    def _emit(self, event: Mapping[str, Any], chunk: bytes | None) -> bytes | None:
        """What the stream yields for one upstream event and its chat chunk (``None``: nothing, read on)."""
        return chunk


class AnthropicProvider(HttpProvider):
    """Calls ``{base_url}/messages`` with ``x-api-key`` and ``anthropic-version``."""

    def base_headers(self) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION}

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key}

    def cache_hints(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """``body`` with prompt-cache breakpoints placed unless the client set some or placing is off."""
        return place_breakpoints(body, model) if self.auto_breakpoints else body

    async def complete(self, call: UpstreamCall) -> Completion:
        status, content = await self._pool.post(
            "messages", dumps(self.cache_hints(to_anthropic(call.body, call.upstream_model, stream=False),
                                               call.upstream_model))
        )
        if status >= 400:
            raise error_for_status(self.name, status, content, self._secret)
        try:
            msg = json.loads(content)
        except ValueError:
            msg = None
        if not isinstance(msg, Mapping) or msg.get("type") != "message":
            raise UpstreamInvalidResponseError(
                f"provider {self.name!r} answered without a message", self.name
            )
        out = from_anthropic(msg, call.upstream_model)
        return Completion(out, _usage(msg.get("usage")))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        deadline = self.deadline()
        body = dumps(self.cache_hints(to_anthropic(call.body, call.upstream_model, stream=True),
                                      call.upstream_model))
        resp = await open_stream(self._pool, "messages", body, self._secret)
        return _AnthropicStream(self.name, resp, deadline, call.upstream_model, self._secret)
