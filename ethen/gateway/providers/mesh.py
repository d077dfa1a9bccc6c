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

Life cycle: built either around a running orchestrator (``MeshProvider(orch)``: the caller owns it) or from
a ``kind = "mesh"`` config entry (:meth:`MeshProvider.from_config`: the provider owns it). An owned
orchestrator is loaded by :meth:`start` (the gateway's lifespan start-up: embeddings + final norm + head load,
Health polling starts, then it waits up to ``start_timeout_s`` for a route covering every layer, logging
progress on the ``ethen.gateway.startup`` logger) and closed by :meth:`aclose` at shutdown. Choice: a gateway
whose workers are not up yet still starts (it logs a warning); mesh requests then fail with a retryable
``UpstreamConnectionError`` until the workers answer Health, so other providers can take the traffic. A
request reaching a provider nobody started (e.g. ``ethen certify`` outside a server) loads it on first use.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ethen.gateway.errors import UpstreamBadRequestError, UpstreamConnectionError, UpstreamStreamError
from ethen.gateway.providers.base import Completion, Provider, ProviderStream, UpstreamCall, Usage
from ethen.gateway.sse import dumps
from ethen.mesh.orchestrator import MeshGeneration, Orchestrator
from ethen.mesh.routing import RouteWeights
from ethen.mesh.routing.errors import MeshRoutingError
from ethen.model.errors import ModelError
from ethen.model.generate import GenerationChunk
from ethen.model.sampling import SamplingParams

if TYPE_CHECKING:
    from ethen.gateway.config import MeshProviderConfig

__all__ = ["MeshProvider", "messages_of", "sampling_params"]

startup_log = logging.getLogger("ethen.gateway.startup")

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
    """Provider ``mesh``: an in-process orchestrator over the mesh's gRPC workers."""

    def __init__(
        self,
        orchestrator: Orchestrator | None = None,
        name: str = "mesh",
        *,
        loader: Callable[[], Orchestrator] | None = None,
        start_timeout_s: float = 0.0,
    ) -> None:
        if (orchestrator is None) == (loader is None):
            raise ValueError("MeshProvider needs exactly one of an orchestrator and a loader")
        self.name = name
        self._orchestrator = orchestrator
        self._loader = loader
        self._lock = asyncio.Lock()
        self.start_timeout_s = start_timeout_s

    @classmethod
    def from_config(cls, p: MeshProviderConfig) -> MeshProvider:
        """A provider that loads its own orchestrator over ``p.workers`` at :meth:`start`."""
        overrides = {k: v for k, v in p.weights.model_dump().items() if v is not None}
        weights = RouteWeights().with_overrides(overrides)
        workers = dict(p.workers)

        def load() -> Orchestrator:
            return Orchestrator.load(
                workers, weights=weights, fallback_model=p.fallback_model,
                health_interval_s=p.health_interval_s, forward_timeout_s=p.forward_timeout_s,
            ).start()

        return cls(name=p.id, loader=load, start_timeout_s=p.start_timeout_s)

    @property
    def orchestrator(self) -> Orchestrator | None:
        """The orchestrator (``None`` until an owned one is started)."""
        return self._orchestrator

    async def start(self) -> None:
        await self._ready()

    async def _ready(self) -> Orchestrator:
        orch = self._orchestrator
        if orch is not None:
            return orch
        async with self._lock:
            if self._orchestrator is None:
                assert self._loader is not None
                t0 = time.perf_counter()
                startup_log.info("mesh %r: loading the embeddings, final norm and head ...", self.name)
                try:
                    self._orchestrator = await asyncio.to_thread(self._loader)
                except (ModelError, OSError, ValueError) as exc:
                    raise UpstreamConnectionError(f"mesh {self.name!r}: cannot load the model: {exc}",
                                                  self.name) from None
                startup_log.info("mesh %r: loaded in %.1fs; polling the health of %d worker(s)", self.name,
                                 time.perf_counter() - t0, len(self._orchestrator.clients))
                await self._await_route(self._orchestrator)
            return self._orchestrator

    async def _await_route(self, orch: Orchestrator) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                route = await asyncio.to_thread(orch.route_for, 32)
            except MeshRoutingError as exc:
                if time.monotonic() >= deadline:
                    startup_log.warning("mesh %r: no route over the workers yet (%s); mesh requests fail "
                                        "over to other providers until the workers answer", self.name, exc)
                    return
                await asyncio.sleep(0.2)
                continue
            startup_log.info("mesh %r: route now %s (cost %.1f)", self.name,
                             " -> ".join(f"{s.node_id} {s.first}-{s.last}" for s in route.stages), route.cost)
            return

    async def aclose(self) -> None:
        orch = self._orchestrator
        if self._loader is not None and orch is not None:
            self._orchestrator = None
            await asyncio.to_thread(orch.close)
            startup_log.info("mesh %r: orchestrator closed", self.name)

    async def _start(self, call: UpstreamCall) -> tuple[MeshGeneration, list[int]]:
        messages = messages_of(call.body)
        params = sampling_params(call.body)
        o = await self._ready()
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
