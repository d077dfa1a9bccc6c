"""Long prompts through the mesh in steps of at most the workers' ``max_prefill_tokens`` (issue 10, item 15).

Real model, real gRPC workers on 127.0.0.1 whose cap is 8 rows per ``Forward``: the orchestrator prefills a
prompt several times longer in pieces, greedy output equals the single-process model fed the same pieces, and
a failover's one-call replay (``exact_replay=False``) is cut to the cap too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, parse_fragments, serve
from ethen.model import Model, SamplingParams, generate, load_model
from ethen.model.generate import StepFn

CAP = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class CappedWorker:
    def __init__(self, node_id: str, layers: str) -> None:
        fragments = parse_fragments(layers)
        self.service = WorkerService(WorkerConfig(node_id, fragments, max_prefill_tokens=CAP),
                                     ModelBackend.load(fragments))
        self.server, port = serve(self.service, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)
        self.service.stop()


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


def _pieces_step(model: Model, n: int) -> StepFn:
    """The single-process model fed in pieces of at most ``n`` tokens (as the orchestrator feeds the mesh)."""
    kv = model.new_kv_cache()

    def step(ids: Sequence[int]) -> NDArray[np.float32]:
        ids = list(ids)
        for a in range(0, len(ids) - n, n):
            model.logits(ids[a : a + n], kv)
        return model.logits(ids[(len(ids) - 1) // n * n :], kv)

    return step


def _mesh(layout: dict[str, str], **kwargs: Any) -> tuple[Orchestrator, dict[str, CappedWorker]]:
    workers = {node: CappedWorker(node, layers) for node, layers in layout.items()}
    addresses = {n: w.address for n, w in workers.items()}
    orch = Orchestrator.load(addresses, max_step_tokens=CAP, **kwargs).start()
    return orch, workers


def test_a_prompt_longer_than_the_cap_is_prefilled_in_pieces(model: Model) -> None:
    orch, workers = _mesh({"a": "0-14", "b": "15-29"})
    try:
        ids = orch.chat_prompt(MESSAGES)
        assert len(ids) > 3 * CAP
        gen = orch.generate(ids, GREEDY)
        out = gen.result()
        n_pieces = -(-len(ids) // CAP)
        assert gen.session.chunks[:n_pieces] == [CAP] * (n_pieces - 1) + [len(ids) - CAP * (n_pieces - 1)]
        ref = generate(_pieces_step(model, CAP), model.tokenizer, ids, GREEDY, model.config.context_length)
        assert out.token_ids == ref.token_ids
        assert "Paris" in out.text
    finally:
        orch.close()
        for w in workers.values():
            w.close()


def test_a_one_call_replay_after_a_failover_is_cut_to_the_cap(model: Model) -> None:
    orch, workers = _mesh({"a": "0-14", "b": "15-29", "c": "15-29"}, exact_replay=False)
    try:
        ids = orch.chat_prompt(MESSAGES)
        gen = orch.generate(ids, GREEDY)
        tokens = 0
        for chunk in gen:
            if chunk.token_id is not None:
                tokens += 1
            if tokens == 3 and not gen.session.failovers:
                workers[gen.route.stages[-1].node_id].close()  # the stage 15-29 dies mid-generation
        assert len(gen.session.failovers) == 1
        assert gen.session.replayed_positions >= len(ids) + 2  # the whole history went to the replica
        assert gen.finish_reason is not None and len(gen.token_ids) >= 3
    finally:
        orch.close()
        for w in workers.values():
            w.close()
