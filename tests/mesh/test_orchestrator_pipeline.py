"""The orchestrator end to end: real model, real gRPC on 127.0.0.1, real worker processes for crashes.

Greedy output through the mesh equals the single-process reference for several splits of the 30 layers, and
still does when a worker is killed with SIGKILL mid-generation (failover + replay at the right positions).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from ethen.mesh import NodeState, RoutingFailure
from ethen.mesh.orchestrator import Backoff, DegradedRoute, Orchestrator, mark_dead, plan_route
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, parse_fragments, serve
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import Model, SamplingParams, generate, load_model, model_step

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


def _ids(model: Model, i: int) -> list[int]:
    return model.tokenizer.encode(model.chat_template.render(PROMPTS[i], add_generation_prompt=True))


_REFS: dict[tuple[tuple[int, ...], SamplingParams], tuple[int, ...]] = {}


def _reference(model: Model, ids: list[int], params: SamplingParams) -> tuple[int, ...]:
    key = (tuple(ids), params)
    if key not in _REFS:
        ctx = model.config.context_length
        _REFS[key] = generate(model_step(model), model.tokenizer, ids, params, ctx).token_ids
    return _REFS[key]


class InProcessWorker:
    def __init__(self, node_id: str, layers: str, capacity: float = 1.0) -> None:
        fragments = parse_fragments(layers)
        self.service = WorkerService(WorkerConfig(node_id, fragments, capacity_score=capacity),
                                     ModelBackend.load(fragments))
        self.server, port = serve(self.service, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)
        self.service.stop()


def _mesh(layout: dict[str, str], **kwargs: Any) -> tuple[Orchestrator, list[InProcessWorker]]:
    workers = {node: InProcessWorker(node, layers) for node, layers in layout.items()}
    orch = Orchestrator.load({n: w.address for n, w in workers.items()}, **kwargs).start()
    return orch, list(workers.values())


SPLITS = {
    "1 stage": {"solo": "0-29"},
    "2 stages even": {"a": "0-14", "b": "15-29"},
    "2 stages uneven": {"a": "0-4", "b": "5-29"},
    "3 stages": {"a": "0-9", "b": "10-19", "c": "20-29"},
    "3 stages, 2 fragments on one node": {"a": "0-2", "b": "3-10,11-27", "c": "28-29"},
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_greedy_output_is_identical_for_every_split(model: Model, split: str) -> None:
    orch, workers = _mesh(SPLITS[split])
    try:
        for i in range(len(PROMPTS)):
            ids = _ids(model, i)
            gen = orch.generate(ids, GREEDY)
            assert len(gen.route.stages) == split[0:1].count("1") or len(gen.route.stages) == int(split[0])
            assert gen.result().token_ids == _reference(model, ids, GREEDY)
    finally:
        orch.close()
        for w in workers:
            w.close()


@pytest.fixture(scope="module")
def mesh3() -> Iterator[Orchestrator]:
    orch, workers = _mesh({"a": "0-9", "b": "10-19", "c": "20-29"})
    yield orch
    orch.close()
    for w in workers:
        w.close()


def test_seeded_sampling_matches_single_process(model: Model, mesh3: Orchestrator) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20)
    ids = _ids(model, 1)
    assert mesh3.generate(ids, params).result().token_ids == _reference(model, ids, params)


def test_stop_strings_and_max_tokens(model: Model, mesh3: Orchestrator) -> None:
    ids = _ids(model, 0)
    res = mesh3.generate(ids, SamplingParams(temperature=0, max_tokens=30, stop=("Paris",))).result()
    assert res.finish_reason == "stop" and "Paris" not in res.text and res.text.startswith("The capital")
    res = mesh3.generate(ids, SamplingParams(temperature=0, max_tokens=3)).result()
    assert res.finish_reason == "length" and len(res.token_ids) == 3


def test_async_streaming_yields_the_same_tokens(model: Model, mesh3: Orchestrator) -> None:
    ids = _ids(model, 1)

    async def collect() -> list[int]:
        out: list[int] = []
        async for chunk in mesh3.generate(ids, GREEDY):
            if chunk.token_id is not None:
                out.append(chunk.token_id)
        return out

    assert tuple(asyncio.run(collect())) == _reference(model, ids, GREEDY)


def test_concurrent_sessions_each_get_their_own_output(model: Model, mesh3: Orchestrator) -> None:
    jobs = [_ids(model, i % 2) for i in range(4)]
    refs = [_reference(model, ids, GREEDY) for ids in jobs]
    results: dict[int, tuple[int, ...]] = {}

    def run(i: int) -> None:
        results[i] = mesh3.generate(jobs[i], GREEDY).result().token_ids

    mesh3.rounds.sizes.clear()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(jobs))] == refs
    assert max(mesh3.rounds.sizes) > 1, mesh3.rounds.sizes  # decode steps were combined into rounds


def test_sessions_are_closed_on_the_workers_after_generation(model: Model, mesh3: Orchestrator) -> None:
    mesh3.generate(_ids(model, 0), SamplingParams(temperature=0, max_tokens=4)).result()
    assert all(c.health().active_sessions == 0 for c in mesh3.clients.values())


def test_a_failed_node_is_backed_off_then_used_again(model: Model) -> None:
    workers = {"fast": InProcessWorker("fast", "0-29", capacity=20.0),
               "slow": InProcessWorker("slow", "0-29", capacity=0.5)}
    orch = Orchestrator.load({n: w.address for n, w in workers.items()},
                             backoff=Backoff(base_s=0.6, factor=2.0, max_s=10.0)).start()
    try:
        assert orch.route_for(10).nodes == ("fast",)
        orch.monitor.mark_failed("fast")
        assert orch.route_for(10).nodes == ("slow",)
        time.sleep(0.7)
        assert orch.route_for(10).nodes == ("fast",)
        orch.monitor.mark_failed("fast")  # second failure in a row: 1.2 s
        time.sleep(0.7)
        assert orch.route_for(10).nodes == ("slow",)
        time.sleep(0.6)
        assert orch.route_for(10).nodes == ("fast",)
    finally:
        orch.close()
        for w in workers.values():
            w.close()


# ---- real worker processes, killed with SIGKILL mid-generation ---------------------------------------------

LAYOUT = {"gpu": "0-9", "mini": "0-9,10-19", "laptop": "10-19,20-29"}
LONG = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture
def procs() -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for node, layers in LAYOUT.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


def _kill_after(orch: Orchestrator, gen: Any, victim: str, procs: dict[str, WorkerProcess],
                after: int) -> list[int]:
    tokens: list[int] = []
    for chunk in gen:
        if chunk.token_id is not None:
            tokens.append(chunk.token_id)
        if len(tokens) == after:
            assert victim in gen.route.nodes
            procs[victim].kill()
    return tokens


def _states_without(orch: Orchestrator, dead: str) -> tuple[NodeState, ...]:
    return mark_dead(orch.states(), [dead])


def test_kill_9_of_a_replicated_stage_gives_the_same_tokens(model: Model,
                                                            procs: dict[str, WorkerProcess]) -> None:
    ids = _ids(model, 1)
    ref = _reference(model, ids, LONG)
    with Orchestrator.load({n: w.address for n, w in procs.items()}) as orch:
        # Force the route gpu 0-9 -> laptop 10-29, then kill gpu: mini takes over 0-9 by replay.
        route = plan_route(_states_without(orch, "mini"), 30, len(ids), orch.weights, orch.model_name)
        assert route.nodes == ("gpu", "laptop")
        gen = orch.generate(ids, LONG, route=route)
        tokens = _kill_after(orch, gen, "gpu", procs, after=6)
        assert tuple(tokens) == ref
        assert [f.failed_node for f in gen.session.failovers] == ["gpu"]
        assert gen.route.nodes == ("mini", "laptop")
        # positions of the replay: the prompt and the 6 tokens fed before the failure (Petals #587)
        assert gen.session.failovers[0].at_position == len(ids) + 5
        assert gen.session.replayed_positions == len(ids) + 5
        assert not any(s.node_id == "gpu" and s.alive for s in orch.states())


def test_kill_9_with_moved_boundaries_replays_through_new_stages(model: Model,
                                                                 procs: dict[str, WorkerProcess]) -> None:
    ids = _ids(model, 1)
    ref = _reference(model, ids, LONG)
    with Orchestrator.load({n: w.address for n, w in procs.items()}) as orch:
        # mini 0-19 -> laptop 20-29; kill mini: gpu 0-9 -> laptop 10-29 (laptop's stage grows, boundary 10
        # is new). Plan the first route as if gpu were down and laptop served only 20-29.
        states = [replace(s, served_layers=((20, 29),)) if s.node_id == "laptop" else s
                  for s in _states_without(orch, "gpu")]
        route = plan_route(states, 30, len(ids), orch.weights, orch.model_name)
        assert [(s.node_id, s.first, s.last) for s in route.stages] == [("mini", 0, 19), ("laptop", 20, 29)]
        gen = orch.generate(ids, LONG, route=route)
        tokens = _kill_after(orch, gen, "mini", procs, after=9)
        assert tuple(tokens) == ref
        assert [(s.node_id, s.first, s.last) for s in gen.route.stages] == [("gpu", 0, 9), ("laptop", 10, 29)]


def test_kill_9_without_a_replica_is_a_clear_routing_failure(model: Model,
                                                             procs: dict[str, WorkerProcess]) -> None:
    ids = _ids(model, 0)
    with Orchestrator.load({n: w.address for n, w in procs.items()}) as orch:
        gen = orch.generate(ids, LONG)
        assert "laptop" in gen.route.nodes  # the only holder of 20-29
        with pytest.raises(RoutingFailure) as excinfo:
            _kill_after(orch, gen, "laptop", procs, after=3)
        assert excinfo.value.failed_node == "laptop"
        assert 25 in excinfo.value.missing_layers
        with pytest.raises(Exception, match="no route covers"):
            orch.generate(ids, LONG)
    with Orchestrator.load({n: w.address for n, w in procs.items() if n != "laptop"},
                           fallback_model="other") as orch:
        route = plan_route([*orch.states(), NodeState("laptop", 1.0, 0.0, 1.0, [(10, 19), (20, 29)])], 30,
                           len(ids), orch.weights, orch.model_name)
        orch.clients["laptop"] = orch.clients["gpu"].__class__("laptop", procs["laptop"].address)
        orch.monitor.clients["laptop"] = orch.clients["laptop"]
        with pytest.raises(DegradedRoute):
            orch.generate(ids, LONG, route=route).result()
