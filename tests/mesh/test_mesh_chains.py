"""Issue 44 through real workers: two ``ethen worker`` processes each serving every layer (two chains), an
orchestrator with ``max_queue = 1`` (per chain). Workers report their session caps in ``Health`` (one
started with ``--max-sessions-per-caller 3``); with the preferred chain's queue full a generation runs on the
other chain, and the capacity snapshot is that chain's; with both full it is refused at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ethen.mesh.errors import MeshError
from ethen.mesh.orchestrator import MeshSaturated, Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.mesh.worker.limits import MAX_SESSIONS_PER_CALLER
from ethen.model.sampling import SamplingParams


@pytest.fixture(scope="module")
def orch() -> Iterator[Orchestrator]:
    workers: list[WorkerProcess] = []
    try:
        workers.append(spawn_worker("a", "0-29", extra_args=["--max-sessions-per-caller", "3"]))
        workers.append(spawn_worker("b", "0-29"))
        o = Orchestrator.load({w.node_id: w.address for w in workers}, health_interval_s=0.2,
                              max_queue=1).start()
        try:
            deadline = time.monotonic() + 30
            while len(o.monitor.session_caps()) < 2 or len(o.route_options(8)) < 2:
                if time.monotonic() > deadline:
                    raise MeshError(f"the two chains are not routable: {o.states()}")
                time.sleep(0.2)
            yield o
        finally:
            o.close()
    finally:
        for w in workers:
            w.stop()


def test_workers_report_their_session_caps(orch: Orchestrator) -> None:
    assert orch.monitor.session_caps() == {"a": 3, "b": MAX_SESSIONS_PER_CALLER}


def test_a_full_chain_sends_the_generation_to_the_other_chain(orch: Orchestrator) -> None:
    ids = orch.chat_prompt([{"role": "user", "content": "Say hi."}])
    options = orch.route_options(len(ids), ids)
    preferred, other = options[0].nodes, options[1].nodes
    assert {preferred, other} == {("a",), ("b",)}
    book = orch.load_book
    held = book.try_begin(500, orch.max_queue, preferred)  # one waits on the preferred chain: it is full
    assert held is not None
    try:
        assert orch.load_now().chain == other  # what the gateway reads: the chain a new request would take
        gen = orch.generate(ids, SamplingParams(max_tokens=3, temperature=0))
        result = gen.result()
        assert gen.route.nodes == other and len(result.token_ids) >= 1
        other_held = book.try_begin(500, orch.max_queue, other)
        assert other_held is not None
        try:
            t0 = time.monotonic()
            with pytest.raises(MeshSaturated) as info:
                orch.generate(ids, SamplingParams(max_tokens=3, temperature=0)).result()
            assert time.monotonic() - t0 < 1.0
            assert "2 chain(s) tried" in str(info.value) and info.value.retry_after_s >= 1
        finally:
            book.end(other_held)
    finally:
        book.end(held)
    gen = orch.generate(ids, SamplingParams(max_tokens=3, temperature=0))
    gen.result()
    assert gen.route.nodes == gen.options[0].nodes  # room again: the preferred chain (of the moment)
