"""Q8_0 layers decoded on block kernels over the mapped GGUF (:mod:`ethen.model.klayer`): where they apply,
their numerics against the float64 reference (llama's permuted Q/K rows, qwen2's biases), batched rounds,
the hand-off to the float32 graphs for longer steps, and the memory they save (no prepacked copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ethen.model import EmbedAndHead, LayerStack, Model, WeightStore, load_model, open_weight_store
from ethen.model.engine import ACCURACY_AUTO, ACCURACY_EXACT, ACCURACY_EXACT_INT8, ACCURACY_FAST, Engine
from ethen.model.errors import ModelInputError
from ethen.model.heap import mapped_rss
from ethen.model.klayer import KERNEL_ROWS, layer_kernel_mode
from ethen.model.qmodel import QuantLayer, load_quant_layers
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.model.conftest import Tiny
from tests.model.tiny_reference import reference_logits

CHAT = [{"role": "user", "content": "hello world, the mesh is a model of layers"}]
Q8_SPECS = {
    "llama": TinySpec(types=("Q8_0",), embd_type="Q8_0", name="tiny-q8-llama"),
    "qwen2": TinySpec(arch="qwen2", types=("Q8_0",), embd_type="Q8_0", n_kv_heads=1, name="tiny-q8-qwen2"),
}


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, WeightStore]]:
    root = tmp_path_factory.mktemp("q8-gguf")
    out = {}
    for name, spec in Q8_SPECS.items():
        path = write_tiny_gguf(root / f"{name}.gguf", spec)
        out[name] = (path, open_weight_store(path, cache_root=root / "cache"))
    return out


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_LAYER_KERNEL", "on")  # (opt-in: off by default)


def _layers(store: WeightStore, accuracy: int = ACCURACY_AUTO, long_prefill: bool = True) -> list[QuantLayer]:
    return load_quant_layers([(0, store.config.n_layers - 1)], store, Engine("cpu", 1, accuracy,
                                                                              long_prefill=long_prefill))[0]


def _model(store: WeightStore, layers: list[QuantLayer]) -> Model:
    base = load_model(store)
    ends = EmbedAndHead(store.config, store.load_token_embeddings(), store.load_output_norm(),
                        store.load_output_head(), store.load_output_head_t())
    return Model(store.config, ends, LayerStack(store.config, layers), base.tokenizer, base.chat_template)


@pytest.mark.parametrize("name", list(Q8_SPECS))
def test_q8_0_layers_decode_on_the_kernels_within_1e_4_of_float64(
        q8_models: dict[str, tuple[Path, WeightStore]], name: str) -> None:
    path, store = q8_models[name]
    layers = _layers(store)
    assert all(w.kernel is not None for w in layers)
    m = _model(store, layers)
    ids = m.tokenizer.encode(m.chat_template.render(CHAT))
    assert len(ids) > KERNEL_ROWS
    ref = reference_logits(path, ids)
    assert ref.std() > 0.3
    kv = m.new_kv_cache()
    steps = np.concatenate([m.logits(ids[i:i + 1], kv, all_positions=True) for i in range(len(ids))])
    assert float(np.abs(steps - ref).max()) <= 1e-4, name  # one row a step: the kernels
    whole = m.logits(ids, m.new_kv_cache(), all_positions=True)  # one long step: the float32 graphs
    assert float(np.abs(whole - ref).max()) <= 1e-4, name


@pytest.mark.parametrize(("accuracy", "long_prefill", "mode", "kernels"), [
    (ACCURACY_AUTO, True, "on", True),
    (ACCURACY_EXACT, True, "on", True),
    (ACCURACY_AUTO, True, "", False),  # (the default: off)
    (ACCURACY_AUTO, True, "off", False),
    (ACCURACY_EXACT_INT8, True, "on", False),
    (ACCURACY_FAST, True, "on", False),
    (ACCURACY_AUTO, False, "on", False),
])
def test_the_kernels_run_only_where_asked(q8_models: dict[str, tuple[Path, WeightStore]],
                                          monkeypatch: pytest.MonkeyPatch, accuracy: int, long_prefill: bool,
                                          mode: str, kernels: bool) -> None:
    monkeypatch.setenv("ETHEN_LAYER_KERNEL", mode)
    layers = _layers(q8_models["llama"][1], accuracy, long_prefill)
    assert [w.kernel is not None for w in layers] == [kernels] * len(layers)


def test_a_layer_of_mixed_types_keeps_the_engine_graphs(tiny_models: dict[str, Tiny]) -> None:
    assert not any(w.kernel is not None for w in _layers(tiny_models["llama-mixed"].store))


def test_a_bad_layer_kernel_mode_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_LAYER_KERNEL", "fast")
    with pytest.raises(ModelInputError, match="ETHEN_LAYER_KERNEL = 'fast'"):
        layer_kernel_mode()


def test_a_batched_round_equals_each_session_alone(q8_models: dict[str, tuple[Path, WeightStore]]) -> None:
    store = q8_models["llama"][1]
    stack = LayerStack(store.config, _layers(store))
    d = store.config.d_model
    rng = np.random.default_rng(1)
    prefixes = [rng.standard_normal((t, d)).astype(np.float32) for t in (3, 5, 2)]
    step = rng.standard_normal((len(prefixes), d)).astype(np.float32)
    kvs, alone = [], []
    for i, p in enumerate(prefixes):
        kv = stack.new_kv_cache()
        stack.forward(p, np.arange(len(p)), kv)
        kvs.append(kv)
        single = stack.new_kv_cache()
        stack.forward(p, np.arange(len(p)), single)
        alone.append(stack.forward(step[i:i + 1], [len(p)], single))
    together = stack.forward_batch(step, [len(p) for p in prefixes], kvs)
    np.testing.assert_array_equal(together, np.concatenate(alone))  # row by row the same arithmetic


def test_a_longer_step_runs_the_float32_graphs_and_releases_their_pages(
        q8_models: dict[str, tuple[Path, WeightStore]]) -> None:
    store = q8_models["llama"][1]
    stack = LayerStack(store.config, _layers(store))
    x = np.random.default_rng(2).standard_normal((KERNEL_ROWS + 4, store.config.d_model)).astype(np.float32)
    rows = stack.new_kv_cache()
    one_by_one = np.concatenate([stack.forward(x[i:i + 1], [i], rows) for i in range(len(x))])
    assert mapped_rss(store.directory / "engine") == 0  # the kernels read the GGUF, not the engine files
    long = stack.forward(x, np.arange(len(x)), stack.new_kv_cache())  # the graphs
    np.testing.assert_allclose(long, one_by_one, rtol=0, atol=2e-5 * float(np.abs(one_by_one).max()))
    assert mapped_rss(store.directory / "engine") == 0  # released after the step (model.LayerStack)


MEMORY_PROBE = """
import json, sys
from pathlib import Path
import numpy as np
import onnxruntime
from ethen.model import load_layer_stacks, open_weight_store
from ethen.model.attend import warm
from ethen.model.klayer import _kernels as layer_kernels
from ethen.model.qhead import _kernels

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

store = open_weight_store(Path(sys.argv[1]), cache_root=Path(sys.argv[2]), weights="quantized")
onnxruntime.InferenceSession  # noqa: B018  (its own start-up memory is not the weights')
warm()
_kernels()  # nor is numba's runtime, or a JIT compile (a fresh clone has no numba cache yet)
layer_kernels()
before = anon()
(stack,) = load_layer_stacks([(0, store.config.n_layers - 1)], store)
loaded = anon() - before
stack.forward(np.ones((1, stack.config.d_model), np.float32), [0], stack.new_kv_cache())
file = sum(t.nbytes for n, t in store.tensors.items() if n.startswith("blk."))
print(json.dumps({"loaded": loaded, "file": file, "nbytes": stack.nbytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_kernel_layers_hold_no_prepacked_copy(tmp_path: Path) -> None:
    """Issue 24's memory target for Q8_0: onnxruntime's int8 layout of the blocks (``ETHEN_LAYER_KERNEL=off``,
    the default) is prepacked into anonymous memory at 40 bytes per 34-byte block; the kernel layers hold
    the int8 quants and float32 scales (36 bytes per block), and onnxruntime prepacks nothing."""
    spec = TinySpec(types=("Q8_0",), embd_type="Q8_0", n_layers=4, d_model=1024, n_heads=8, n_kv_heads=2,
                    d_ff=2816, name="q8-memory")
    path = write_tiny_gguf(tmp_path / "q8.gguf", spec)
    got = {}
    for mode in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache")],
                             capture_output=True, text=True, timeout=300, check=True,
                             env={**os.environ, "ETHEN_LAYER_KERNEL": mode, "ETHEN_THREADS": "1"})
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    file = got["on"]["file"]
    print({k: {f: round(v / file, 3) for f, v in g.items()} for k, g in got.items()})
    assert got["on"]["nbytes"] <= 1.07 * file  # int8 quants + float32 scales: 36 / 34
    assert got["on"]["loaded"] <= 1.2 * file  # those, and the sessions' own state
    assert got["on"]["loaded"] + 0.1 * file <= got["off"]["loaded"]  # (the int8 layout, prepacked: 40 / 34)
