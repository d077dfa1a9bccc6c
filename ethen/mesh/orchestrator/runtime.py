"""The orchestrator: the model's ends (embeddings, final norm, tied head), live telemetry of the workers,
a route per request, and generation streamed token by token (sync iterator or async iterator).

Choices where the spec is silent:

- Routing happens when a generation starts (``score_route`` on states never older than 1 s) and again only
  on failure (spec §9: the router does not retry; the orchestrator recomposes).
- Concurrent generations run on their own threads (blocking gRPC on persistent channels is the fastest
  Python client); their decode steps meet on the workers, which batch them, and their head matmuls meet here
  in a :class:`~ethen.mesh.worker.batching.StepBatcher` (one ``[B, d] x [d, V]`` matmul for B sessions,
  split by columns over ``head_threads`` threads, :mod:`~ethen.mesh.orchestrator.head`).
- Membership: :meth:`Orchestrator.add_worker` / :meth:`Orchestrator.remove_worker` (the mesh provider's
  registry calls them when a worker joins or leaves, see :mod:`ethen.mesh.orchestrator.registry`). A joined
  node is polled at once, so it is routable as soon as its first Health answers. A node that left is no longer
  watched nor routed to; its client stays in ``clients`` (sessions still on it finish or fail over; a channel
  per node that ever joined, closed with the orchestrator). ``workers`` may be empty when nodes join later.
- ``data_plane``: ``"star"`` (default: every stage call leaves from and returns to the orchestrator) or
  ``"chain"`` (warm decode steps go worker to worker and the last worker delivers to a receiver served here
  on ``chain_listen``, advertised to the workers as ``chain_advertise``; see
  :mod:`~ethen.mesh.orchestrator.chain` for the measurement that chose it and the security model). The
  receiver requires the orchestrator's own token and serves TLS with ``chain_tls`` (grpc server credentials).
- Load (issue 42, :mod:`~ethen.mesh.orchestrator.admission`): the multi-row calls to each worker pass a
  :class:`~ethen.mesh.orchestrator.admission.NodeGate` (2 in flight per worker, in arrival order; a session
  that gets no slot within ``admission_timeout_s`` before its first token is refused with
  :class:`~ethen.mesh.orchestrator.errors.MeshSaturated`), and a worker that makes progress is busy, not
  dead (its Health polls may time out, a call to it may run out of time: it is not backed off). With
  ``max_queue`` (issue 44), a bound per chain (the route's workers in order): a generation goes to the first
  of its route options (:func:`~ethen.mesh.orchestrator.planning.route_options`) whose chain has fewer than
  that many waiting for their first token, and with every chain full it is refused at once
  (:class:`~ethen.mesh.orchestrator.errors.MeshSaturated`,
  :meth:`~ethen.mesh.orchestrator.load.LoadBook.try_begin_any`). The load book's session caps are the
  workers' own (their ``Health``, :meth:`~ethen.mesh.orchestrator.telemetry.HealthMonitor.session_caps`).
- The async API (:meth:`MeshGeneration.__aiter__`) runs the blocking loop on a thread and hands chunks to the
  event loop, so an ASGI gateway can stream without blocking.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ethen.mesh.auth import ClientCredentials, TokenAuth
from ethen.mesh.errors import MeshError
from ethen.mesh.model_id import model_fingerprint
from ethen.mesh.orchestrator.admission import NodeGate
from ethen.mesh.orchestrator.backoff import Backoff
from ethen.mesh.orchestrator.chain import ChainReceiver
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.orchestrator.errors import MeshSaturated
from ethen.mesh.orchestrator.head import SplitHead
from ethen.mesh.orchestrator.load import LoadBook, MeshLoad, queue_retry_after_s
from ethen.mesh.orchestrator.planning import plan_route, recompose, route_options
from ethen.mesh.orchestrator.prefix import (
    fragment_cached_tokens,
    prefix_chain,
    route_cached_tokens,
)
from ethen.mesh.orchestrator.rounds import DEFAULT_PROGRESS_TIMEOUT_S, DecodeRounds
from ethen.mesh.orchestrator.session import MeshSession
from ethen.mesh.orchestrator.telemetry import HealthMonitor
from ethen.mesh.routing import NodeState, Route, RouteWeights
from ethen.mesh.worker.batching import Job, StepBatcher
from ethen.mesh.worker.limits import MAX_PREFILL_TOKENS
from ethen.model.chat_template import ChatTemplate
from ethen.model.choose import DEFAULT_OPTIONS, EngineOptions, engine_kind
from ethen.model.generate import GenerationChunk, GenerationResult, generate_stream
from ethen.model.gguf_loader import WeightStore, open_weight_store
from ethen.model.gqhead import GgmlEmbedAndHead
from ethen.model.model import Ends, engine_for, load_embed_and_head
from ethen.model.sampling import SamplingParams
from ethen.model.tokenizer import Tokenizer

__all__ = ["MODEL_NAME", "MeshGeneration", "Orchestrator", "default_round_lanes"]

MODEL_NAME = "smollm2-135m-instruct"

F32 = npt.NDArray[np.float32]


class MeshGeneration:
    """One generation: route chosen at creation (routing errors raise there), chunks when iterated."""

    def __init__(self, orchestrator: Orchestrator, session: MeshSession, prompt_ids: Sequence[int],
                 params: SamplingParams, options: Sequence[Route] = ()) -> None:
        self.orchestrator = orchestrator
        self.session = session
        self.options = tuple(options) or (session.route,)  # the session's route first, then other chains
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token_s: float | None = None

    @property
    def route(self) -> Route:
        """The route in use now (it changes after a failover)."""
        return self.session.route

    def __iter__(self) -> Iterator[GenerationChunk]:
        o = self.orchestrator
        book = o.load_book
        book.caps = o.monitor.session_caps()  # the workers' own session caps (their Health)
        chains = [r.nodes for r in self.options]
        got = book.try_begin_any(len(self.prompt_ids), o.max_queue, chains)  # issue 44: signal and bound
        if got is None:  # every chain's queue is full: refused at once, before any worker is asked
            self.session.close()
            load = book.snapshot(chains)
            raise MeshSaturated(f"{load.prefilling} requests wait for their first token on chain "
                                f"{'>'.join(load.chain) or '-'} (max_queue = {o.max_queue} per chain, "
                                f"{len(chains)} chain(s) tried)", queue_retry_after_s(load.linear()[0]))
        ticket, index = got
        begun = last = time.perf_counter()
        try:
            if index:  # the preferred chain's queue is full: this one has room
                self.session.close()
                self.session = o.open_session(len(self.prompt_ids), self.options[index], self.prompt_ids)
            for chunk in generate_stream(self.session.step, o.tokenizer, self.prompt_ids, self.params,
                                         o.context_length):
                if chunk.token_id is not None:
                    self.token_ids.append(chunk.token_id)
                    now = time.perf_counter()
                    if self.first_token_s is None:
                        self.first_token_s = now - self.started
                        o.load_book.first_token(ticket, (now - begun) * 1000.0)
                    else:
                        o.load_book.step((now - last) * 1000.0, ticket)
                    last = now
                self.text += chunk.text
                if chunk.finish_reason is not None:
                    self.finish_reason = chunk.finish_reason
                yield chunk
        finally:
            o.load_book.end(ticket)
            self.session.close()

    def result(self) -> GenerationResult:
        """Run to the end (if not iterated yet) and return the result."""
        if self.finish_reason is None:
            for _ in self:
                pass
        return GenerationResult(self.text, tuple(self.token_ids), self.finish_reason or "length",
                                len(self.prompt_ids))

    async def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def run() -> None:
            try:
                for chunk in self:
                    loop.call_soon_threadsafe(queue.put_nowait, ("chunk", chunk))
                    if cancelled.is_set():
                        break
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except BaseException as exc:  # handed to the consumer, re-raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

        thread = threading.Thread(target=run, name=f"ethen-gen-{self.session.id[:8]}", daemon=True)
        thread.start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "chunk":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            cancelled.set()

    def to_dict(self) -> dict[str, Any]:
        """The mesh part of a receipt: route now, routes used, failovers."""
        return {
            "route": self.route.to_dict(),
            "session_id": self.session.id,
            "failovers": [
                {"failed_node": f.failed_node, "error": f.error, "at_position": f.at_position,
                 "nodes": list(f.route.nodes)} for f in self.session.failovers],
            "replayed_positions": self.session.replayed_positions,
            "prefix_reused_tokens": self.session.prefix_reused,
            "stages": [t.to_dict() for t in self.session.stage_timings.values()],
        }


def default_round_lanes(ends: Ends) -> int:
    """Decode-round lanes when none are given (:mod:`~ethen.mesh.orchestrator.rounds`): 2 for a model on
    the ggml engine, else 1. Measured on the 3-worker loopback mesh (``bench/mesh_decode.py --lanes-ab 1,2
    [--model]``, alternated rounds, 2 cores): TinyLlama-shape Q4_K_M on ggml, where a batched step of 8
    rows costs ~3-4x one row, 8 sessions 71.7 against 42.9 tok/s and 4 sessions 63.0 against 42.8 with 2
    lanes (two workers compute at once); SmolLM2 on onnx, whose 8-row step costs ~1.3x one, 1 lane 197.9
    against 170.4 (8) and 123.1 against 102.1 (4). The orchestrator's head runs on the engine ``auto``
    chooses for the model, as its workers' layers do by default."""
    return 2 if isinstance(ends, GgmlEmbedAndHead) else 1


class Orchestrator:
    """Client side of the mesh: embeddings/head + routing + sessions over gRPC workers."""

    def __init__(
        self,
        workers: Mapping[str, str],
        ends: Ends,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        weights: RouteWeights | None = None,
        fallback_model: str | None = None,
        model_name: str = MODEL_NAME,
        backoff: Backoff | None = None,
        exact_replay: bool = True,
        health_interval_s: float = 0.25,
        forward_timeout_s: float = 60.0,
        round_lanes: int | None = None,
        max_step_tokens: int = MAX_PREFILL_TOKENS,
        credentials: ClientCredentials | None = None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        data_plane: str = "star",
        chain_listen: str = "127.0.0.1:0",
        chain_advertise: str | None = None,
        chain_tls: Any = None,
        head_threads: int = 2,
        admission_timeout_s: float = 30.0,
        max_queue: int | None = None,
    ) -> None:
        if data_plane not in ("star", "chain"):
            raise ValueError(f"data_plane = {data_plane!r}: must be 'star' or 'chain'")
        self.data_plane = data_plane
        self.progress_timeout_s = progress_timeout_s  # a stage call's deadline per 128 rows (stuck nodes)
        self.admission_timeout_s = admission_timeout_s  # wait for worker slots before a first token
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue = {max_queue!r}: must be >= 1 (or None: no bound)")
        self.max_queue = max_queue  # generations waiting for a first token; one more: MeshSaturated at once
        self._gates: dict[str, NodeGate] = {}
        self._gates_lock = threading.Lock()
        self.load_book = LoadBook()  # issue 44: generations in flight, prefill queue, step time
        self.credentials = credentials
        self.forward_timeout_s = forward_timeout_s
        self._members = threading.Lock()
        self.ends = ends
        self.head_fn = SplitHead(ends, head_threads)  # final norm + head, matmul split over threads
        self.config = ends.config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.weights = weights or RouteWeights()
        self.fallback_model = fallback_model
        self.model_name = model_name
        self.prefix_key = model_name  # seeds the prompt prefixes' hash chain (the model file's hash if known)
        self.exact_replay = exact_replay
        self.max_step_tokens = max_step_tokens  # a longer prompt is prefilled in steps of at most this
        self.clients = {node: WorkerClient(node, addr, forward_timeout_s=forward_timeout_s,
                                           credentials=credentials)
                        for node, addr in workers.items()}
        self.monitor = HealthMonitor(self.clients, backoff or Backoff(), interval_s=health_interval_s,
                                     grace_s=progress_timeout_s)
        self._head = StepBatcher(self._head_batch, max_batch=64, window_s=0.002, active_horizon_s=0.5,
                                 name="ethen-head")
        self.chain: ChainReceiver | None = None
        if data_plane == "chain":
            token = credentials.token if credentials is not None else None
            self.chain = ChainReceiver(chain_listen, chain_advertise, tls=chain_tls,
                                       auth=None if token is None else TokenAuth([token]))
        lanes = round_lanes if round_lanes is not None else default_round_lanes(ends)
        self.rounds = DecodeRounds(self.clients, self.head_fn, lanes=lanes,
                                   progress_timeout_s=progress_timeout_s, observe=self.monitor.observe_call,
                                   chain=self.chain, observe_step=self.monitor.observe_step,
                                   clock=self.monitor.clock)

    @classmethod
    def load(cls, workers: Mapping[str, str], store: WeightStore | None = None,
             engine_options: EngineOptions = DEFAULT_OPTIONS, **kwargs: Any) -> Orchestrator:
        """The orchestrator over ``workers``, its head on the engine ``engine_options`` (``--engine`` /
        ``--accuracy`` / ``--device``: the mesh provider's ``engine`` / ``accuracy`` / ``device``) choose
        for ``store``'s model (default: the SmolLM2 file)."""
        s = store if store is not None else open_weight_store()
        # the head's threads on onnxruntime (its pool sleeps between ops); on ggml one, a sleeping pool: the
        # gateway shares its cores (ggml's barriers spin inside a graph, docs/decisions/0100)
        onnx = engine_kind(s.tensors or {}, engine_options) == "onnx"
        engine = engine_for(s, threads=int(kwargs.get("head_threads", 2)) if onnx else None,
                            options=engine_options)
        orch = cls(workers, load_embed_and_head(s, engine), s.load_tokenizer(), s.load_chat_template(),
                   **kwargs)
        path = s.meta.get("gguf_path")
        if path:  # issue 24: route only to workers that loaded this file (ethen.mesh.model_id)
            try:
                orch.prefix_key = model_fingerprint(path)
                orch.monitor.expect_model(orch.prefix_key, str(path))
            except (OSError, ValueError) as exc:  # the cache outlived its file: workers cannot be checked
                logging.getLogger("ethen.mesh.orchestrator").warning(
                    "mesh: the workers' model files are not checked: %s", exc)
        return orch

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def start(self) -> Orchestrator:
        self.monitor.start()
        return self

    def add_worker(self, node_id: str, address: str) -> bool:
        """Route to ``node_id`` at ``address`` from now on (a worker joined); False when it was already
        watched at that address (a heartbeat). A new address replaces the old one."""
        with self._members:
            old = self.clients.get(node_id)
            if old is not None and old.address == address and node_id in self.monitor.clients:
                return False
            client = WorkerClient(node_id, address, forward_timeout_s=self.forward_timeout_s,
                                  credentials=self.credentials)
            self.clients[node_id] = client  # in place: sessions and decode rounds hold this mapping
            if node_id in self.monitor.clients:
                self.monitor.clients[node_id] = client
                self.monitor.poll(node_id)
            else:
                self.monitor.add(node_id, client)
        return True

    def remove_worker(self, node_id: str, address: str | None = None) -> bool:
        """Stop routing to ``node_id`` (a worker left); with ``address``, only if it is still the node's."""
        with self._members:
            client = self.monitor.clients.get(node_id)
            if client is None or (address is not None and client.address != address):
                return False
            self.monitor.remove(node_id)
        return True

    def close(self) -> None:
        self.monitor.stop()
        self._head.stop()
        self.head_fn.close()
        if self.chain is not None:
            self.chain.close()
        for client in self.clients.values():
            client.close()

    def __enter__(self) -> Orchestrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pieces a session uses ----------------------------------------------------------------------------

    def _head_batch(self, jobs: list[Job]) -> list[F32 | BaseException]:
        hidden = np.concatenate([j.hidden for j in jobs], axis=0)  # [B, d]
        logits = self.head_fn(hidden)  # [B, V]
        return [logits[i : i + 1] for i in range(len(jobs))]

    def head(self, hidden: F32, session_id: str = "") -> F32:
        """Final norm + head of ``hidden`` [1, d] -> logits [1, V], batched with concurrent sessions."""
        job = Job(session_id=session_id, first_layer=-1, last_layer=-1, positions=[0], hidden=hidden)
        return self._head.run(job)[0]

    def states(self) -> tuple[NodeState, ...]:
        return self.monitor.states()

    def gate(self, node_id: str) -> NodeGate:
        """The gate of the multi-row calls to ``node_id`` (made on first use)."""
        with self._gates_lock:
            gate = self._gates.get(node_id)
            if gate is None:
                gate = self._gates[node_id] = NodeGate(clock=self.monitor.clock)
            return gate

    def _recompose(self, route: Route, failed: str) -> Route:
        return recompose(route, failed, self.states(), self.weights, self.fallback_model)

    # ---- public API ---------------------------------------------------------------------------------------

    def route_for(self, prompt_tokens: int, prompt_ids: Sequence[int] | None = None) -> Route:
        """The route a request with ``prompt_tokens`` would take now (raises ``NoRouteAvailable``); with the
        ``prompt_ids``, the prompt term counts only the positions a route's workers hold cached (issue 45)."""
        states = self.states()
        cached: dict[str, dict[int, int]] = {}
        if prompt_ids:
            chain = prefix_chain(self.prefix_key, prompt_ids)
            cached = fragment_cached_tokens(chain, self.monitor.prefix_holdings(),
                                            [s.node_id for s in states], prompt_tokens)
        return plan_route(states, self.config.n_layers, prompt_tokens, self.weights, self.model_name,
                          cached)

    def route_options(self, prompt_tokens: int, prompt_ids: Sequence[int] | None = None,
                      states: Sequence[NodeState] | None = None) -> tuple[Route, ...]:
        """:meth:`route_for`'s route, then routes over other chains (cheapest first,
        :func:`~ethen.mesh.orchestrator.planning.route_options`); raises ``NoRouteAvailable``. ``states``:
        the workers' states to plan on (default: :meth:`states`, which polls a stale worker)."""
        states = tuple(self.states() if states is None else states)
        cached: dict[str, dict[int, int]] = {}
        if prompt_ids:
            chain = prefix_chain(self.prefix_key, prompt_ids)
            cached = fragment_cached_tokens(chain, self.monitor.prefix_holdings(),
                                            [s.node_id for s in states], prompt_tokens)
        return route_options(states, self.config.n_layers, prompt_tokens, self.weights, self.model_name,
                             cached)

    def load_now(self, stale_s: float = 5.0) -> MeshLoad:
        """Issue 44: the load of the chain a new request would take now (the first of its route options
        with queue room, :meth:`~ethen.mesh.orchestrator.load.LoadBook.snapshot`), planned on the workers'
        last Health polls (at most ``stale_s`` old): no call to any worker."""
        self.load_book.caps = self.monitor.session_caps()
        try:
            options = self.route_options(1, states=[s for s, _ in self.monitor.polled(stale_s)])
        except MeshError:
            return self.load_book.snapshot()
        return self.load_book.snapshot([r.nodes for r in options], self.max_queue)

    def open_session(self, prompt_tokens: int, route: Route | None = None,
                     prompt_ids: Sequence[int] | None = None) -> MeshSession:
        chosen = route if route is not None else self.route_for(prompt_tokens, prompt_ids)
        chain = prefix_chain(self.prefix_key, prompt_ids) if prompt_ids else ()
        holdings = self.monitor.prefix_holdings() if chain else {}
        seed = route_cached_tokens(chosen, chain, holdings, prompt_tokens) if chain else 0
        session = MeshSession(chosen, self.clients, self.ends.embed, lambda h: self.head(h),
                              self._recompose, self.monitor.mark_failed, exact_replay=self.exact_replay,
                              rounds=self.rounds, max_step_tokens=self.max_step_tokens,
                              progress_timeout_s=self.progress_timeout_s, observe=self.monitor.observe_call,
                              gate=self.gate, admission_timeout_s=self.admission_timeout_s,
                              last_progress=self.monitor.last_progress, clock=self.monitor.clock,
                              prefix_hashes=chain, prefix_length=seed)
        return session

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template (generation prompt added)."""
        return self.tokenizer.encode(self.chat_template.render(messages, add_generation_prompt=True))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 route: Route | None = None) -> MeshGeneration:
        """Start a generation (routes now; iterate the result, sync or async, for chunks). Without a
        ``route``, the generation may move to another of the route options when the preferred chain's queue
        is full (``max_queue``)."""
        if route is not None:
            return MeshGeneration(self, self.open_session(len(prompt_ids), route, prompt_ids), prompt_ids,
                                  params)
        options = self.route_options(len(prompt_ids), prompt_ids) if self.max_queue is not None else ()
        first = options[0] if options else None
        return MeshGeneration(self, self.open_session(len(prompt_ids), first, prompt_ids), prompt_ids, params,
                              options)

    def chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams) -> MeshGeneration:
        return self.generate(self.chat_prompt(messages), params)
