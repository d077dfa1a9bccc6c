"""Prefix reuse on the mesh (issue 45 item 3) through real worker processes on 127.0.0.1.

A second request sharing a long prefix with the first seeds every stage's KV cache from the workers' prefix
caches and computes only its suffix, with the same greedy tokens as the single-process model (no cache at
all); the route prefers the chain holding the prefix and names the holders; a failover to a node without the
prefix, before the first token or mid-decode, still gives the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from ethen.mesh import RouteWeights
from ethen.mesh.orchestrator import Orchestrator, plan_route
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import Model, SamplingParams, generate, load_model, model_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SHARED = ("You are a careful assistant for a shipping company. " * 40).strip()


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


def _ids(model: Model, question: str) -> list[int]:
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]
    return model.tokenizer.encode(model.chat_template.render(messages, add_generation_prompt=True))


def _reference(model: Model, ids: list[int]) -> tuple[int, ...]:
    return generate(model_step(model), model.tokenizer, ids, GREEDY, model.config.context_length).token_ids


def _wait_held(orch: Orchestrator, nodes: set[str], timeout_s: float = 10.0) -> None:
    """Until the Health polls of ``nodes`` report a cached prefix."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = {n for n, h in orch.monitor.prefix_holdings().items() if h.names}
        if nodes <= held:
            return
        time.sleep(0.05)
    raise AssertionError(f"{nodes} never reported a cached prefix")


@pytest.fixture
def procs() -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for node, layers in {"a": "0-14", "b": "15-29", "c": "0-14,15-29"}.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_a_shared_prefix_is_not_prefilled_again_and_gives_the_same_tokens(
        model: Model, procs: dict[str, WorkerProcess]) -> None:
    first, second = _ids(model, "Where is my parcel?"), _ids(model, "How do I return a damaged box?")
    common = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert common > 400
    # c alone saves a hop and a node term (~115); a prompt term weighing 30x makes the cached chain cheaper
    heavy = RouteWeights(prompt=30.0)
    with Orchestrator.load({n: w.address for n, w in procs.items()}, weights=heavy) as orch:
        assert orch.route_for(len(first), first).nodes == ("c",)
        states = [s for s in orch.states() if s.node_id != "c"]
        route = plan_route(states, 30, len(first), orch.weights, orch.model_name)
        assert route.nodes == ("a", "b")
        gen = orch.generate(first, GREEDY, route=route)
        assert gen.result().token_ids == _reference(model, first)
        assert gen.session.prefix_reused == 0
        _wait_held(orch, {"a", "b"})

        chosen = orch.route_for(len(second), second)  # c holds nothing: the chain a -> b is cheaper now
        assert chosen.nodes == ("a", "b")
        assert chosen.cached_tokens == common // 64 * 64
        assert dict(chosen.prefix_holders) == {"a": chosen.cached_tokens, "b": chosen.cached_tokens}
        assert "prefix holders: a" in chosen.reason

        gen = orch.generate(second, GREEDY, route=chosen)
        assert gen.result().token_ids == _reference(model, second)
        reused = gen.session.prefix_reused
        assert reused == chosen.cached_tokens
        rows = {t.node: t.rows for t in gen.session.stage_timings.values()}
        # each stage computed the suffix and the decode steps only
        assert rows["a"] == rows["b"] == len(second) - reused + len(gen.token_ids) - 1
        hits = {n: c.health() for n, c in orch.clients.items()}
        assert hits["a"].prefix_hits == hits["b"].prefix_hits == 1
        assert hits["a"].prefix_tokens_reused == reused
        assert hits["c"].prefix_hits == 0
        assert gen.to_dict()["prefix_reused_tokens"] == reused


def test_failover_to_a_node_without_the_prefix_gives_the_same_tokens(
        model: Model, procs: dict[str, WorkerProcess]) -> None:
    first, second = _ids(model, "Where is my parcel?"), _ids(model, "How do I return a damaged box?")
    ref = _reference(model, second)
    with Orchestrator.load({n: w.address for n, w in procs.items()}) as orch:
        states = [s for s in orch.states() if s.node_id != "c"]
        route = plan_route(states, 30, len(first), orch.weights, orch.model_name)
        orch.generate(first, GREEDY, route=route).result()
        _wait_held(orch, {"a", "b"})

        # seeded from a and b, then b dies mid-decode: c takes 15-29 without the prefix (nor the hidden
        # states entering layer 15): every stage is rebuilt from the token embeddings
        gen = orch.generate(second, GREEDY, route=route)
        tokens: list[int] = []
        for chunk in gen:
            if chunk.token_id is not None:
                tokens.append(chunk.token_id)
            if len(tokens) == 4:
                procs["b"].kill()
        assert gen.session.prefix_reused > 0
        assert tuple(tokens) == ref
        assert [f.failed_node for f in gen.session.failovers] == ["b"]
        assert gen.route.nodes[-1] == "c"

        # a dies after it reported the prefix: the seeded first step fails on a, and the whole prompt is
        # prefilled on the recomposed route (c)
        _wait_held(orch, {"c"})
        c_tail = [replace(s, served_layers=((15, 29),)) for s in orch.states() if s.node_id == "c"]
        procs["a"].kill()
        via_a = plan_route([*(s for s in states if s.node_id == "a"), *c_tail], 30, len(second),
                           orch.weights, orch.model_name)
        assert via_a.nodes == ("a", "c")
        gen = orch.generate(second, GREEDY, route=via_a)
        assert gen.session.prefix_length > 0  # c holds the prompt since its replay, and a per its last Health
        assert gen.result().token_ids == ref
        assert gen.session.prefix_reused == 0
        assert [f.failed_node for f in gen.session.failovers] == ["a"]
        assert "a" not in gen.route.nodes
