"""Real ``ethen worker`` processes holding their layers in the GGUF's own blocks (:mod:`ethen.model.qmodel`):
one tiny model per tensor type, two workers, the orchestrator over them; no float32 weight copy is written,
the greedy tokens equal the single-process model's on the same engine, and each is
within 2e-3 of the float64 reference's best logit where it was chosen (the engine's logits are within 1e-3
of the reference, ``tests/model/test_quant_stack.py``); the worker's flags are refused naming bad values."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import SamplingParams, generate, load_model, model_step, open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.mesh.routable import wait_routable
from tests.model.tiny_reference import greedy_gaps, reference_logits

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    r = tmp_path_factory.mktemp("quant-workers")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(r / "cache"))  # the workers inherit it
    yield r
    mp.undo()


@pytest.mark.parametrize("kind", TYPES)
def test_quantized_workers_give_the_single_process_greedy_tokens(root: Path, kind: str) -> None:
    path = write_tiny_gguf(root / f"{kind}.gguf", TinySpec(types=(kind,), embd_type="Q8_0", name=f"t-{kind}"))
    store = open_weight_store(path)
    single = load_model(store)  # the single process, on the engine the workers choose too
    ids = single.tokenizer.encode(single.chat_template.render([{"role": "user", "content": "hello mesh"}]))
    expected = generate(model_step(single), single.tokenizer, ids, GREEDY).token_ids
    gaps = greedy_gaps(reference_logits(path, ids + list(expected)), len(ids), list(expected))
    assert float(gaps.max()) <= 2e-3, gaps  # each token is the float64 reference's, up to the logit error
    workers: list[WorkerProcess] = []
    try:
        for node, layers in (("a", "0-0"), ("b", "1-2")):
            workers.append(spawn_worker(node, layers, extra_args=["--model", str(path)], timeout_s=120))
        orch = Orchestrator.load({w.node_id: w.address for w in workers}, store).start()
        try:
            wait_routable(orch, len(ids))  # bounded: the first Health polls
            got = orch.generate(ids, GREEDY).result().token_ids
            for w in workers:  # the layers are the engine's packed layout, not the GGUF's pages
                maps = Path(f"/proc/{w.process.pid}/maps").read_text()
                assert str(path) not in maps, w.node_id
            assert not list((root / "cache").rglob("*.npy"))  # and no weight copy was written
        finally:
            orch.close()
    finally:
        for w in workers:
            w.stop()
    assert tuple(got) == tuple(expected) and len(expected) >= 1


def _worker_run(path: Path, *extra: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1", "--model", str(path),
         *extra], capture_output=True, text=True, timeout=120, env=env or dict(os.environ))


def test_a_bad_device_is_refused_naming_the_value(root: Path) -> None:
    path = write_tiny_gguf(root / "device.gguf", TinySpec())
    out = _worker_run(path, "--device", "tpu")
    assert out.returncode == 2 and "READY" not in out.stdout
    assert "--device 'tpu': must be one of auto, cpu, cuda, metal, vulkan" in out.stderr


@pytest.mark.parametrize("device", ["metal", "vulkan"])
def test_a_gpu_device_ggml_lacks_is_refused_before_serving(root: Path, device: str) -> None:
    """The libggml-python wheel is a CPU build: ``--device metal`` / ``vulkan`` name the missing backend."""
    from ethen.model.ggml_lib import backends

    if device in backends():
        pytest.skip(f"ggml's {device} backend is installed here (libggml-{device}.so): not the refusal case")
    path = write_tiny_gguf(root / "device.gguf", TinySpec())
    out = _worker_run(path, "--device", device)
    assert out.returncode == 2 and "READY" not in out.stdout
    assert f"device {device!r} needs a libggml build with the" in out.stderr
    assert f"(libggml-{device}.so); the installed ggml backends: cpu" in " ".join(out.stderr.split())


def test_the_ggml_engine_on_a_cuda_device_ggml_lacks_is_refused_before_serving(root: Path) -> None:
    """``--engine ggml --device cuda`` runs on ggml's CUDA backend (ethen/model/gbackend.py): without it,
    the worker names the missing ``libggml-cuda.so``."""
    from ethen.model.ggml_lib import backends

    if "cuda" in backends():
        pytest.skip("ggml's cuda backend is installed here (libggml-cuda.so): not the refusal case")
    path = write_tiny_gguf(root / "device.gguf", TinySpec())
    out = _worker_run(path, "--engine", "ggml", "--device", "cuda")
    assert out.returncode == 2 and "READY" not in out.stdout
    assert ("device 'cuda' needs a libggml build with the CUDA backend (libggml-cuda.so); the installed ggml "
            "backends: cpu") in " ".join(out.stderr.split())


def test_device_cuda_without_a_gpu_is_refused_before_serving(root: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("a CUDA GPU is here: tests/model/test_quant_engine.py runs the cuda path")
    path = write_tiny_gguf(root / "device.gguf", TinySpec())
    out = _worker_run(path, "--device", "cuda")
    assert out.returncode == 2 and "READY" not in out.stdout
    assert "device 'cuda' needs onnxruntime-gpu" in out.stderr


def test_device_cpu_serves_the_quantized_layers(root: Path) -> None:
    path = write_tiny_gguf(root / "device.gguf", TinySpec())
    w = spawn_worker("cpu", "0-1", extra_args=["--model", str(path), "--device", "cpu"], timeout_s=120)
    try:
        assert w.process.poll() is None
        assert not list((root / "cache").rglob("*.npy"))  # the engine's layout, no float32 weight copy
    finally:
        w.stop()


def test_a_bad_thread_pool_or_thread_count_is_refused_naming_the_value(root: Path) -> None:
    path = write_tiny_gguf(root / "pool.gguf", TinySpec())
    for args, said in ((("--thread-pool", "spin"), "--thread-pool 'spin': must be one of session, shared"),
                       (("--thread-pool", "x"), "--thread-pool 'x': must be one of session, shared"),
                       (("--threads", "0"), "--threads 0: must be a positive integer"),
                       (("--threads", "-2"), "--threads -2: must be a positive integer")):
        out = _worker_run(path, *args)
        assert out.returncode == 2 and "READY" not in out.stdout, args
        assert said in out.stderr, (args, out.stderr[-500:])


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/PID/task (Linux)")
def test_a_shared_thread_pool_worker_keeps_one_pool_for_its_sessions(root: Path) -> None:
    """``--thread-pool shared``: one onnxruntime pool for the worker's graphs (``--threads 3``: 2 more
    threads), not one per graph (``session``, what :func:`spawn_worker` gives co-located workers); the same
    tokens. ``--threads 1``: the engine runs on one thread (its shared pool adds none)."""
    path = write_tiny_gguf(root / "pool.gguf", TinySpec(types=("Q4_0",), name="t-pool"))
    store = open_weight_store(path)
    ids = [1, 5, 9, 13]
    counts, tokens, said = {}, {}, {}
    for run, pool, threads in (("session", "session", 3), ("shared", "shared", 3), ("one", "shared", 1)):
        w = spawn_worker(run, "0-2", extra_args=["--model", str(path), "--thread-pool", pool,
                                                 "--threads", str(threads)], timeout_s=120)
        try:
            orch = Orchestrator.load({w.node_id: w.address}, store).start()
            try:
                wait_routable(orch, len(ids))  # bounded: the first Health polls
                tokens[run] = tuple(orch.generate(ids, GREEDY).result().token_ids)
                counts[run] = _threads(w.process.pid)
                said[run] = next(line for line in w.output if "thread(s)" in line)
            finally:
                orch.close()
        finally:
            w.stop()
    assert tokens["shared"] == tokens["session"] == tokens["one"] and len(tokens["shared"]) >= 1
    # 3 layers x 2 graphs, 2 pool threads each (session), against 2 pool threads in all (shared)
    print(f"threads: {counts}")
    assert counts["session"] - counts["shared"] >= 6, counts
    assert counts["shared"] > counts["one"], counts  # a smaller pool (measured 13 vs 12 threads in all)
    assert "3 thread(s), session pool" in said["session"] and "3 thread(s), shared pool" in said["shared"]
    assert "1 thread(s), shared pool" in said["one"], said


def test_a_worker_defaults_to_the_shared_pool_and_co_located_workers_to_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ethen worker``'s ``--thread-pool`` default is ``shared`` (alone on its machine); the workers
    :func:`spawn_worker` starts (``ethen up``, tests, benches) get ``--thread-pool session`` on their command
    line unless the caller's arguments give one; no environment variable carries it."""
    import inspect

    from ethen.mesh.worker.cli import worker
    from ethen.mesh.worker.config import WorkerConfig
    from ethen.mesh.worker.launch import worker_command, worker_env

    assert inspect.signature(worker).parameters["thread_pool"].default.default == "shared"
    assert WorkerConfig("w", [(0, 1)]).thread_pool == "shared" and WorkerConfig("w", [(0, 1)]).threads is None
    cmd = worker_command("w", "0-1", extra_args=["--model", "m.gguf"])
    assert cmd[-4:] == ["--model", "m.gguf", "--thread-pool", "session"]
    for given in (["--thread-pool", "shared"], ["--thread-pool=shared"]):
        cmd = worker_command("w", "0-1", extra_args=given)
        assert cmd[-len(given):] == given and cmd.count("session") == 0, cmd
    for var in ("ETHEN_THREADS", "ETHEN_THREAD_POOL"):
        monkeypatch.delenv(var, raising=False)
    assert not any(k.startswith("ETHEN_THREAD") for k in worker_env())  # none added
    for bad in ({"threads": 0}, {"thread_pool": "spin"}):
        with pytest.raises(ValueError, match="--thread"):
            WorkerConfig("w", [(0, 1)], **bad)  # type: ignore[arg-type]
