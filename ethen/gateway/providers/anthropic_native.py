"""Native pass-through of the Messages API to a ``kind = "anthropic"`` provider (issue 26).

``POST /v1/messages`` (:mod:`ethen.gateway.api.messages_http`) routes a request like any other, by its chat
translation: the decision, hard gates, fallback chain, budgets and telemetry are the chat path's. It then
hands the executor a :class:`NativeBody`: the chat body every provider reads, carrying the client's own
Messages body and ``anthropic-beta`` header as well. A :class:`NativeAnthropicProvider` (what the factory
builds for ``kind = "anthropic"``) sends that body **as the client sent it** (only ``model`` replaced by the
route's upstream model, ``stream`` set for the call, and the gateway's ``metadata.routing`` hints removed),
so thinking blocks and their signatures, ``cache_control``, ``top_k``, ``thinking`` and every other field
reach Anthropic unchanged, and the client's ``anthropic-beta`` header goes with it. Any other provider in the
chain (a fallback) reads the chat body, as from any endpoint.

The answer: buffered, a :class:`NativeAnswer` (the chat translation, which the gateway accounts with, carrying
the upstream's Message as it came); streamed, each chunk is the chat translation of one upstream event with
the event itself at ``x_anthropic`` (an empty-delta chunk for events chat has no form for: ``ping``,
``content_block_start`` of text, ``content_block_stop``, thinking and signature deltas), so the relay's
accounting (usage, TTFT, finish) is the chat path's and the endpoint can send the events on as they came.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import UpstreamInvalidResponseError
from ethen.gateway.providers.anthropic import AnthropicProvider, _AnthropicStream, _usage, from_anthropic
from ethen.gateway.providers.base import Completion, ProviderStream, UpstreamCall
from ethen.gateway.providers.http import error_for_status, open_stream

__all__ = ["NATIVE_KEY", "NativeAnswer", "NativeAnthropicProvider", "NativeBody", "native_request"]

#: the key of a native stream chunk that holds the upstream's event
NATIVE_KEY = "x_anthropic"


class NativeBody(dict[str, Any]):
    """A chat-completions body that also carries the client's Messages body and ``anthropic-beta`` header."""

    def __init__(self, chat: Mapping[str, Any], messages: Mapping[str, Any], beta: str | None) -> None:
        super().__init__(chat)
        self.messages = dict(messages)
        self.beta = beta


class NativeAnswer(dict[str, Any]):
    """A chat completion that also carries the upstream's Message as it came."""

    def __init__(self, chat: Mapping[str, Any], message: Mapping[str, Any]) -> None:
        super().__init__(chat)
        self.message = dict(message)


def native_request(body: NativeBody, model: str, *, stream: bool) -> dict[str, Any]:
    """The Messages body sent upstream: the client's, with the route's ``model``, ``stream`` for this call and
    no ``metadata.routing`` (the gateway's own hints)."""
    out = dict(body.messages)
    out["model"] = model
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "routing" in meta:
        rest = {k: v for k, v in meta.items() if k != "routing"}
        if rest:
            out["metadata"] = rest
        else:
            del out["metadata"]
    if stream:
        out["stream"] = True
    else:
        out.pop("stream", None)
    return out


def _headers(body: NativeBody) -> dict[str, str] | None:
    return {"anthropic-beta": body.beta} if body.beta else None


class _NativeStream(_AnthropicStream):
    """Every upstream event as a chat chunk carrying the event at :data:`NATIVE_KEY`."""

    def _emit(self, event: Mapping[str, Any], chunk: bytes | None) -> bytes | None:
        out = json.loads(chunk if chunk is not None else self._chunk({}))
        out[NATIVE_KEY] = event
        return dumps(out)


class NativeAnthropicProvider(AnthropicProvider):
    """The Anthropic provider, passing a :class:`NativeBody`'s Messages body through as it is."""

    async def complete(self, call: UpstreamCall) -> Completion:
        body = call.body
        if not isinstance(body, NativeBody):
            return await super().complete(call)
        payload = dumps(self.cache_hints(native_request(body, call.upstream_model, stream=False),
                                         call.upstream_model))
        status, content = await self._pool.post("messages", payload, _headers(body))
        if status >= 400:
            raise error_for_status(self.name, status, content, self._secret)
        try:
            msg = json.loads(content)
        except ValueError:
            msg = None
        if not isinstance(msg, Mapping) or msg.get("type") != "message":
            msg_ = f"provider {self.name!r} answered without a message"
            raise UpstreamInvalidResponseError(msg_, self.name)
        chat = from_anthropic(msg, call.upstream_model)
        return Completion(NativeAnswer(chat, msg), _usage(msg.get("usage")))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        body = call.body
        if not isinstance(body, NativeBody):
            return await super().stream(call)
        deadline = self.deadline()
        payload = dumps(self.cache_hints(native_request(body, call.upstream_model, stream=True),
                                         call.upstream_model))
        resp = await open_stream(self._pool, "messages", payload, self._secret, _headers(body))
        return _NativeStream(self.name, resp, deadline, call.upstream_model, self._secret)
