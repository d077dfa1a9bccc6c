"""Float32 prefill (always, from :func:`onnx_engine`; ``Engine(long_prefill=True)``): steps of
``PREFILL_ROWS`` rows or more run each layer graph's long variant, whose 8-bit exact-int8 matmuls are one
float32-compute ``MatMulNBits`` over the same weights instead of the int8 split (3 rows per row):
float32 compute's accuracy, 2.1-2.6x faster at 512 rows (``bench/model_decode.py``).
Shorter steps (decode) keep the split."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ethen.model import LayerStack, Model, open_weight_store
from ethen.model.engine import (
    ACCURACY_AUTO,
    ACCURACY_EXACT,
    ACCURACY_EXACT_INT8,
    ACCURACY_FAST,
    PREFILL_ROWS,
    Engine,
    GraphBuilder,
)
from ethen.model.qmodel import QuantLayer, load_quant_layers, onnx_engine
from ethen.model.quant import pack
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.model.test_quant_engine import K, R, _raw
from tests.model.test_quant_stack import exact_ends
from tests.model.tiny_reference import reference_logits


def _graph(kind: str, rng: np.random.Generator) -> tuple[GraphBuilder, np.ndarray]:
    raw = _raw(kind, rng)
    g = GraphBuilder("one-matmul")
    g.node("Identity", [g.linear(g.input("x", K), pack(kind, raw, R, K), ACCURACY_AUTO)], ["y"])
    g.output("y", R)
    w64 = (raw.view(np.float32).astype(np.float64) if kind == "F32"
           else np.asarray(dequantize(raw, GGMLQuantizationType[kind]), np.float64)).reshape(R, K)
    return g, w64


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K"])
def test_the_long_variant_is_one_float32_matmul_over_the_same_weights(kind: str) -> None:
    rng = np.random.default_rng(0)
    g, w64 = _graph(kind, rng)
    long = g.long_variant()
    assert long is not None
    levels = [(n.attrs["bits"], n.attrs["accuracy_level"]) for n in long.nodes if n.op_type == "MatMulNBits"]
    # the int8 split's matmul is gone, one float32-compute 8-bit matmul instead (K-quants keep their min term)
    assert (8, ACCURACY_EXACT) in levels and all(level == ACCURACY_EXACT for _, level in levels), levels
    assert [n.op_type for n in long.nodes].count("Round") == 0  # nor the split itself
    assert (8, ACCURACY_FAST) in [(n.attrs["bits"], n.attrs["accuracy_level"]) for n in g.nodes
                                  if n.op_type == "MatMulNBits"]
    assert long.inits is g.inits  # the same weights, not a copy
    short_s, long_s = Engine("cpu", 1, ACCURACY_AUTO).sessions([g, long])
    x = rng.standard_normal((PREFILL_ROWS + 72, K)).astype(np.float32)
    ref = x.astype(np.float64) @ w64.T
    y_short, y_long = short_s.run(["y"], {"x": x})[0], long_s.run(["y"], {"x": x})[0]
    scale = float(np.abs(ref).max())
    assert float(np.abs(y_long - ref).max()) <= 2e-6 * scale  # float32 compute
    assert float(np.abs(y_short - ref).max()) <= 2e-6 * scale


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "F32"])
def test_graphs_the_variant_would_need_a_second_copy_of_have_none(kind: str) -> None:
    g, _ = _graph(kind, np.random.default_rng(1))
    assert g.long_variant() is None


class _Recorder:
    """A session that records which graph ran and on how many rows."""

    def __init__(self, session: Any, name: str, log: list[tuple[str, int]]) -> None:
        self.session, self.name, self.log = session, name, log

    def run(self, outputs: Any, feeds: dict[str, np.ndarray]) -> Any:
        self.log.append((self.name, int(feeds["x"].shape[0])))
        return self.session.run(outputs, feeds)


@pytest.fixture(scope="module")
def eight_bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(types=("Q8_0", "Q6_K", "Q5_K"), embd_type="Q8_0", n_layers=2, context_length=512,
                    name="tiny-8bit", seed=5)
    return write_tiny_gguf(tmp_path_factory.mktemp("long") / "tiny-8bit.gguf", spec)


def test_a_long_prefill_runs_the_variant_and_matches_the_float64_reference(eight_bit: Path,
                                                                           tmp_path: Path) -> None:
    store = open_weight_store(eight_bit, cache_root=tmp_path / "cache")
    layers = load_quant_layers([(0, store.config.n_layers - 1)], store,
                               Engine("cpu", 1, ACCURACY_AUTO, long_prefill=True))[0]
    assert all(w.attn_in_long is not None and w.attn_out_ffn_long is not None for w in layers)
    log: list[tuple[str, int]] = []
    rec = [dataclasses.replace(
        w, attn_in=_Recorder(w.attn_in, "short", log), attn_out_ffn=_Recorder(w.attn_out_ffn, "short", log),
        attn_in_long=_Recorder(w.attn_in_long, "long", log),
        attn_out_ffn_long=_Recorder(w.attn_out_ffn_long, "long", log)) for w in layers]
    stack = LayerStack(store.config, rec)
    ends = exact_ends(store)
    tok = open_weight_store(eight_bit, cache_root=tmp_path / "cache")
    ids = [int(i) for i in np.random.default_rng(2).integers(3, store.config.vocab_size, PREFILL_ROWS + 22)]
    from ethen.model import load_model

    base = load_model(tok)
    m = Model(store.config, ends, stack, base.tokenizer, base.chat_template)
    kv = m.new_kv_cache()
    ours = m.logits(ids, kv, all_positions=True)  # [T, V]
    assert {name for name, _ in log} == {"long"} and all(n == len(ids) for _, n in log)
    ref = reference_logits(eight_bit, ids)
    assert ref.std() > 0.3
    assert float(np.abs(ours - ref).max()) <= 1e-3
    log.clear()
    m.logits([5], kv)  # a decode step after it keeps the int8 split
    assert {name for name, _ in log} == {"short"}


def test_without_the_option_no_variant_is_built(eight_bit: Path, tmp_path: Path) -> None:
    store = open_weight_store(eight_bit, cache_root=tmp_path / "cache")
    layers = load_quant_layers([(0, 0)], store, Engine("cpu", 1, ACCURACY_EXACT_INT8))[0]
    assert isinstance(layers[0], QuantLayer)
    assert layers[0].attn_in_long is None and layers[0].attn_out_ffn_long is None


def test_float32_prefill_is_unconditional(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ETHEN_PREFILL`` is gone: the engine always builds the long variants, whatever the variable says."""
    for value in ("int8", "fp32"):
        monkeypatch.setenv("ETHEN_PREFILL", value)
        assert onnx_engine(threads=1).long_prefill is True
    monkeypatch.delenv("ETHEN_PREFILL")
    assert onnx_engine(threads=1).long_prefill is True


MEMORY_PROBE = """
import ctypes, json, sys
from pathlib import Path
import numpy as np
from ethen.model import open_weight_store
from ethen.model.attend import warm
from ethen.model.engine import ACCURACY_AUTO, Engine
from ethen.model.qmodel import load_quant_layers

def anon():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024

store = open_weight_store(Path(sys.argv[1]), cache_root=Path(sys.argv[2]))
warm()
before = anon()
layers = load_quant_layers([(0, store.config.n_layers - 1)], store,
                           Engine("cpu", 1, ACCURACY_AUTO, long_prefill=sys.argv[3] == "1"))
print(json.dumps({"anon": anon() - before,
                  "file": sum(t.nbytes for n, t in store.tensors.items() if n.startswith("blk."))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup (Linux)")
def test_the_long_variants_cost_almost_no_memory(tmp_path: Path) -> None:
    """The variants read their 8-bit weights in place from the backing file (``Engine.session``'s ONNX
    external data). Given as ``add_external_initializers`` values instead, onnxruntime copied them: +98 MiB
    for 8 layers of 91 MiB in the file (measured), against ~2 MiB now."""
    spec = TinySpec(types=("Q8_0",), embd_type="Q8_0", n_layers=3, d_model=1024, n_heads=16, n_kv_heads=4,
                    d_ff=2816, context_length=512, name="mid-q8")
    path = write_tiny_gguf(tmp_path / "mid-q8.gguf", spec)
    got = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache"), flag],
                             capture_output=True, text=True, timeout=300, check=True)
        got[flag] = json.loads(out.stdout.strip().splitlines()[-1])
    extra = got["1"]["anon"] - got["0"]["anon"]
    print(f"anonymous memory: {got['0']['anon'] / 2**20:.1f} MiB without the variants, "
          f"{got['1']['anon'] / 2**20:.1f} MiB with them ({got['0']['file'] / 2**20:.1f} MiB in the file)")
    assert extra <= 0.15 * got["0"]["file"]
