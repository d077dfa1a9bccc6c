"""Staggered lanes on the worker-to-worker chain: real model, real gRPC workers and receiver on 127.0.0.1.

As with the star (``test_rounds_stagger.py``), a lane's chained step waits for its slot on the first worker:
it leaves one compute time (the route's slowest stage, an EWMA of the per-hop compute times each chained
step carries back) after the previous lane's, so each worker computes one lane's rows at a time and the
lanes run a stage apart; greedy output stays that of the single process. Unstaggered lanes never wait.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, parse_fragments, serve
from ethen.model import Model, load_model

# the star's test: same workers, same check
from tests.mesh.test_rounds_stagger import LAYOUT, _measure_stages, _run_together


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


def _merged(orch: Orchestrator) -> tuple[int, int]:
    """(chained stage steps counted, those a worker computed with more rows than one lane holds)."""
    batches = orch.rounds.worker_batches
    return sum(batches.values()), sum(n for rows, n in batches.items() if rows > 2)


def test_staggered_chain_lanes_are_not_merged_on_the_workers(model: Model, addresses: dict[str, str]) -> None:
    with Orchestrator.load(addresses, data_plane="chain", round_lanes=2) as orch:
        assert orch.chain is not None and orch.rounds.stagger
        _measure_stages(model, orch)
        _run_together(model, orch, 4)
        calls, merged = _merged(orch)
        assert calls >= 2 * 3 * 10, orch.rounds.worker_batches  # every hop of every chained step counted
        # the first steps go out before the stages' compute times are known: they may merge
        assert merged <= 2 * len(LAYOUT), orch.rounds.worker_batches
        assert orch.rounds.waited_s > 0
        assert set(orch.rounds._compute_ms) == set(LAYOUT)  # each hop's compute time came back


def test_unstaggered_chain_lanes_never_wait(model: Model, addresses: dict[str, str]) -> None:
    with Orchestrator.load(addresses, data_plane="chain", round_lanes=2) as orch:
        orch.rounds.stagger = False
        _run_together(model, orch, 4)
        calls, _ = _merged(orch)
        assert calls >= 2 * 3 * 10, orch.rounds.worker_batches
        assert orch.rounds.waited_s == 0
        assert orch.rounds._compute_ms == {}  # the staggering EWMA is kept only when staggering
