"""Staggered decode-round lanes: real model, real gRPC workers on 127.0.0.1.

Sessions that start together put their lanes in phase; without staggering the workers merge the lanes'
concurrent calls into one batched step and the lanes never separate (so their wire times never overlap).
With staggering (the default for several lanes) each lane's call to a worker waits for its slot, one
compute time after the previous lane's, so a worker computes one lane's rows at a time, and greedy output
stays that of the single process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.orchestrator.rounds import F32, RoundSession
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, parse_fragments, serve
from ethen.model import Model, SamplingParams, generate, load_model, model_step

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LAYOUT = {"a": "0-9", "b": "10-19", "c": "20-29"}


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def addresses() -> Iterator[dict[str, str]]:
    servers = []
    out: dict[str, str] = {}
    for node, layers in LAYOUT.items():
        fragments = parse_fragments(layers)
        service = WorkerService(WorkerConfig(node, fragments), ModelBackend.load(fragments))
        server, port = serve(service, "127.0.0.1", 0)
        servers.append((server, service))
        out[node] = f"127.0.0.1:{port}"
    yield out
    for server, service in servers:
        server.stop(0)
        service.stop()


def _decode_in_phase(orch: Orchestrator, sessions: int) -> None:
    """Hold each session's first decode round step until all ``sessions`` have one, so their lanes start in
    phase. Otherwise they are not: a worker computes prefills one at a time, so the sessions' first decode
    steps leave a prefill apart (~190 ms here), more than a stage's compute time (8-20 ms)."""
    rounds = orch.rounds
    gate = threading.Barrier(sessions)
    seen: set[str] = set()
    step = rounds.step

    def held(session: RoundSession, hidden: F32) -> F32:
        if session.id not in seen:
            seen.add(session.id)
            gate.wait(timeout=120)
        return step(session, hidden)

    rounds.step = held  # type: ignore[method-assign]


def _measure_stages(model: Model, orch: Orchestrator) -> None:
    """One short generation, so every worker's compute time is known before lanes meet: a lane's call to a
    worker not measured yet leaves at once (nothing to stagger by). Without it the staggering was exercised
    only by chance: the float32 workers' cold first step (their weights' pages faulted in, ~660 ms) made
    the next lane wait; quantized workers have no cold step, and lanes in phase at their unmeasured first
    call were split by the worker (computed one after the other) and then met again only by chance."""
    ids = model.tokenizer.encode(model.chat_template.render(PROMPTS[0], add_generation_prompt=True))
    orch.generate(ids, SamplingParams(temperature=0.0, max_tokens=3)).result()
    assert set(orch.rounds._compute_ms) == set(LAYOUT)


def _run_together(model: Model, orch: Orchestrator, sessions: int) -> list[tuple[int, ...]]:
    """``sessions`` greedy generations started at once, their first decode steps in phase; their token
    ids (checked against the reference)."""
    prompts = [model.tokenizer.encode(model.chat_template.render(PROMPTS[i % 2], add_generation_prompt=True))
               for i in range(sessions)]
    results: dict[int, tuple[int, ...]] = {}
    barrier = threading.Barrier(sessions)
    _decode_in_phase(orch, sessions)

    def run(i: int) -> None:
        gen = orch.generate(prompts[i], GREEDY)
        barrier.wait(timeout=60)
        results[i] = gen.result().token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    ctx = model.config.context_length
    refs = [generate(model_step(model), model.tokenizer, ids, GREEDY, ctx).token_ids for ids in prompts]
    assert [results.get(i) for i in range(sessions)] == refs
    return [results[i] for i in range(sessions)]


def test_staggered_lanes_are_not_merged_on_the_workers(model: Model, addresses: dict[str, str]) -> None:
    with Orchestrator.load(addresses, round_lanes=2) as orch:
        assert orch.rounds.stagger
        _measure_stages(model, orch)
        _run_together(model, orch, 4)
        batches = orch.rounds.worker_batches
        calls = sum(batches.values())
        merged = sum(n for rows, n in batches.items() if rows > 2)  # more rows than one lane holds
        assert calls >= 2 * 3 * 10, batches
        # the first calls to each worker go out before its compute time is known: they may merge
        assert merged <= 2 * len(LAYOUT), batches
        assert orch.rounds.waited_s > 0


def test_lanes_reserve_slots_one_compute_time_apart() -> None:
    """Three lanes that want one worker at once leave one compute time apart, in turn; another worker's
    slots are independent; a worker never measured lets every lane go at once."""
    import numpy as np

    from ethen.mesh.orchestrator.rounds import DecodeRounds

    rounds = DecodeRounds({}, lambda h: np.zeros((h.shape[0], 4), np.float32), lanes=3)
    assert [rounds._slot("a") for _ in range(3)] == [0.0, 0.0, 0.0]  # no compute time known yet
    rounds._compute_ms["a"] = 40.0
    rounds._next_slot.clear()
    waits = [rounds._slot("a") for _ in range(3)]
    assert waits[0] == 0.0
    assert waits[1] == pytest.approx(0.040, abs=0.005)
    assert waits[2] == pytest.approx(0.080, abs=0.005)
    assert rounds._slot("b") == 0.0
    assert not DecodeRounds({}, lambda h: h, lanes=1).stagger


def test_one_lane_never_waits(model: Model, addresses: dict[str, str]) -> None:
    with Orchestrator.load(addresses) as orch:
        assert not orch.rounds.stagger
        _run_together(model, orch, 2)
        assert orch.rounds.waited_s == 0
