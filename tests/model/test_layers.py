"""The pure building blocks, checked against straightforward reference formulas."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.model.gguf_loader import unpermute_qk
from ethen.model.layers import ATTENTION_BLOCK, apply_rope, attention, rms_norm, rope_tables

RNG = np.random.default_rng(0)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_formula_and_stays_float32() -> None:
    x, w = _f32(3, 8), _f32(8)
    out = rms_norm(x, w, np.float32(1e-5))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_rope_is_a_relative_rotation() -> None:
    cos, sin = rope_tables(64, 16, 10000.0)
    assert cos.dtype == np.float32
    q, k = _f32(1, 1, 16), _f32(1, 1, 16)

    def dot(pq: int, pk: int) -> float:
        rq = apply_rope(q, cos[[pq]], sin[[pq]])
        rk = apply_rope(k, cos[[pk]], sin[[pk]])
        return float((rq * rk).sum())

    assert abs(dot(5, 3) - dot(40, 38)) < 1e-4  # depends on the offset only
    assert abs(dot(5, 3) - dot(5, 4)) > 1e-3
    np.testing.assert_allclose(apply_rope(q, cos[[0]], sin[[0]]), q)  # position 0: identity
    r = apply_rope(q, cos[[7]], sin[[7]])
    np.testing.assert_allclose(np.linalg.norm(r), np.linalg.norm(q), rtol=1e-5)


def test_rope_rotates_pairs_i_and_i_plus_half() -> None:
    cos, sin = rope_tables(4, 4, 10000.0)
    x = np.array([[[1.0, 0.0, 0.0, 0.0]]], dtype=np.float32)  # only component 0 set
    out = apply_rope(x, cos[[1]], sin[[1]])[0, 0]
    np.testing.assert_allclose(out, [np.cos(1.0), 0.0, np.sin(1.0), 0.0], atol=1e-6)


def _naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_past: int) -> np.ndarray:
    t, h, hd = q.shape
    hkv = k.shape[0]
    out = np.zeros((t, h, hd))
    for i in range(t):
        for head in range(h):
            kv_head = head // (h // hkv)
            visible = n_past + i + 1
            s = k[kv_head, :visible] @ q[i, head] / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, head] = p @ v[kv_head, :visible]
    return out.reshape(t, h * hd)


def test_gqa_attention_matches_naive_loop() -> None:
    for t, n_past in [(1, 0), (1, 6), (4, 0), (3, 5)]:
        q, k, v = _f32(t, 6, 8), _f32(2, n_past + t, 8), _f32(2, n_past + t, 8)
        out = attention(q, k, v, n_past)
        assert out.dtype == np.float32 and out.shape == (t, 48)
        np.testing.assert_allclose(out, _naive_attention(q, k, v, n_past), rtol=1e-4, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 2 * ATTENTION_BLOCK + 3), n_past=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_blocked_attention_matches_the_naive_loop_across_block_edges(t: int, n_past: int, seed: int) -> None:
    """Query blocks of ATTENTION_BLOCK rows see only the keys up to their last row: every row's result is the
    naive loop's, whatever the block edges (the last block short, a cache with past rows)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, n_past + t, 8)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(attention(q, k, v, n_past), _naive_attention(q, k, v, n_past),
                               rtol=1e-4, atol=1e-5)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for n_head in (9, 3):
        w = _f32(n_head * 8, 5)
        np.testing.assert_array_equal(unpermute_qk(permute(w, n_head), n_head), w)
