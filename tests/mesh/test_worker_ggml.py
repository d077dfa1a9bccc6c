"""Real ``ethen worker --engine ggml`` processes (:mod:`ethen.model.glayer`: llama.cpp's kernels over the
mapped GGUF) for tiny models of several tensor types, the orchestrator over them (its head on ggml too):
the greedy tokens equal the single process's on the ggml engine (whose logits are within the stated
tolerance of the float64 reference: ``tests/model/test_ggml_engine.py``); the workers map the GGUF itself
and no cache file; a bad ``--engine`` / ``--accuracy`` is refused naming the value."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import SamplingParams, generate, load_model, model_step, open_weight_store
from ethen.model.choose import EngineOptions
from ethen.model.glayer import GgmlLayer, process_engine
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.mesh.routable import wait_routable

pytest.importorskip("libggml")

TYPES = ("Q4_K", "Q8_0", "Q6_K", "Q5_0", "Q3_K", "IQ4_XS", "F16")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    r = tmp_path_factory.mktemp("ggml-workers")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(r / "cache"))  # the workers inherit it
    yield r
    mp.undo()


@pytest.mark.parametrize("kind", TYPES)
def test_ggml_workers_give_the_single_process_greedy_tokens(root: Path, kind: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TinySpec(arch="qwen2" if kind == "Q8_0" else "llama", types=(kind,), embd_type="Q6_K",
                    name=f"t-{kind}", quantizer="ggml")
    path = write_tiny_gguf(root / f"{kind}.gguf", spec)
    store = open_weight_store(path)
    single = load_model(store, process_engine())  # type: ignore[arg-type]
    assert isinstance(single.stack.layers[0], GgmlLayer)
    ids = single.tokenizer.encode(single.chat_template.render([{"role": "user", "content": "hello mesh"}]))
    expected = generate(model_step(single), single.tokenizer, ids, GREEDY).token_ids
    monkeypatch.setenv("ETHEN_ENGINE", "ggml")  # worker b: the default of its --engine
    workers: list[WorkerProcess] = []
    try:
        for node, layers, extra in (("a", "0-0", ["--engine", "ggml"]), ("b", "1-2", [])):
            workers.append(spawn_worker(node, layers, extra_args=["--model", str(path), *extra],
                                        timeout_s=120))
        orch = Orchestrator.load({w.node_id: w.address for w in workers}, store,
                                 engine_options=EngineOptions(engine="ggml")).start()
        try:
            assert orch.rounds.lanes == 2  # a model on ggml: two decode-round lanes (default_round_lanes)
            wait_routable(orch, len(ids))  # bounded: the first Health polls
            got = orch.generate(ids, GREEDY).result().token_ids
            if kind == "Q4_K":  # concurrent sessions in two lanes: each the single process's tokens
                with ThreadPoolExecutor(4) as pool:
                    runs = list(pool.map(lambda _: orch.generate(ids, GREEDY).result().token_ids, range(4)))
                assert all(tuple(r) == tuple(expected) for r in runs)
            for w in workers:  # the layers are the GGUF's own pages: no engine file, no weight copy
                maps = Path(f"/proc/{w.process.pid}/maps").read_text()
                assert str(path) in maps and "/engine/" not in maps, w.node_id
                assert "libggml-cpu" in maps, w.node_id
        finally:
            orch.close()
    finally:
        for w in workers:
            w.stop()
    assert tuple(got) == tuple(expected) and len(expected) >= 1


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--engine", "tpu", "--engine 'tpu': must be one of auto, ggml, onnx"),
    ("--accuracy", "exact-int4", "--accuracy 'exact-int4': must be one of auto, exact, fast")])
def test_a_bad_engine_or_accuracy_is_refused_naming_the_value(root: Path, flag: str, value: str,
                                                              message: str) -> None:
    path = write_tiny_gguf(root / "bad.gguf", TinySpec())
    out = subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1", "--model", str(path),
         flag, value], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2 and "READY" not in out.stdout
    assert message in out.stderr


def test_max_memory_refuses_layers_over_it_before_loading(root: Path) -> None:
    from ethen.mesh.worker.memory import fragment_bytes, parse_size

    path = write_tiny_gguf(root / "mem.gguf", TinySpec(types=("Q8_0",), embd_type="Q8_0"))
    need = fragment_bytes(open_weight_store(path).tensors or {}, [(0, 1)])
    assert parse_size("1.5K") == 1500 and parse_size("2MiB") == 2 * 2**20 and parse_size("77") == 77
    out = subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1", "--model", str(path),
         "--max-memory", str(need - 1)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2 and "READY" not in out.stdout
    want = f"layers 0-1 hold {need / 2**20:.1f} MiB ({need} bytes) of weights, over --max-memory"
    assert want in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1", "--model", str(path),
         "--max-memory", "12 parsecs"], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2 and "--max-memory '12 parsecs': use a positive size" in out.stderr
    w = spawn_worker("fits", "0-1", extra_args=["--model", str(path), "--max-memory", str(need)],
                     timeout_s=120)
    w.stop()
