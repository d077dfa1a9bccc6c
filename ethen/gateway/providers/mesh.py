"""The ``mesh`` provider: serves ``smollm2-135m-instruct`` from the local mesh, in-process.

It wraps an :class:`~ethen.mesh.orchestrator.Orchestrator` (which routes each request over the gRPC workers
with ``score_route``, runs prefill + decode, and fails over) behind the gateway's
:class:`~ethen.gateway.providers.base.Provider` interface, buffered and streaming. The mesh route (stages,
nodes, per-stage cost, failovers) goes on the routing receipt as ``receipt_extra["mesh"]``.

Request mapping (OpenAI chat completions): ``messages`` (string content or text parts), ``temperature``
(default 1, as OpenAI), ``top_p``, ``seed``, ``max_completion_tokens`` / ``max_tokens`` (default 256),
``stop``. Image or audio parts and ``n`` > 1 are refused with ``UpstreamBadRequestError`` (not retried:
the request is the cause); the catalog already marks the model without tools or vision, so the gateway's
filter does not send such requests here.

Error mapping: no route / no live replica (``NoRouteAvailable``, ``RoutingFailure``, ``DegradedRoute``) and
node failures that failover could not absorb become ``UpstreamConnectionError`` before the first chunk
(retryable: the gateway may fall back to another provider) or ``UpstreamStreamError`` once chunks were
sent; bad sampling fields become ``UpstreamBadRequestError``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ethen.gateway.errors import UpstreamBadRequestError, UpstreamConnectionError, UpstreamStreamError
from ethen.gateway.providers.base import Completion, Provider, ProviderStream, UpstreamCall, Usage
from ethen.gateway.sse import dumps
from ethen.mesh.orchestrator import MeshGeneration, Orchestrator
from ethen.mesh.routing.errors import MeshRoutingError
from ethen.model.errors import ModelError
from ethen.model.generate import GenerationChunk
from ethen.model.sampling import SamplingParams

__all__ = ["MeshProvider", "sampling_params"]

_DEFAULT_MAX_TOKENS = 256


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise UpstreamBadRequestError(
                    f"messages[{i}].content[{j}]: the mesh model reads text only, got part type {kind!r}",
                    "mesh")
        return "".join(parts)
    raise UpstreamBadRequestError(f"messages[{i}].content must be a string or a list of text parts", "mesh")


def messages_of(body: Mapping[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise UpstreamBadRequestError("messages must be a non-empty list", "mesh")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise UpstreamBadRequestError(f"messages[{i}] must be an object with a string role", "mesh")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(m.get("content"), i)})
    return out


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """OpenAI sampling fields -> :class:`SamplingParams` (bad values raise ``UpstreamBadRequestError``)."""
    n = body.get("n")
    if n not in (None, 1):
        raise UpstreamBadRequestError(f"n = {n!r}: the mesh provider returns one choice", "mesh")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    stop = body.get("stop")
    try:
        return SamplingParams(
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            seed=body.get("seed"),
            max_tokens=_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            stop=() if stop is None else stop,
        )
    except ModelError as exc:
        raise UpstreamBadRequestError(str(exc), "mesh") from None


class MeshProvider(Provider):
    """Provider ``mesh``: the in-process orchestrator of the local mesh."""

    def __init__(self, orchestrator: Orchestrator, name: str = "mesh") -> None:
        self.name = name
        self.orchestrator = orchestrator

    async def _start(self, call: UpstreamCall) -> tuple[MeshGeneration, list[int]]:
        messages = messages_of(call.body)
        params = sampling_params(call.body)
        o = self.orchestrator
        try:
            prompt = await asyncio.to_thread(o.chat_prompt, messages)
            gen = await asyncio.to_thread(o.generate, prompt, params)
        except ModelError as exc:
            raise UpstreamBadRequestError(str(exc), self.name) from None
        except MeshRoutingError as exc:
            raise UpstreamConnectionError(f"mesh: {exc}", self.name) from None
        return gen, prompt

    def _receipt(self, gen: MeshGeneration) -> dict[str, Any]:
        return {"mesh": gen.to_dict()}

    async def complete(self, call: UpstreamCall) -> Completion:
        gen, prompt = await self._start(call)
        try:
            result = await asyncio.to_thread(gen.result)
        except ModelError as exc:
            raise UpstreamBadRequestError(str(exc), self.name) from None
        except MeshRoutingError as exc:
            raise UpstreamConnectionError(f"mesh: {exc}", self.name) from None
        usage = Usage(len(prompt), len(result.token_ids))
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.upstream_model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": result.text, "refusal": None},
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }],
            "usage": usage.to_openai(),
        }
        return Completion(body, usage, self._receipt(gen))

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        gen, prompt = await self._start(call)
        return _MeshStream(self, gen, len(prompt), call.upstream_model)


class _MeshStream(ProviderStream):
    def __init__(self, provider: MeshProvider, gen: MeshGeneration, prompt_tokens: int, model: str) -> None:
        self._provider = provider
        self._gen = gen
        self._prompt_tokens = prompt_tokens
        self._model = model
        self._id = f"chatcmpl-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._chunks: AsyncIterator[GenerationChunk] = gen.__aiter__()
        self._sent_role = False
        self._finished = False
        self.usage = None
        self.completed = False
        self.receipt_extra = provider._receipt(gen)

    def _payload(self, delta: dict[str, Any], finish: str | None) -> bytes:
        return dumps({
            "id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        })

    async def __anext__(self) -> bytes:
        if self._finished:
            self.completed = True
            self.usage = Usage(self._prompt_tokens, len(self._gen.token_ids))
            self.receipt_extra = self._provider._receipt(self._gen)
            raise StopAsyncIteration
        if not self._sent_role:
            self._sent_role = True
            return self._payload({"role": "assistant", "content": ""}, None)
        while True:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise UpstreamStreamError("mesh generation ended without a finish reason", "mesh") from None
            except (MeshRoutingError, ModelError) as exc:
                raise UpstreamStreamError(f"mesh: {exc}", self._provider.name) from None
            if chunk.finish_reason is not None:
                self._finished = True  # the last chunk carries any held-back text and the finish reason
                return self._payload({"content": chunk.text} if chunk.text else {}, chunk.finish_reason)
            if chunk.text:
                return self._payload({"content": chunk.text}, None)

    async def aclose(self) -> None:
        closer = getattr(self._chunks, "aclose", None)
        if closer is not None:
            await closer()
