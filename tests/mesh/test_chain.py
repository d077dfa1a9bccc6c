"""The worker-to-worker chain data plane (``data_plane = "chain"``), real gRPC on 127.0.0.1, real model.

Greedy output through the chain equals the star's and the single-process reference (one session and several
concurrent ones); over TLS with the mesh token, a caller without the token can neither feed a session nor
receive a result, and an authenticated caller without the session's capability can neither feed nor read it;
a middle worker killed (SIGKILL) or stuck (SIGSTOP) mid-generation fails over with 0 tokens lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ethen.gateway.accounting.auth import hash_key
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers import build_providers
from ethen.gateway.providers.base import UpstreamCall
from ethen.gateway.providers.mesh import MeshProvider
from ethen.mesh.auth import ClientCredentials, TokenAuth, read_tokens, server_credentials
from ethen.mesh.certs import make_certs
from ethen.mesh.orchestrator import ChainReceiver, Orchestrator, plan_route
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.routing import Route
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, parse_fragments, serve
from ethen.mesh.worker.chain import Capabilities
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import Model, SamplingParams, generate, load_model, model_step

PROMPTS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
LONG = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


def _ids(model: Model, i: int) -> list[int]:
    return model.tokenizer.encode(model.chat_template.render(PROMPTS[i], add_generation_prompt=True))


_REFS: dict[tuple[tuple[int, ...], SamplingParams], tuple[int, ...]] = {}


def _reference(model: Model, ids: list[int], params: SamplingParams) -> tuple[int, ...]:
    key = (tuple(ids), params)
    if key not in _REFS:
        _REFS[key] = generate(model_step(model), model.tokenizer, ids, params,
                              model.config.context_length).token_ids
    return _REFS[key]


class _Worker:
    def __init__(self, node_id: str, layers: str, auth: TokenAuth | None = None, tls: Any = None,
                 peers: ClientCredentials | None = None) -> None:
        fragments = parse_fragments(layers)
        self.service = WorkerService(WorkerConfig(node_id, fragments), ModelBackend.load(fragments),
                                     auth=auth, peers=peers)
        self.server, port = serve(self.service, "127.0.0.1", 0, tls=tls)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)
        self.service.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[dict[str, _Worker]]:
    workers = {n: _Worker(n, layers) for n, layers in {"a": "0-9", "b": "10-19", "c": "20-29"}.items()}
    yield workers
    for w in workers.values():
        w.close()


def test_chain_gives_the_star_and_single_process_greedy_tokens(model: Model,
                                                               plain: dict[str, _Worker]) -> None:
    addresses = {n: w.address for n, w in plain.items()}
    ids = _ids(model, 0)
    ref = _reference(model, ids, GREEDY)
    with Orchestrator.load(addresses) as star:
        assert star.chain is None
        assert star.generate(ids, GREEDY).result().token_ids == ref
    sent_before = [w.service.chain.sent for w in plain.values()]
    with Orchestrator.load(addresses, data_plane="chain") as orch:
        assert orch.chain is not None
        assert not orch.monitor._step  # no decode step measured yet (prefills and Health polls do not count)
        gen = orch.generate(ids, GREEDY)
        assert gen.result().token_ids == ref
        assert gen.route.nodes == ("a", "b", "c")
        decode_steps = len(ref) - 1  # the first token comes from the (star) prefill
        assert orch.chain.delivered >= decode_steps - 1  # the last step may stop before its head
        assert orch.chain.ignored == 0
        sent = [w.service.chain.sent - s for w, s in zip(plain.values(), sent_before, strict=True)]
        assert sent == [orch.chain.delivered] * 3  # every worker sent every step on: a -> b -> c -> here
        assert not gen.session.failovers
        assert set(orch.monitor._step) == {"a", "b", "c"}  # chained steps feed the routing's compute EWMA


def test_concurrent_sessions_share_chained_rounds_and_keep_their_own_tokens(
        model: Model, plain: dict[str, _Worker]) -> None:
    addresses = {n: w.address for n, w in plain.items()}
    with Orchestrator.load(addresses, data_plane="chain", round_lanes=2) as orch:
        got: dict[int, tuple[int, ...]] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                got[i] = orch.generate(_ids(model, i), GREEDY).result().token_ids
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors
        for i in range(len(PROMPTS)):
            assert got[i] == _reference(model, _ids(model, i), GREEDY)
        assert orch.chain is not None and orch.chain.delivered > 0
        assert max(orch.rounds.sizes) >= 2  # sessions met in one chained round


def test_a_bad_data_plane_is_refused_naming_the_value(plain: dict[str, _Worker]) -> None:
    with pytest.raises(ValueError, match="data_plane = 'ring'"):
        Orchestrator.load({n: w.address for n, w in plain.items()}, data_plane="ring")
    with pytest.raises(GatewayConfigError, match="data_plane"):
        parse_config(_gateway_config({n: w.address for n, w in plain.items()}, data_plane="ring"))


def _gateway_config(workers: dict[str, str], **mesh: Any) -> dict[str, Any]:
    return {"server": {"host": "127.0.0.1", "port": 0},
            "providers": [{"id": "mesh", "kind": "mesh", "workers": workers, **mesh}],
            "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
            "api_keys": [{"name": "test", "sha256": hash_key("ethen-test-chain-config-0123456789")}]}


def test_the_mesh_provider_config_selects_the_chain(model: Model, plain: dict[str, _Worker]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = parse_config(_gateway_config({n: w.address for n, w in plain.items()}, data_plane="chain",
                                       chain_listen=f"127.0.0.1:{port}"))
    provider = build_providers(cfg, {})["mesh"]
    assert isinstance(provider, MeshProvider)
    messages = [{"role": "user", "content": PROMPTS[0][0]["content"]}]
    ids = _ids(model, 0)
    ref = _reference(model, ids, SamplingParams(temperature=0.0, max_tokens=6))

    async def run() -> None:
        await provider.start()
        orch = provider.orchestrator
        assert orch is not None and orch.chain is not None
        try:
            done = await provider.complete(UpstreamCall(
                {"messages": messages, "max_tokens": 6, "temperature": 0}, "smollm2-135m-instruct", "r1"))
            text = done.body["choices"][0]["message"]["content"]
            assert text == model.tokenizer.decode(list(ref))
            assert orch.chain.delivered > 0
        finally:
            await provider.aclose()

    asyncio.run(run())


# ---- security --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("chain-certs"), ["10.1.2.3"])


@pytest.fixture(scope="module")
def secure(certs: dict[str, Path]) -> Iterator[tuple[dict[str, _Worker], ClientCredentials, Any]]:
    """TLS workers requiring the mesh token (and a second caller's token), calling their peers with it."""
    token = read_tokens(certs["token"])[0]
    auth = TokenAuth([token, "second-caller-token-" + "y" * 20])
    creds = ClientCredentials.load(certs["ca.pem"], certs["token"])
    tls = server_credentials(certs["server.pem"], certs["server.key"])
    workers = {n: _Worker(n, layers, auth=auth, tls=tls, peers=creds)
               for n, layers in {"a": "0-9", "b": "10-19", "c": "20-29"}.items()}
    yield workers, creds, tls
    for w in workers.values():
        w.close()


def test_a_capability_is_never_rebound_to_another_live_session() -> None:
    caps = Capabilities(limit=3)
    live = {"alice@h/s1@0", "mallory@h/s2@0"}
    cap = os.urandom(16)
    caps.bind(cap, "alice@h/s1@0", live)
    caps.bind(cap, "mallory@h/s2@0", live)  # someone who learned it cannot take it over
    assert caps.key(cap) == "alice@h/s1@0"
    live.discard("alice@h/s1@0")  # alice's session closed or expired: the capability is free again
    caps.bind(cap, "mallory@h/s2@0", live)
    assert caps.key(cap) == "mallory@h/s2@0"
    caps.forget("mallory@h/s2@0")
    assert caps.key(cap) is None
    for i in range(4):  # past the limit, bindings of sessions no longer held are dropped
        caps.bind(os.urandom(16), f"gone/{i}", set())
    assert len(caps._keys) <= 3


def _item(session: Any, stages: list[tuple[str, int, int]], hidden: np.ndarray, caps: list[bytes]) -> Any:
    return mesh_pb2.ChainItem(
        session_ids=[session.worker_session(a) for _, a, _ in stages], capabilities=caps,
        position=session.length, hidden=mesh_pb2.Tensor(data=hidden.tobytes(), shape=list(hidden.shape),
                                                         dtype="float32"))


def test_without_the_token_or_the_capability_a_caller_can_neither_feed_nor_read_a_session(
        model: Model, certs: dict[str, Path],
        secure: tuple[dict[str, _Worker], ClientCredentials, Any]) -> None:
    workers, creds, tls = secure
    ids = _ids(model, 1)
    ref = _reference(model, ids, GREEDY)
    with Orchestrator.load({n: w.address for n, w in workers.items()}, credentials=creds, data_plane="chain",
                           chain_tls=tls) as orch:
        assert orch.chain is not None
        assert orch.generate(ids, GREEDY).result().token_ids == ref  # the chain works over TLS + token
        assert orch.chain.delivered > 0
        session = orch.open_session(len(ids))
        session.step(ids)  # prefill (star): binds each stage's capability on its worker
        stages = [(s.node_id, s.first, s.last) for s in session.route.stages]
        hops = [mesh_pb2.ChainHop(node_id=n, address=workers[n].address, first_layer=a, last_layer=b)
                for n, a, b in stages]
        x = orch.ends.embed([ids[0]])
        # a receiver of the attacker's own, to see what comes back
        other = ClientCredentials(creds.ca, "second-caller-token-" + "y" * 20)
        spy = ChainReceiver("127.0.0.1:0", tls=tls, auth=TokenAuth([creds.token or ""]))
        try:
            def chain(call_creds: ClientCredentials, caps: list[bytes]) -> Any:
                step = spy.expect()
                request = mesh_pb2.ChainRequest(hops=hops, hop=0, deliver_to=f"localhost:{spy.port}",
                                                ticket=step.ticket, items=[_item(session, stages, x, caps)])
                channel = call_creds.channel(f"localhost:{workers['a'].address.rsplit(':', 1)[1]}")
                stub = mesh_pb2_grpc.MeshWorkerStub(channel)  # type: ignore[no-untyped-call]
                try:
                    stub.Chain(request, timeout=30, metadata=call_creds.metadata)
                finally:
                    channel.close()
                spy.wait([step], 30)
                return step.result

            # no token: UNAUTHENTICATED, nothing runs
            with pytest.raises(grpc.RpcError) as exc:
                chain(ClientCredentials(creds.ca, None), [session.capability(a) for _, a, _ in stages])
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # authenticated, but guessed capabilities: NOT_FOUND at the first hop, no output comes back
            guessed = chain(other, [os.urandom(16) for _ in stages])
            assert guessed is not None
            assert guessed.items[0].code == grpc.StatusCode.NOT_FOUND.value[0]
            assert guessed.items[0].failed_node == "a"
            assert len(guessed.items[0].outputs) == 0
            # too short a capability is refused too (no brute force of short ones)
            short = chain(other, [session.capability(a)[:4] for _, a, _ in stages])
            assert short is not None and short.items[0].code == grpc.StatusCode.NOT_FOUND.value[0]
            # the control: with the capabilities the step runs (so the refusals above are the check's doing)
            held = chain(other, [session.capability(a) for _, a, _ in stages])
            assert held is not None and held.items[0].code == 0 and len(held.items[0].outputs) == 3
        finally:
            spy.close()
            session.close()
        # the orchestrator's receiver: no token -> UNAUTHENTICATED; an unknown ticket is ignored
        port = orch.chain.port
        bare = ClientCredentials(creds.ca, None).channel(f"localhost:{port}")
        try:
            with pytest.raises(grpc.RpcError) as exc:
                mesh_pb2_grpc.MeshChainReceiverStub(bare).Deliver(  # type: ignore[no-untyped-call]
                    mesh_pb2.ChainRequest(ticket=os.urandom(16)), timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            bare.close()
        ignored = orch.chain.ignored
        ch = creds.channel(f"localhost:{port}")
        try:
            mesh_pb2_grpc.MeshChainReceiverStub(ch).Deliver(  # type: ignore[no-untyped-call]
                mesh_pb2.ChainRequest(ticket=os.urandom(16)), timeout=10, metadata=creds.metadata)
        finally:
            ch.close()
        assert orch.chain.ignored == ignored + 1


# ---- failover under the chain: real worker processes --------------------------------------------------

LAYOUT = {"a": "0-9", "b": "10-19", "c": "10-19,20-29"}


@pytest.fixture
def procs() -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for node, layers in LAYOUT.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            if w.alive():
                os.kill(w.pid, signal.SIGCONT)
            w.stop()


def _through_b(orch: Orchestrator, prompt_tokens: int) -> Route:
    """The route a 0-9 -> b 10-19 -> c 20-29 (c's replica of 10-19 hidden from the planner)."""
    states = [replace(s, served_layers=((20, 29),)) if s.node_id == "c" else s for s in orch.states()]
    route = plan_route(states, 30, prompt_tokens, orch.weights, orch.model_name)
    assert [(s.node_id, s.first, s.last) for s in route.stages] == [("a", 0, 9), ("b", 10, 19), ("c", 20, 29)]
    return route


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_dead_or_stuck_middle_worker_fails_over_with_no_token_lost(
        model: Model, procs: dict[str, WorkerProcess], fault: str) -> None:
    ids = _ids(model, 0)
    ref = _reference(model, ids, LONG)
    with Orchestrator.load({n: w.address for n, w in procs.items()}, data_plane="chain",
                           progress_timeout_s=2.0) as orch:
        deadline = 30.0
        while not all(s.alive for s in orch.states()) and deadline > 0:
            threading.Event().wait(0.1)
            deadline -= 0.1
        gen = orch.generate(ids, LONG, route=_through_b(orch, len(ids)))
        tokens: list[int] = []
        for chunk in gen:
            if chunk.token_id is not None:
                tokens.append(chunk.token_id)
            if len(tokens) == 6:
                assert orch.chain is not None and orch.chain.delivered >= 4  # decode ran chained so far
                if fault == "kill":
                    procs["b"].kill()
                else:
                    os.kill(procs["b"].pid, signal.SIGSTOP)
        assert tuple(tokens) == ref
        assert [f.failed_node for f in gen.session.failovers] == ["b"]
        assert [(s.node_id, s.first, s.last) for s in gen.route.stages] == [("a", 0, 9), ("c", 10, 29)]
        delivered = orch.chain.delivered if orch.chain is not None else 0
        assert delivered >= len(ref) - 8  # after the failover the decode went on chained (a -> c)
