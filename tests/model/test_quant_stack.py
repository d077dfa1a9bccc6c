"""Layers run from the GGUF's own blocks (:func:`ethen.model.qmodel.load_quant_layers`) on the tiny
models (between them every tensor type, both architectures, biases, RoPE variants) against the float64
reference within 1e-3 at ``ACCURACY_EXACT``, ``ACCURACY_EXACT_INT8`` and ``ACCURACY_AUTO``
(``ACCURACY_FAST``'s int8 activations are checked per matmul in ``test_quant_engine``: on these
random-weight models their error compounds over layers). And packed weight bytes per layer against the
layer's bytes in the file."""

from __future__ import annotations

import numpy as np
import pytest

from ethen.model import LayerStack, Model, WeightStore
from ethen.model.engine import ACCURACY_AUTO, ACCURACY_EXACT, ACCURACY_EXACT_INT8, Engine
from ethen.model.qmodel import QuantEmbedAndHead, QuantLayer, load_quant_layers
from tests.model.conftest import TINY_SPECS, Tiny
from tests.model.tiny_reference import reference_embeddings, reference_head_logits, reference_logits

CHAT = [{"role": "user", "content": "hello world, the mesh is a model of layers"}]


def load_quant_layer_stack(start: int, end: int, store: WeightStore, engine: Engine) -> LayerStack:
    return LayerStack(store.config, load_quant_layers([(start, end)], store, engine)[0])


def exact_ends(store: WeightStore) -> QuantEmbedAndHead:
    """The ends at ``ACCURACY_EXACT`` (float32 products of the file's blocks: the head's own check is
    :func:`test_quantized_head_matches_the_float64_reference_without_a_float32_copy`)."""
    return QuantEmbedAndHead(store, Engine("cpu", 1, ACCURACY_EXACT))


@pytest.mark.parametrize("accuracy", [ACCURACY_EXACT, ACCURACY_EXACT_INT8, ACCURACY_AUTO])
@pytest.mark.parametrize("name", list(TINY_SPECS))
def test_quantized_layers_match_the_float64_reference(tiny_models: dict[str, Tiny], name: str,
                                                      accuracy: int) -> None:
    t = tiny_models[name]
    ids = t.model.tokenizer.encode(t.model.chat_template.render(CHAT))
    ref = reference_logits(t.path, ids)
    n = t.model.config.n_layers
    stack = load_quant_layer_stack(0, n - 1, t.store, Engine("cpu", 1, accuracy))
    assert all(isinstance(w, QuantLayer) for w in stack.layers)
    m = Model(t.model.config, exact_ends(t.store), stack, t.model.tokenizer, t.model.chat_template)
    ours = m.logits(ids, m.new_kv_cache(), all_positions=True)
    assert ref.std() > 0.3
    assert float(np.abs(ours - ref).max()) <= 1e-3, name


def test_a_split_quantized_stack_equals_the_whole(tiny_models: dict[str, Tiny]) -> None:
    t = tiny_models["llama-mixed"]
    eng = Engine("cpu", 1, ACCURACY_EXACT)
    whole = load_quant_layer_stack(0, 2, t.store, eng)
    parts = [load_quant_layer_stack(0, 0, t.store, eng), load_quant_layer_stack(1, 2, t.store, eng)]
    x = t.model.ends.embed([1, 2, 3, 4])
    a = whole.forward(x, np.arange(4), whole.new_kv_cache())
    b = x
    for p in parts:
        b = p.forward(b, np.arange(4), p.new_kv_cache())
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)


def test_q4_0_q4_1_q8_0_layers_stay_within_1_15x_of_the_file(tiny_models: dict[str, Tiny]) -> None:
    t = tiny_models["llama-linear"]  # BF16 + Q4_0
    stack = load_quant_layer_stack(0, 1, t.store, Engine("cpu", 1))
    for w in stack.layers:
        assert isinstance(w, QuantLayer)
        assert w.nbytes <= 1.15 * w.file_nbytes, (w.nbytes, w.file_nbytes)


@pytest.mark.parametrize("name", ["llama-mixed", "qwen2"])
def test_quantized_head_matches_the_float64_reference_without_a_float32_copy(tiny_models: dict[str, Tiny],
                                                                             name: str) -> None:
    """Embedding rows: the dequantized rows (float32 of the float64 values); logits within 1e-4 of the
    largest (float32 compute over the blocks, against float64)."""
    t = tiny_models[name]  # llama-mixed: tied Q8_0 embedding; qwen2: Q6_K output, F16 embedding
    q = exact_ends(t.store)
    ids = [1, 5, 9, 200]
    np.testing.assert_allclose(q.embed(ids), reference_embeddings(t.path, ids), rtol=1e-6, atol=0)
    h = np.random.default_rng(0).standard_normal((3, t.model.config.d_model)).astype(np.float32)
    want = reference_head_logits(t.path, h)
    np.testing.assert_allclose(q.logits(h), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    head_file = 2 * t.model.config.vocab_size * t.model.config.d_model * 4  # float32 head + its transpose
    assert q.nbytes < head_file / 3
