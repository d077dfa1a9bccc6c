"""``ethen worker --model PATH.gguf``: real worker processes serving a user's GGUF (tiny random-weight
``qwen2`` and ``llama`` models written with ``gguf.GGUFWriter``), the orchestrator over them, and the
refusals at load.

The mesh's greedy output equals the single-process model's; a worker given an unsupported file exits with
the reason before it prints READY (no port opens)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ethen.gateway.config import MeshProviderConfig
from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import SamplingParams, generate, load_model, model_step, open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.mesh.routable import wait_routable

SPECS = {
    "qwen2": TinySpec(arch="qwen2", types=("Q8_0", "Q4_K", "Q6_K"), output_type="Q5_K", n_kv_heads=1,
                      name="tiny-qwen2"),
    "llama": TinySpec(types=("Q4_1", "BF16", "Q5_K"), embd_type="Q4_0", tokenizer="llama", name="tiny-llama"),
    # every layer matrix Q8_0
    "llama-q8_0": TinySpec(types=("Q8_0",), embd_type="Q8_0", name="tiny-llama-q8_0"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("mesh-model-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the workers inherit it
    yield root
    mp.undo()


@pytest.mark.parametrize("name", list(SPECS))
def test_real_workers_serve_the_given_gguf(cache: Path, name: str) -> None:
    path = write_tiny_gguf(cache / f"{name}.gguf", SPECS[name])
    store = open_weight_store(path)  # built once here; the workers map it
    single = load_model(store)
    ids = single.tokenizer.encode(single.chat_template.render([{"role": "user", "content": "hello mesh"}]))
    expected = generate(model_step(single), single.tokenizer, ids, GREEDY).token_ids
    workers: list[WorkerProcess] = []
    try:
        for node, layers in (("a", "0-0"), ("b", "1-2")):
            workers.append(spawn_worker(node, layers, extra_args=["--model", str(path)], timeout_s=120))
        orch = Orchestrator.load({w.node_id: w.address for w in workers}, store).start()
        try:
            wait_routable(orch, len(ids))  # bounded: the first Health polls
            got = orch.generate(ids, GREEDY).result().token_ids
        finally:
            orch.close()
    finally:
        for w in workers:
            w.stop()
    assert tuple(got) == tuple(expected) and len(expected) >= 1


def test_worker_refuses_an_unsupported_model_before_serving(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(arch="mamba"))
    out = subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1", "--model", str(path)],
        capture_output=True, text=True, timeout=120, env={**os.environ,
                                                 "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 2
    assert "READY" not in out.stdout
    assert "general.architecture = 'mamba' is not supported" in out.stderr


def test_mesh_provider_config_takes_a_model_path() -> None:
    p = MeshProviderConfig.model_validate(
        {"id": "mesh", "kind": "mesh", "workers": {"a": "127.0.0.1:5000"}, "model_path": "/m/x.gguf"})
    assert p.model_path == "/m/x.gguf"
    assert MeshProviderConfig.model_validate(
        {"id": "mesh", "kind": "mesh", "workers": {"a": "127.0.0.1:5000"}}).model_path is None
