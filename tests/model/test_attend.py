"""The compiled RoPE + cache write + attention (:mod:`ethen.model.attend`) against NumPy's path
(:func:`ethen.model.layers.apply_rope` and :func:`~ethen.model.layers.attention`)."""

from __future__ import annotations

import numpy as np
import pytest

from ethen.model.attend import MAX_ROWS, rope_attend
from ethen.model.layers import apply_rope, attention, rope_tables


def _numpy_path(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray,
                past: int, h: int, hkv: int) -> np.ndarray:
    t, hd = qkv.shape[0], k_buf.shape[2]
    qd, kvd = h * hd, hkv * hd
    qk = apply_rope(qkv[:, :qd + kvd].reshape(t, h + hkv, hd), cos, sin)
    q, k = qk[:, :h], qk[:, h:]
    v = qkv[:, qd + kvd:].reshape(t, hkv, hd)
    k_buf[:, past:past + t] = k.transpose(1, 0, 2)
    v_buf[:, past:past + t] = v.transpose(1, 0, 2)
    return attention(q, k_buf[:, :past + t], v_buf[:, :past + t], past)


@pytest.mark.parametrize(("h", "hkv", "hd"), [(9, 3, 64), (4, 4, 16), (8, 2, 32), (32, 4, 64)])
@pytest.mark.parametrize("t", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("past", [0, 1, 37])
def test_matches_numpy_path(h: int, hkv: int, hd: int, t: int, past: int) -> None:
    rng = np.random.default_rng(h * 1000 + t * 10 + past)
    cap = past + t + 3
    cos_all, sin_all = rope_tables(cap, hd, 10000.0)
    pos = np.arange(past, past + t)
    qkv = (rng.standard_normal((t, (h + 2 * hkv) * hd)) * 3).astype(np.float32)
    k0 = rng.standard_normal((hkv, cap, hd)).astype(np.float32)
    v0 = rng.standard_normal((hkv, cap, hd)).astype(np.float32)
    k_ref, v_ref = k0.copy(), v0.copy()
    want = _numpy_path(qkv.copy(), cos_all[pos], sin_all[pos], k_ref, v_ref, past, h, hkv)
    k_got, v_got = k0.copy(), v0.copy()
    out = np.full((t, h * hd), np.nan, np.float32)
    rope_attend(qkv, np.ascontiguousarray(cos_all[pos]), np.ascontiguousarray(sin_all[pos]), k_got, v_got,
                past, h, hkv, out)
    # the cache: the new K (rotated) / V rows as NumPy writes them (RoPE the same arithmetic, bit for bit),
    # every other slot untouched
    np.testing.assert_array_equal(k_got, k_ref)
    np.testing.assert_array_equal(v_got, v_ref)
    assert np.isfinite(out).all()
    assert np.max(np.abs(out - want)) <= 2e-6 * max(1.0, float(np.max(np.abs(want))))


def test_causal_rows_do_not_see_later_keys() -> None:
    """Row t of a T-row segment attends over positions 0..n_past + t only: changing a later row's K/V
    leaves the earlier rows' outputs as they were."""
    rng = np.random.default_rng(5)
    h, hkv, hd, past, t = 4, 2, 16, 3, 4
    cos_all, sin_all = rope_tables(16, hd, 10000.0)
    pos = np.arange(past, past + t)
    c, s = np.ascontiguousarray(cos_all[pos]), np.ascontiguousarray(sin_all[pos])
    qkv = rng.standard_normal((t, (h + 2 * hkv) * hd)).astype(np.float32)
    outs = []
    for bump in (0.0, 50.0):
        x = qkv.copy()
        x[-1, h * hd:] += bump  # the last row's K and V
        k, v = np.zeros((hkv, 16, hd), np.float32), np.zeros((hkv, 16, hd), np.float32)
        out = np.empty((t, h * hd), np.float32)
        rope_attend(x, c, s, k, v, past, h, hkv, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0][:-1], outs[1][:-1])
    assert not np.array_equal(outs[0][-1], outs[1][-1])
