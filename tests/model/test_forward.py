"""Forward pass: dtypes, layer splitting, batched decode, KV-cache decode, positions and cache checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from ethen.model import (
    KVCache,
    KVCacheFullError,
    LayerStack,
    Model,
    ModelInputError,
    WeightStore,
    find_gguf_path,
    load_layer_stacks,
    parse_layer_ranges,
)
from tests.model.tiny_reference import reference_embeddings, reference_head_logits

PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def _full_logits(model: Model, ids: list[int]) -> np.ndarray:
    return model.logits(ids, model.new_kv_cache(), all_positions=True)


def _run_stacks(model: Model, stacks: list[LayerStack], ids: list[int]) -> np.ndarray:
    kvs = [s.new_kv_cache() for s in stacks]
    h = model.ends.embed(ids)
    pos = np.arange(len(ids))
    for s, kv in zip(stacks, kvs, strict=True):
        h = s.forward(h, pos, kv)
    return model.ends.logits(h)


def test_shapes_and_dtypes_stay_float32(model: Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    h = model.ends.embed(ids)
    assert h.dtype == np.float32 and h.shape == (len(ids), model.config.d_model)
    kv = model.new_kv_cache()
    out = model.stack.forward(h, np.arange(len(ids)), kv)
    assert out.dtype == np.float32 and out.shape == h.shape
    assert kv.length == len(ids) and kv.k.dtype == np.float32
    logits = model.ends.logits(out)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), model.config.vocab_size)
    assert np.isfinite(logits).all()


def test_config_from_gguf(model: Model) -> None:
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.context_length, c.rope_theta) == (49152, 8192, 100000.0)


@pytest.mark.parametrize("ranges", ["0-29", "0-14,15-29", "0-9,10-19,20-29", "0-0,1-28,29-29"])
def test_split_stacks_give_identical_logits(model: Model, store: WeightStore, ranges: str) -> None:
    ids = model.tokenizer.encode(PROMPT)
    expected = _full_logits(model, ids)
    got = _run_stacks(model, load_layer_stacks(ranges, store), ids)
    np.testing.assert_array_equal(got, expected)


def test_stack_loads_only_its_layers(model: Model, store: WeightStore) -> None:
    (stack,) = load_layer_stacks([(10, 19)], store)
    assert [w.index for w in stack.layers] == list(range(10, 20))
    assert (stack.start, stack.end, stack.n_layers) == (10, 19, 10)
    assert stack.nbytes == sum(w.nbytes for w in model.stack.layers[10:20]) < model.stack.nbytes / 2
    kv = stack.new_kv_cache()
    assert kv.n_layers == 10


def test_kv_decode_equals_full_recompute(model: Model) -> None:
    ids = model.tokenizer.encode(PROMPT + "Red, green")
    full = _full_logits(model, ids)
    kv = model.new_kv_cache(initial_capacity=4)  # forces several doublings
    split = 9
    step_logits = [model.logits(ids[:split], kv, all_positions=True)]
    step_logits += [model.logits([t], kv)[None, :] for t in ids[split:]]
    got = np.concatenate(step_logits)
    # 5e-4 on logits of magnitude ~20: the engine's one-row and many-row matmul kernels sum in other orders
    np.testing.assert_allclose(got, full, atol=5e-4, rtol=0)
    assert int(np.argmax(got[-1])) == int(np.argmax(full[-1]))


def test_batched_decode_equals_per_session(model: Model) -> None:
    prompts = [PROMPT, "The sky is", "1, 2, 3,", "<|im_start|>user\nHi<|im_end|>\n"]
    ids = [model.tokenizer.encode(p) for p in prompts]
    solo_kvs = [model.new_kv_cache() for _ in ids]
    batch_kvs = [model.new_kv_cache() for _ in ids]
    solo_next = [int(np.argmax(model.logits(i, kv))) for i, kv in zip(ids, solo_kvs, strict=True)]
    batch_next = [int(np.argmax(model.logits(i, kv))) for i, kv in zip(ids, batch_kvs, strict=True)]
    for _ in range(4):
        solo = np.stack([model.logits([t], kv) for t, kv in zip(solo_next, solo_kvs, strict=True)])
        batched = model.logits_batch(batch_next, batch_kvs)
        assert batched.shape == (len(ids), model.config.vocab_size) and batched.dtype == np.float32
        np.testing.assert_allclose(batched, solo, atol=2e-4, rtol=0)
        solo_next = [int(t) for t in np.argmax(solo, axis=1)]
        batch_next = [int(t) for t in np.argmax(batched, axis=1)]
        assert solo_next == batch_next
    assert [kv.length for kv in batch_kvs] == [kv.length for kv in solo_kvs]


@pytest.mark.parametrize("sessions", [2, 8, 9])
def test_batched_rows_equal_single_row_forwards(model: Model, sessions: int) -> None:
    """A decode step of several sessions in one ``forward_batch`` (one matmul per weight for all rows) gives
    each session the hidden state of its own one-row step."""
    stack = model.stack
    ids = model.tokenizer.encode(PROMPT)
    prompts = [ids[: 3 + i] for i in range(sessions)]  # different lengths: different cache depths
    solo_kvs = [model.new_kv_cache() for _ in prompts]
    batch_kvs = [model.new_kv_cache() for _ in prompts]
    for p, a, b in zip(prompts, solo_kvs, batch_kvs, strict=True):
        model.logits(p, a)
        model.logits(p, b)
    h = model.ends.embed([ids[len(p)] for p in prompts])  # [B, d] each session's next token
    batched = stack.forward_batch(h, [kv.length for kv in batch_kvs], batch_kvs)  # [B, d]
    solo = np.concatenate([stack.forward(h[i:i + 1], [kv.length], kv)
                           for i, kv in enumerate(solo_kvs)])  # [B, d]
    assert batched.shape == solo.shape and batched.dtype == np.float32
    np.testing.assert_allclose(batched, solo, rtol=0, atol=2e-5 * float(np.abs(solo).max()))
    for a, b in zip(solo_kvs, batch_kvs, strict=True):
        assert a.length == b.length
        k = a.k[:, :, :a.length]  # [L, Hkv, S, hd] the keys this step wrote, at every layer
        np.testing.assert_allclose(b.k[:, :, :b.length], k, rtol=0, atol=2e-5 * float(np.abs(k).max()))


def test_ragged_batch_prefill_equals_separate_prefill(model: Model) -> None:
    a, b = model.tokenizer.encode("Paris is"), model.tokenizer.encode(PROMPT)
    kva, kvb = model.new_kv_cache(), model.new_kv_cache()
    h = model.ends.embed(a + b)
    pos = np.concatenate([np.arange(len(a)), np.arange(len(b))])
    out = model.ends.logits(model.stack.forward_batch(h, pos, [kva, kvb], seq_lens=[len(a), len(b)]))
    np.testing.assert_allclose(out[: len(a)], _full_logits(model, a), atol=2e-4, rtol=0)
    np.testing.assert_allclose(out[len(a):], _full_logits(model, b), atol=2e-4, rtol=0)


def test_replay_onto_fresh_cache_reproduces_the_session(model: Model, store: WeightStore) -> None:
    """A replacement worker gets the history replayed at positions 0..n-1 and continues identically."""
    (stack,) = load_layer_stacks([(10, 19)], store)
    ids = model.tokenizer.encode(PROMPT + "Blue")
    h = model.ends.embed(ids)
    original = stack.new_kv_cache()
    for i in range(len(ids)):  # the original worker saw the session token by token
        stack.forward(h[i:i + 1], [i], original)
    replacement = stack.new_kv_cache()
    stack.forward(h[:-1], np.arange(len(ids) - 1), replacement)  # replay history in one call
    last_replacement = stack.forward(h[-1:], [len(ids) - 1], replacement)
    probe = model.ends.embed(model.tokenizer.encode(","))
    a = stack.forward(probe, [len(ids)], original)
    b = stack.forward(probe, [len(ids)], replacement)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3)  # mid-stack hidden states are O(10-100)
    assert last_replacement.shape == (1, model.config.d_model)


def test_positions_must_continue_the_cache(model: Model) -> None:
    kv = model.new_kv_cache()
    h = model.ends.embed([1, 2, 3])
    with pytest.raises(ModelInputError, match=r"positions of session 0 must be 0\.\.2"):
        model.stack.forward(h, [1, 2, 3], kv)
    with pytest.raises(ModelInputError, match="gaps"):
        model.stack.forward(h, [0, 1, 3], kv)
    assert kv.length == 0  # a rejected call leaves the cache untouched
    model.stack.forward(h, [0, 1, 2], kv)
    with pytest.raises(ModelInputError, match=r"must be 3\.\.3"):
        model.stack.forward(h[:1], [0], kv)  # replay onto a non-empty cache: refused, not silently wrong
    kv.truncate(2)
    model.stack.forward(h[2:], [2], kv)  # explicit rewind then redo
    assert kv.length == 3


@pytest.mark.parametrize(
    ("hidden", "positions", "match"),
    [
        (np.zeros((2, 576), dtype=np.float64), [0, 1], "float32"),
        (np.zeros((2, 575), dtype=np.float32), [0, 1], r"shape \[N>0, 576\]"),
        (np.zeros((0, 576), dtype=np.float32), [], r"shape \[N>0, 576\]"),
        (np.zeros((2, 576), dtype=np.float32), [0], r"positions must have shape \[2\]"),
        (np.zeros((2, 576), dtype=np.float32), [0.0, 1.0], "integers"),
        ("garbage", [0], "float32 ndarray"),
        (np.full((1, 576), np.nan, dtype=np.float32), [0], "NaN"),
    ],
)
def test_bad_forward_input_is_a_clear_error(
    model: Model, hidden: object, positions: object, match: str
) -> None:
    kv = model.new_kv_cache()
    with pytest.raises(ModelInputError, match=match):
        model.stack.forward(hidden, positions, kv)  # type: ignore[arg-type]
    assert kv.length == 0


def test_batch_rejects_foreign_or_duplicate_caches(model: Model, store: WeightStore) -> None:
    kv = model.new_kv_cache()
    h = model.ends.embed([5, 6])
    with pytest.raises(ModelInputError, match="twice"):
        model.stack.forward_batch(h, [0, 0], [kv, kv])
    small = load_layer_stacks([(0, 1)], store)[0].new_kv_cache()
    with pytest.raises(ModelInputError, match=r"kvs\[1\] is not a KV cache"):
        model.stack.forward_batch(h, [0, 0], [kv, small])
    with pytest.raises(ModelInputError, match="seq_lens"):
        model.stack.forward_batch(h, [0, 1], [kv], seq_lens=[3])


def test_embed_and_head_reject_bad_input(model: Model) -> None:
    with pytest.raises(ModelInputError, match="49152"):
        model.ends.embed([1, 49152])
    with pytest.raises(ModelInputError, match="non-empty"):
        model.ends.embed([])
    with pytest.raises(ModelInputError, match="float32"):
        model.ends.logits(np.zeros((1, 576)))


def test_head_is_tied_to_token_embeddings(model: Model, store: WeightStore) -> None:
    """No ``output.weight``: the embedding rows are the file's (float64 dequantization, to float32
    rounding) and the logits are the head of that same matrix: the float64 reference's RMSNorm + tied head
    within 1e-4 of the largest logit (measured 2e-7 on these rows with the default exact-int8 head)."""
    assert store.tied_head and "output.weight" not in store.tensors
    h = model.ends.embed([42, 7, 1000])
    np.testing.assert_allclose(h, reference_embeddings(find_gguf_path(), [42, 7, 1000]), rtol=1e-6, atol=0)
    want = reference_head_logits(find_gguf_path(), h)
    got = model.ends.logits(h)
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_kv_cache_footprint_and_cap() -> None:
    kv = KVCache(n_layers=2, n_kv_heads=3, head_dim=64, max_tokens=100, initial_capacity=8)
    per_slot = 2 * 2 * 3 * 64 * 4
    assert kv.nbytes == 8 * per_slot
    assert kv.nbytes_after(8) == 8 * per_slot
    assert kv.nbytes_after(9) == 16 * per_slot
    assert kv.nbytes_after(90) == 100 * per_slot  # doubling is capped at max_tokens
    kv.reserve(20)
    assert kv.capacity == 32 and kv.nbytes == 32 * per_slot
    with pytest.raises(KVCacheFullError, match="max_tokens=100"):
        kv.nbytes_after(101)
    with pytest.raises(ModelInputError, match="truncate"):
        kv.truncate(1)  # nothing committed yet
    with pytest.raises(ModelInputError, match="n_layers"):
        KVCache(n_layers=0, n_kv_heads=3, head_dim=64, max_tokens=10)


def test_cache_grows_without_losing_contents(model: Model) -> None:
    kv = model.new_kv_cache(initial_capacity=2)
    model.logits(model.tokenizer.encode("one two"), kv)
    before = kv.k[:, :, : kv.length].copy()
    model.logits(model.tokenizer.encode(" three four five six"), kv)
    assert kv.capacity >= kv.length > before.shape[2]
    np.testing.assert_array_equal(kv.k[:, :, : before.shape[2]], before)


def test_session_over_max_tokens_is_refused(model: Model) -> None:
    kv = model.stack.new_kv_cache(max_tokens=4)
    with pytest.raises(ModelInputError, match="max_tokens=4"):
        model.logits([1, 2, 3, 4, 5], kv)
    assert kv.length == 0


def test_parse_layer_ranges() -> None:
    assert parse_layer_ranges("0-9,10-19") == [(0, 9), (10, 19)]
    assert parse_layer_ranges(" 7 ") == [(7, 7)]
    for bad in ["", "a-b", "5-3", "-1-2", "1-"]:
        with pytest.raises(ModelInputError, match="layer range"):
            parse_layer_ranges(bad)


def test_load_layer_stacks_rejects_bad_ranges(store: WeightStore) -> None:
    with pytest.raises(ModelInputError, match="0 <= start <= end <= 29"):
        load_layer_stacks([(25, 30)], store)
    with pytest.raises(ModelInputError, match="0 <= start <= end <= 29"):
        load_layer_stacks([(5, 4)], store)


def test_greedy_generation_is_identical_for_every_split(model: Model, store: WeightStore) -> None:
    from ethen.model import SamplingParams, generate, model_step

    chat = [{"role": "user", "content": "Name two planets."}]
    ids = model.tokenizer.encode(model.chat_template.render(chat))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    reference = generate(model_step(model), model.tokenizer, ids, greedy)
    assert reference.completion_tokens >= 3
    for ranges in ("0-14,15-29", "0-9,10-19,20-29"):
        stacks = load_layer_stacks(ranges, store)
        kvs = [s.new_kv_cache() for s in stacks]

        def step(token_ids: Sequence[int], stacks: list[LayerStack] = stacks,
                 kvs: list[KVCache] = kvs) -> np.ndarray:
            h = model.ends.embed(token_ids)
            pos = np.arange(kvs[0].length, kvs[0].length + len(token_ids))
            for s, kv in zip(stacks, kvs, strict=True):
                h = s.forward(h, pos, kv)
            return model.ends.logits(h[-1:])[0]

        assert generate(step, model.tokenizer, ids, greedy) == reference
