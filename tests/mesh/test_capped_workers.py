"""A model no single worker could hold (issue 43 item 5): three real ``ethen worker --engine ggml
--max-memory X`` processes, each capped below half the GGUF's size and serving a third of its layers, give
the single process's greedy tokens; a worker asked for more layers than its cap is refused before loading,
naming the sizes; and each worker's resident memory grows, from just before its layers load (the worker logs
its ``VmRSS`` then: :func:`ethen.mesh.worker.memory.resident_bytes`) to after the generation, by at most its
layers' bytes in the file x 1.05 plus its KV cache (the ggml engine reads the weights in place from the
mapped GGUF, :mod:`ethen.model.glayer`; Q4_K matrices are repacked into ggml's CPU_REPACK buffer and the
file's pages they were read from released)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.mesh.worker.memory import fragment_bytes, resident_bytes
from ethen.model import SamplingParams, generate, load_model, model_step, open_weight_store
from ethen.model.choose import EngineOptions
from ethen.model.glayer import GgmlLayer, process_engine
from ethen.model.kv_cache import DEFAULT_INITIAL_CAPACITY
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.mesh.routable import wait_routable

pytest.importorskip("libggml")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
#: 6 layers of ~16 MiB (Q8_0) / ~8.6 MiB (Q4_K); d_model 1024, FFN 4096: big enough that a worker process's
#: own overheads (thread stacks, gRPC, scratch) stay small next to its layers
SHAPE = {"n_layers": 6, "d_model": 1024, "d_ff": 4096, "n_heads": 16, "n_kv_heads": 4, "context_length": 256}
THIRDS = ("0-1", "2-3", "4-5")
SLACK = 1.05
#: what a worker process costs whatever its layers, on top of them (measured, docs/mesh.md): numba's runtime
#: for the attention kernel (40.6 MiB once LLVM's code pages are released, ethen.model.attend.warm), gRPC's
#: server and ggml's graph buffers (~10 MiB). Item 5's bound (layers x 1.05 + KV cache) holds net of it only.
RUNTIME = 64 * 2**20


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    r = tmp_path_factory.mktemp("capped-workers")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(r / "cache"))  # the workers inherit it
    yield r
    mp.undo()


def _file_rss(pid: int, path: Path) -> int:
    """Resident bytes of process ``pid``'s mappings of ``path`` (``/proc/<pid>/smaps``)."""
    total, mine = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):
            mine = rest.rstrip().endswith(str(path))
        elif mine and head == "Rss:":
            total += int(rest.split()[0]) * 1024
    return total


def _resident_before(w: WorkerProcess) -> int:
    for line in w.output:
        m = re.search(r"resident (\d+) bytes before loading layers", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"worker {w.node_id!r} logged no resident size: {w.output[-5:]}")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_three_capped_workers_serve_a_model_none_could_hold(root: Path, kind: str) -> None:
    spec = TinySpec(types=(kind,), embd_type="Q8_0", name=f"capped-{kind}", quantizer="ggml",
                    **SHAPE)  # type: ignore[arg-type]
    path = write_tiny_gguf(root / f"{kind}.gguf", spec)
    size = path.stat().st_size
    store = open_weight_store(path)
    tensors = store.tensors or {}
    cfg = store.config
    need = {layers: fragment_bytes(tensors, [tuple(int(x) for x in layers.split("-"))])  # type: ignore[list-item]
            for layers in THIRDS}
    cap = size * 45 // 100  # below half the file: no worker could hold the model, nor half of it
    assert max(need.values()) <= cap < size // 2
    # a worker asked for more layers than its cap is refused before loading, naming the sizes
    over = fragment_bytes(tensors, [(0, 2)])
    assert over > cap
    out = subprocess.run(
        [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-2", "--model", str(path),
         "--engine", "ggml", "--max-memory", str(cap)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ))
    assert out.returncode == 2 and "READY" not in out.stdout
    assert (f"layers 0-2 hold {over / 2**20:.1f} MiB ({over} bytes) of weights, over --max-memory "
            f"{cap / 2**20:.1f} MiB ({cap} bytes)") in out.stderr

    single = load_model(store, process_engine())  # type: ignore[arg-type]
    assert isinstance(single.stack.layers[0], GgmlLayer)
    ids = single.tokenizer.encode(single.chat_template.render([{"role": "user", "content": "hello mesh"}]))
    expected = generate(model_step(single), single.tokenizer, ids, GREEDY).token_ids
    del single
    workers: list[WorkerProcess] = []
    growth: dict[str, int] = {}
    in_file: dict[str, int] = {}  # the worker's resident pages of the GGUF
    try:
        for node, layers in zip("abc", THIRDS, strict=True):
            workers.append(spawn_worker(node, layers, timeout_s=120, extra_args=[
                "--model", str(path), "--engine", "ggml", "--max-memory", str(cap)]))
        orch = Orchestrator.load({w.node_id: w.address for w in workers}, store,
                                 engine_options=EngineOptions(engine="ggml")).start()
        try:
            wait_routable(orch, len(ids))
            got = orch.generate(ids, GREEDY).result().token_ids
            for w in workers:
                after = resident_bytes(f"/proc/{w.pid}/status")
                assert after is not None
                growth[w.layers] = after - _resident_before(w)
                in_file[w.layers] = _file_rss(w.pid, path)
        finally:
            orch.close()
    finally:
        for w in workers:
            w.stop()
    assert tuple(got) == tuple(expected) and len(expected) >= 1
    positions = len(ids) + GREEDY.max_tokens
    capacity = DEFAULT_INITIAL_CAPACITY
    while capacity < positions:
        capacity *= 2
    capacity = min(capacity, cfg.context_length)
    kv = 2 * 2 * cfg.n_kv_heads * capacity * cfg.head_dim * 4  # K and V, 2 layers, float32
    for layers, grew in growth.items():
        print(f"{kind} {layers}: layers {need[layers]}, grew {grew} ({grew / need[layers]:.2f}x), over "
              f"layers + KV {(grew - need[layers] - kv) / 2**20:.1f} MiB, GGUF pages {in_file[layers]}, "
              f"KV {kv}, file {size}, cap {cap}")
    for layers, grew in growth.items():
        # the weights are held once: read in place from the mapped file (Q8_0), or repacked into ggml's
        # buffer with the file's pages released (Q4_K)
        assert in_file[layers] <= need[layers] * SLACK, (layers, in_file[layers], need[layers])
        if kind == "Q4_K":
            assert in_file[layers] < need[layers] // 10, (layers, in_file[layers])
        assert grew <= need[layers] * SLACK + kv + RUNTIME, (layers, grew, need[layers], kv)
