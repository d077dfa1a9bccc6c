"""Any Llama-family GGUF: tiny random-weight ``llama`` and ``qwen2`` models written with ``gguf.GGUFWriter``
(every supported tensor type, tied and untied heads, Q/K/V biases, RoPE base / linear scaling /
``rope_freqs``, byte-level and SentencePiece tokenizers) against an independent float64 reference
(``tiny_reference``), split across layer stacks, and the files the loader must refuse."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from ethen.model import (
    GGUFFormatError,
    LayerStack,
    SamplingParams,
    UnsupportedModelError,
    generate,
    load_layer_stacks,
    model_step,
    open_weight_store,
)
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from tests.model.conftest import ALL_TYPES, TINY_SPECS, Tiny
from tests.model.tiny_reference import reference_logits

CHAT = [{"role": "user", "content": "hello world, the mesh is a model of layers"}]
SPLITS = ["0-0,1-2", "0-1,2-2", "0-0,1-1,2-2"]


def _prompt(t: Tiny) -> list[int]:
    return t.model.tokenizer.encode(t.model.chat_template.render(CHAT))


@pytest.mark.parametrize("name", list(TINY_SPECS))
def test_logits_match_the_reference(tiny_models: dict[str, Tiny], name: str) -> None:
    t = tiny_models[name]
    ids = _prompt(t)
    ref = reference_logits(t.path, ids)
    ours = t.model.logits(ids, t.model.new_kv_cache(), all_positions=True)
    assert ref.std() > 0.3  # logits that vary: a wrong RoPE, permutation or bias shows
    assert float(np.abs(ours - ref).max()) <= 1e-3


def test_the_models_cover_every_tensor_type(tiny_models: dict[str, Tiny]) -> None:
    seen = {t.tensor_type.name for m in tiny_models.values() for t in GGUFReader(str(m.path)).tensors}
    assert seen == set(ALL_TYPES)


def test_config_comes_from_the_metadata(tiny_models: dict[str, Tiny]) -> None:
    q = tiny_models["qwen2"].store
    c = q.config
    assert (c.architecture, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        "qwen2", 3, 256, 4, 1, 64, 512)
    assert (c.rope_theta, c.rms_eps, c.context_length, c.attn_bias) == (1e6, pytest.approx(1e-6), 256, True)
    assert not q.tied_head and q.model_name == "tiny-qwen2"
    assert [q.tensors[f"blk.1.attn_{p}.bias"].shape for p in "qkv"] == [(256,), (64,), (64,)]
    llama = tiny_models["llama-mixed"].store
    assert llama.tied_head and not llama.config.attn_bias
    assert not any(n.endswith(".bias") for n in llama.tensors)
    spm = tiny_models["llama-spm-ropefreqs"].store.config
    assert spm.rope_freq_factors is not None and spm.rope_freq_factors[-1] == 8.0 and spm.rope_theta == 5e5
    assert tiny_models["llama-linear"].store.config.rope_scaling_factor == 4.0


@pytest.mark.parametrize("ranges", SPLITS)
@pytest.mark.parametrize("name", list(TINY_SPECS))
def test_split_greedy_output_equals_single_process(tiny_models: dict[str, Tiny], name: str,
                                                   ranges: str) -> None:
    t = tiny_models[name]
    n = t.store.config.n_layers
    if any(int(part.split("-")[1]) >= n for part in ranges.split(",")):
        ranges = f"0-0,1-{n - 1}"
    stacks = load_layer_stacks(ranges, t.store)
    kvs = [s.new_kv_cache() for s in stacks]
    fed = 0

    def split_step(token_ids: Sequence[int]) -> np.ndarray:
        nonlocal fed
        h = t.model.ends.embed(token_ids)
        pos = np.arange(fed, fed + len(token_ids))
        for s, kv in zip(stacks, kvs, strict=True):
            h = s.forward(h, pos, kv)
        fed += len(token_ids)
        return t.model.ends.logits(h[-1:])[0]

    ids = _prompt(t)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    single = generate(model_step(t.model), t.model.tokenizer, ids, greedy)
    split = generate(split_step, t.model.tokenizer, ids, greedy)
    assert split.token_ids == single.token_ids and len(single.token_ids) >= 1


def test_a_split_stack_holds_only_its_layers(tiny_models: dict[str, Tiny]) -> None:
    t = tiny_models["qwen2"]
    (stack,) = load_layer_stacks("1-2", t.store)
    assert isinstance(stack, LayerStack) and [w.index for w in stack.layers] == [1, 2]
    assert stack.nbytes == sum(w.nbytes for w in t.model.stack.layers[1:]) < t.model.stack.nbytes


def test_spm_tokenizer_round_trip_and_one_bos(tiny_models: dict[str, Tiny]) -> None:
    tok = tiny_models["llama-spm-ropefreqs"].model.tokenizer
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids.count(1) == 1  # add_bos_token: one BOS
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.decode(tok.encode("xyz é"), skip_special_tokens=True) == "xyz é"  # byte fallback
    prompt = _prompt(tiny_models["llama-spm-ropefreqs"])  # the template writes {{ bos_token }} itself
    assert prompt[0] == 1 and prompt[1] != 1
    assert 2 in tok.stop_token_ids  # </s>


def test_qwen2_pre_tokenizer_splits_digits(tiny_models: dict[str, Tiny]) -> None:
    tok = tiny_models["qwen2"].model.tokenizer
    assert [tok.decode([i]) for i in tok.encode("a 123")] == ["a", " ", "1", "2", "3"]
    assert tok.decode(tok.encode("hello  world\n\n!")) == "hello  world\n\n!"
    assert tok.add_bos is False and tok.encode("hello")[0] != tok.bos_token_id


def _no_cache_left(root: Path) -> None:
    assert not root.exists() or list(root.iterdir()) == []


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(arch="mamba"))
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*supported: llama, qwen2"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(types=("F16", "TQ1_0")))
    with pytest.raises(UnsupportedModelError, match=r"tensor 'blk\.0\.attn_k\.weight' has type TQ1_0"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(extra={"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(UnsupportedModelError, match=r"rope\.scaling\.type = 'yarn'"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")


def test_wrong_magic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGML" + os.urandom(4096))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.02])
def test_truncated_file_is_refused(tmp_path: Path, keep: float) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(types=("Q4_K",)))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFFormatError, match="truncated"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")


def test_missing_tensor_is_refused_without_a_partial_cache(tmp_path: Path) -> None:
    """The build fails mid-way (in its temporary directory): the temporary directory goes too."""
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(drop=("blk.2.ffn_down.weight",)))
    with pytest.raises(GGUFFormatError, match=r"lacks tensor 'blk\.2\.ffn_down\.weight'"):
        open_weight_store(path, cache_root=tmp_path / "cache")
    _no_cache_left(tmp_path / "cache")
