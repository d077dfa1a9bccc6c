"""The worker-to-worker chain across three namespaced hosts (root; skips with the reason otherwise).

Each worker sits behind a relay holding every chunk 5 ms each way, and so does the orchestrator's chain
receiver (a relay in the root namespace), so worker-to-worker calls and deliveries cross real (delayed)
links between network namespaces. Greedy output equals the single-process reference, and a middle worker
that stops making progress (SIGSTOP) or is cut off (``ip link set down``) mid-generation fails over at the
progress deadline with 0 tokens lost.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from ethen.mesh.orchestrator import Orchestrator, plan_route
from ethen.model import Model, SamplingParams, generate, load_model, model_step
from tests.mesh.netns import Hosts, unavailable_reason

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

LAYOUT = {"a": "0-9", "b": "10-19", "c": "10-19,20-29"}
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
LONG = SamplingParams(temperature=0.0, max_tokens=24)
DELAY_MS = 5.0


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def ids(model: Model) -> list[int]:
    return model.tokenizer.encode(model.chat_template.render(PROMPT, add_generation_prompt=True))


@pytest.fixture(scope="module")
def reference(model: Model, ids: list[int]) -> tuple[int, ...]:
    return generate(model_step(model), model.tokenizer, ids, LONG, model.config.context_length).token_ids


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(len(LAYOUT))
    try:
        for i, (node, layers) in enumerate(LAYOUT.items()):
            made[i].start(node, layers, delay_ms=DELAY_MS)
        yield made
    finally:
        made.close()


def _chain_orchestrator(hosts: Hosts) -> Orchestrator:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    relay = hosts.root_relay(port, DELAY_MS)
    return Orchestrator.load({node: hosts[i].address for i, node in enumerate(LAYOUT)}, data_plane="chain",
                             chain_listen=f"127.0.0.1:{port}", chain_advertise=relay.address,
                             progress_timeout_s=2.0, forward_timeout_s=30.0)


@pytest.mark.parametrize("fault", ["sigstop", "partition"])
def test_chain_across_hosts_matches_the_reference_and_survives_a_stuck_middle_worker(
        hosts: Hosts, ids: list[int], reference: tuple[int, ...], fault: str) -> None:
    with _chain_orchestrator(hosts) as orch:
        assert orch.chain is not None
        deadline = time.monotonic() + 30
        while not all(s.alive for s in orch.states()) and time.monotonic() < deadline:
            time.sleep(0.05)
        states = [replace(s, served_layers=((20, 29),)) if s.node_id == "c" else s for s in orch.states()]
        route = plan_route(states, 30, len(ids), orch.weights, orch.model_name)
        assert route.nodes == ("a", "b", "c")
        assert orch.generate(ids, LONG, route=route).result().token_ids == reference
        clean = orch.chain.delivered
        assert clean >= len(reference) - 2  # the decode went worker to worker through the relays
        gen = orch.generate(ids, LONG, route=route)
        tokens: list[int] = []
        stamps: list[float] = []
        for chunk in gen:
            if chunk.token_id is not None:
                tokens.append(chunk.token_id)
                stamps.append(time.monotonic())
                if len(tokens) == 5:
                    hosts[1].stop_worker() if fault == "sigstop" else hosts[1].partition()
        assert tuple(tokens) == reference  # no token lost
        assert [f.failed_node for f in gen.session.failovers] == ["b"]
        assert gen.route.nodes == ("a", "c")
        stall = max(y - x for x, y in itertools.pairwise(stamps))
        assert stall < 2.0 * 1.25 + 0.25 + 3.0, f"longest gap between tokens {stall:.2f} s"
        assert orch.chain.delivered > clean + 5  # after the failover the decode went on chained (a -> c)
