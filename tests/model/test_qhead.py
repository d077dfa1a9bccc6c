"""The logits head's block kernels (:mod:`ethen.model.qhead`) over the GGUF's blocks read in place: each
kernel type against a float64 dequantized reference on tiny models, row counts and vocabulary ranges
against the whole, the fallback types, the automatic choice, the on-disk JIT cache in a fresh process, and
greedy text on the real model identical to the float64 reference's (``tiny_reference``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.mesh.orchestrator.head import SplitHead
from ethen.model import (
    ModelInputError,
    SamplingParams,
    WeightStore,
    find_gguf_path,
    generate_chat,
    load_model,
)
from ethen.model.choose import EngineOptions
from ethen.model.qhead import AUTO_TYPES, KERNEL_TYPES, BlockHead, build_block_head
from ethen.model.qmodel import QuantEmbedAndHead, _Tensors, onnx_engine
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.model.conftest import Tiny
from tests.model.tiny_reference import greedy_gaps, reference_logits

BANNER = [{"role": "user", "content": "What is the capital of France?"}]
#: the kernel's type and types whose heads keep the engine graph (their kernels were removed: slower)
ENGINE_TYPES = (*KERNEL_TYPES, "Q4_0", "Q4_1", "Q6_K")


def _tiny(tmp: Path, kind: str, tied: bool) -> WeightStore:
    from ethen.model import open_weight_store

    spec = TinySpec(types=("Q8_0",), embd_type=kind if tied else "F32", output_type=None if tied else kind,
                    n_layers=1, name=f"tiny-head-{kind}", seed=11)
    path = write_tiny_gguf(tmp / f"head-{kind}-{tied}.gguf", spec)
    return open_weight_store(path, cache_root=tmp / "cache")


def _reference(store: WeightStore, hidden: np.ndarray) -> np.ndarray:
    """float64: RMSNorm, then the head's dequantized weights (``gguf.quants``)."""
    t = _Tensors(store)
    name = "output.weight" if "output.weight" in t.table else "token_embd.weight"
    info = t.info(name)
    w = t.f32(name).astype(np.float64).reshape(info.rows, info.cols)
    h = hidden.astype(np.float64)
    h = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + store.config.rms_eps)
    return np.asarray((h * t.f32("output_norm.weight").astype(np.float64)) @ w.T)


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], WeightStore]:
    tmp = tmp_path_factory.mktemp("qhead")
    return {(k, tied): _tiny(tmp, k, tied) for k in ENGINE_TYPES for tied in (True, False)}


def _head(store: WeightStore, accuracy: str = "exact") -> QuantEmbedAndHead:
    """The head at ``accuracy`` (default ``exact``: the engine would compute a Q8_0 head in float32, so the
    kernel runs it)."""
    return QuantEmbedAndHead(store, onnx_engine(accuracy=accuracy))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "output.weight"])
@pytest.mark.parametrize("kind", KERNEL_TYPES)
def test_block_kernel_logits_match_the_float64_reference(tiny_heads: dict[tuple[str, bool], WeightStore],
                                                         kind: str, tied: bool) -> None:
    store = tiny_heads[(kind, tied)]
    ends = _head(store)
    assert ends.block_head is not None and ends.block_head.kind == kind == ends.head_kind
    hidden = np.random.default_rng(1).standard_normal((5, store.config.d_model)).astype(np.float32) * 3
    want = _reference(store, hidden)
    got = ends.logits(hidden)
    assert got.shape == want.shape and got.dtype == np.float32
    assert float(np.abs(want).max()) > 0.5
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()) + 1e-6)
    # the head's memory is its float32 scales, not a copy of the weights (one per 32 weights)
    assert ends.nbytes == store.config.vocab_size * store.config.d_model // 32 * 4


@pytest.mark.parametrize("kind", KERNEL_TYPES)
def test_every_row_count_gives_each_rows_one_row_logits(tiny_heads: dict[tuple[str, bool], WeightStore],
                                                         kind: str) -> None:
    """Q8_0 runs groups of 4, 2 and 1 rows through different kernels: a row's logits are the same bits
    whatever came with it (a batched round and a lone session agree)."""
    bh = _head(tiny_heads[(kind, True)]).block_head
    assert bh is not None
    h = np.random.default_rng(2).standard_normal((11, bh.cols)).astype(np.float32)
    single = np.concatenate([bh(h[i:i + 1]) for i in range(11)])
    for n in (1, 2, 3, 4, 5, 7, 8, 11):
        assert np.array_equal(bh(h[:n]), single[:n]), n


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 10**6), max_size=4), rows=st.integers(1, 9))
def test_any_vocabulary_ranges_fill_the_whole(tiny_heads: dict[tuple[str, bool], WeightStore],
                                              cuts: list[int], rows: int) -> None:
    """``matmul_into`` over any cover of ``[0, V)`` by ranges = one call over the whole (the brute-force
    oracle is the unsplit call)."""
    bh = _head(tiny_heads[("Q8_0", True)]).block_head
    assert bh is not None
    v = bh.rows
    edges = sorted({0, v, *(c % (v + 1) for c in cuts)})
    h = np.random.default_rng(rows).standard_normal((rows, bh.cols)).astype(np.float32)
    out = np.full((rows, v), np.nan, np.float32)
    for a, b in itertools.pairwise(edges):
        bh.matmul_into(h, out, a, b)
    assert np.array_equal(out, bh(h))


def test_auto_runs_the_kernel_for_q8_0_at_float32_compute_only(
        tiny_heads: dict[tuple[str, bool], WeightStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default: the engine graph wherever the engine runs the head on its int8 kernel (``--accuracy``
    auto, the default, for 8-bit blocks: exact-int8; or fast), which measured faster than the kernels at 1-8
    rows; the kernel for Q8_0 at ``exact`` accuracy (the engine's float32 compute over nibble halves is
    slower there); the engine for Q4_0 / Q4_1 / Q6_K (onnxruntime's path is faster: 4-bit; Q6_K from 2
    rows on)."""
    assert AUTO_TYPES == ("Q8_0",)
    monkeypatch.setenv("ETHEN_ACCURACY", "exact")  # not read: the engine given decides
    assert QuantEmbedAndHead(tiny_heads[("Q8_0", False)]).block_head is None  # auto: exact-int8 engine
    assert _head(tiny_heads[("Q8_0", False)], "fast").block_head is None
    assert _head(tiny_heads[("Q8_0", False)]).block_head is not None
    for kind in ("Q4_0", "Q4_1", "Q6_K"):
        assert _head(tiny_heads[(kind, True)]).block_head is None
    assert _head(tiny_heads[("Q8_0", True)]).block_head is not None
    head = _head(tiny_heads[("Q8_0", True)], "auto")
    assert head.block_head is None
    h = np.random.default_rng(4).standard_normal((3, head.config.d_model)).astype(np.float32)
    want = _reference(tiny_heads[("Q8_0", True)], h)
    np.testing.assert_allclose(head.logits(h), want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


def test_packed_bits_table_is_what_pack_writes() -> None:
    from ethen.model.quant import BYTES_PER_BLOCK, PACKED_BITS, QUANT_TYPES, NBits, pack

    assert set(PACKED_BITS) == set(QUANT_TYPES)
    for kind, bits in PACKED_BITS.items():
        block, nbytes = BYTES_PER_BLOCK[kind]
        m = pack(kind, np.zeros((2, nbytes), np.uint8), 2, block)
        assert isinstance(m, NBits) and m.bits == bits, kind


def test_types_without_a_kernel_keep_the_engine_graph(tiny_models: dict[str, Tiny],
                                                      tmp_path: Path) -> None:
    q4k_store = _tiny(tmp_path, "Q4_K", tied=False)  # Q4_K output.weight
    q4k = _head(q4k_store)
    f16 = _head(tiny_models["llama-spm-ropefreqs"].store)  # F16 output.weight
    assert q4k.block_head is None and q4k.head_kind == "Q4_K"
    assert f16.block_head is None and f16.head_kind == "F16"
    h = np.random.default_rng(3).standard_normal((2, q4k.config.d_model)).astype(np.float32)
    want = _reference(q4k_store, h)
    np.testing.assert_allclose(q4k.logits(h), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    assert build_block_head("Q4_K", np.zeros((4, 144), np.uint8), 4, 256) is None
    with pytest.raises(ValueError, match="no head kernel for Q4_K"):
        BlockHead("Q4_K", np.zeros((4, 144), np.uint8), 4, 256)
    with pytest.raises(ValueError, match="multiple of 32 columns"):
        BlockHead("Q8_0", np.zeros((4, 34), np.uint8), 4, 40)
    with pytest.raises(ValueError, match="no head kernel for Q6_K"):
        BlockHead("Q6_K", np.zeros((4, 210), np.uint8), 4, 256)


def test_the_qwen2_q6_k_output_head_keeps_the_engine_graph(tiny_models: dict[str, Tiny]) -> None:
    """The tiny qwen2's untied Q6_K head: the engine graph (faster than a block kernel from 2 rows on)."""
    store = tiny_models["qwen2"].store
    ends = _head(store)
    assert ends.block_head is None and ends.head_kind == "Q6_K"
    h = np.random.default_rng(6).standard_normal((3, ends.config.d_model)).astype(np.float32)
    want = _reference(store, h)
    np.testing.assert_allclose(ends.logits(h), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def test_ethen_head_is_no_longer_read(tiny_heads: dict[tuple[str, bool], WeightStore],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``ETHEN_HEAD`` is gone: the choice is automatic, whatever the variable says (no value is refused)."""
    store = tiny_heads[("Q8_0", True)]
    for value in ("engine", "gpu"):
        monkeypatch.setenv("ETHEN_HEAD", value)
        assert _head(store).block_head is not None  # exact accuracy: the kernel
    monkeypatch.setenv("ETHEN_HEAD", "kernel")
    assert _head(store, "auto").block_head is None  # exact-int8: the engine graph


def test_bad_hidden_is_refused(tiny_heads: dict[tuple[str, bool], WeightStore]) -> None:
    ends = _head(tiny_heads[("Q8_0", True)])
    with pytest.raises(ModelInputError, match="float32"):
        ends.logits(np.zeros((1, ends.config.d_model), np.float64))  # type: ignore[arg-type]
    with pytest.raises(ModelInputError, match=str(ends.config.d_model)):
        ends.logits(np.zeros((1, 3), np.float32))


def test_split_head_over_the_block_kernel_equals_the_whole(store: WeightStore) -> None:
    """The real SmolLM2 head (tied Q8_0): split over 2 threads by vocabulary ranges, bitwise the one call."""
    ends = _head(store)
    assert ends.block_head is not None and ends.block_head.kind == "Q8_0"
    head = SplitHead(ends, 2)
    try:
        assert head.split and len(head._parts) == 2
        assert head._parts[0][0] == 0 and head._parts[-1][1] == store.config.vocab_size
        assert head._parts[0][1] == head._parts[1][0]
        rng = np.random.default_rng(5)
        for rows in (1, 2, 3, 8, 12):
            hidden = ends.embed(rng.integers(0, 1000, rows)) + rng.standard_normal(
                (rows, store.config.d_model)).astype(np.float32)
            assert np.array_equal(head(hidden), ends.logits(hidden)), rows
        with pytest.raises(ModelInputError, match="float32"):
            head(np.zeros((1, store.config.d_model), np.float64))  # type: ignore[arg-type]
    finally:
        head.close()


@pytest.mark.parametrize("mode", ["auto", "kernel"])
def test_greedy_text_on_the_banner_prompt_is_the_float64_references(store: WeightStore, mode: str) -> None:
    """The default head (SmolLM2's Q8_0 head on the engine's exact-int8 graph) and the block kernel (at
    accuracy ``exact``): every greedy token, and the stop, is the float64 reference's own greedy choice
    (teacher forcing over prompt + answer; its smallest top-1 margin there measured 0.08)."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    quant = load_model(store, options=EngineOptions(accuracy="auto" if mode == "auto" else "exact"))
    assert isinstance(quant.ends, QuantEmbedAndHead)
    assert (quant.ends.block_head is not None) == (mode == "kernel")
    got = generate_chat(quant, BANNER, params)
    assert "Paris" in got.text and got.finish_reason == "stop", got.text
    prompt = quant.tokenizer.encode(quant.chat_template.render(BANNER, add_generation_prompt=True))
    ref = reference_logits(find_gguf_path(), prompt + list(got.token_ids))
    assert not greedy_gaps(ref, len(prompt), list(got.token_ids)).any(), got.text  # the same argmax
    assert int(ref[-1].argmax()) in quant.tokenizer.stop_token_ids  # and the reference stops there too


CACHE_PROBE = """
import json, sys
import numpy as np
from ethen.model import open_weight_store
from ethen.model.qhead import _kernels
from ethen.model.qmodel import QuantEmbedAndHead, onnx_engine
store = open_weight_store(sys.argv[1], cache_root=sys.argv[2])
ends = QuantEmbedAndHead(store, onnx_engine(accuracy="exact"))
h = np.ones((7, ends.config.d_model), np.float32)
ends.logits(h)
ks = [k for kind in _kernels().values() for k in kind]
print(json.dumps({"hits": sum(sum(k.stats.cache_hits.values()) for k in ks),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in ks)}))
"""


def test_a_later_process_loads_the_compiled_kernels_from_the_cache(tmp_path: Path) -> None:
    """``cache=True``: the first process compiles (or finds an earlier run's cache), a second one loads
    every kernel it runs from the cache, compiling none."""
    spec = TinySpec(types=("Q8_0",), embd_type="Q8_0", n_layers=1, name="tiny-cache", seed=5)
    path = write_tiny_gguf(tmp_path / "c.gguf", spec)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CACHE_PROBE, str(path), str(tmp_path / "cache")],
                             capture_output=True, text=True, timeout=300, check=True, env={**os.environ})
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[1]["misses"] == 0 and runs[1]["hits"] >= 3, runs  # 7 rows: the 4-, 2- and 1-row kernels
