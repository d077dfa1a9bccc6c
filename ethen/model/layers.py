"""The Llama forward pass as pure NumPy functions, float32 end to end, with a shape comment on each line.

Reads top to bottom like picoGPT's ``gpt2.py``: :func:`rms_norm`, :func:`rope_tables` / :func:`apply_rope`,
:func:`attention` (grouped-query, causal, over a KV cache), :func:`swiglu`, :func:`linear` (the weight
matmuls), then :func:`block`.

Shapes: ``N`` rows of hidden state (the tokens of one or several sessions, concatenated), ``d`` model width,
``H`` query heads, ``Hkv`` key/value heads, ``G = H / Hkv`` queries per KV head, ``hd`` head size, ``S``
cached positions of one session, ``F`` SwiGLU width.

RoPE is the Hugging Face "rotate half" form; this matches the cache's un-permuted Q/K weights (see
``gguf_loader``). Scalars are ``np.float32`` so NumPy 2 never promotes to float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ethen.model.config import ModelConfig
from ethen.model.gguf_loader import LayerWeights

__all__ = ["ATTENTION_BLOCK", "ROW_BLOCK", "SMALL_BATCH_ROWS", "AttentionSegment", "apply_rope", "attention",
           "block", "linear", "rms_norm", "rope_tables", "swiglu"]

F32 = NDArray[np.float32]

#: Up to this many rows, :func:`linear` multiplies by blocks of :data:`ROW_BLOCK` weight rows.
SMALL_BATCH_ROWS = 8
#: Rows of ``w_t`` per call in that case: a 128 x d_in block (~300 KB) stays in the L2 cache.
ROW_BLOCK = 128


def rms_norm(x: F32, weight: F32, eps: np.float32) -> F32:
    """Root-mean-square layer norm over the last axis."""
    var = np.einsum("nd,nd->n", x, x)[:, None] * np.float32(1.0 / x.shape[-1])  # [N, 1] mean of squares
    inv: F32 = np.float32(1.0) / np.sqrt(var + eps)  # [N, 1]
    return x * inv * weight  # [N, d]


def rope_tables(max_positions: int, head_dim: int, theta: float, scale: float = 1.0,
                freq_factors: Sequence[float] | None = None) -> tuple[F32, F32]:
    """cos/sin tables for every position, computed in float64 then stored as float32. ``scale`` is linear
    RoPE scaling (positions / scale); ``freq_factors`` divide each frequency (Llama 3.1's ``rope_freqs``)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [hd/2]
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)  # [hd/2]
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * (inv_freq / scale)[None, :]  # [P, hd/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)  # [P, hd/2] x2


def apply_rope(x: F32, cos: F32, sin: F32) -> F32:
    """Rotate each head's (i, i + hd/2) pairs by the token's angles ("rotate half" form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [N, h, hd/2] x2
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, hd/2] x2
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # [N, h, hd]


#: query rows per block of :func:`attention`: a block's queries score only the keys up to its last row (a
#: causal prefill skips the masked half), and its scores stay in the CPU cache (512 rows of TinyLlama's
#: shape, 1 thread: 59 ms per layer for one [T, S] pass, 17 ms in blocks of 64 or 128)
ATTENTION_BLOCK = 128


def attention(q: F32, k: F32, v: F32, n_past: int) -> F32:
    """Causal grouped-query attention of T new queries over S = n_past + T cached keys/values, in blocks of
    :data:`ATTENTION_BLOCK` query rows."""
    t, h, hd = q.shape  # [T, H, hd]
    hkv = k.shape[0]  # k, v: [Hkv, S, hd]
    g = h // hkv
    qg = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(hkv, g, t, hd)  # [Hkv, G, T, hd] (BLAS's layout)
    out = np.empty((hkv, g, t, hd), np.float32)  # [Hkv, G, T, hd]
    scale = np.float32(1.0 / np.sqrt(hd))
    for a in range(0, t, ATTENTION_BLOCK):
        b = min(t, a + ATTENTION_BLOCK)
        end = n_past + b  # the block's last query sits at position end - 1 and sees keys 0 .. end - 1
        scores = np.matmul(qg[:, :, a:b], k[:, None, :end].transpose(0, 1, 3, 2))  # [Hkv, G, B, end]
        scores *= scale
        if b - a > 1:  # query i (position n_past + i) does not see keys past n_past + i
            future = np.arange(n_past + a, end)[None, :] > np.arange(n_past + a, end)[:, None]  # [B, B]
            scores[..., n_past + a:] += np.where(future, np.float32(-np.inf), np.float32(0))
        scores -= scores.max(axis=-1, keepdims=True)  # [Hkv, G, B, end]
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, v[:, None, :end], out=out[:, :, a:b])  # [Hkv, G, B, hd]
    res: F32 = out.transpose(2, 0, 1, 3).reshape(t, h * hd)  # [T, H*hd]
    return res


def swiglu(gate: F32, up: F32) -> F32:
    """SiLU(gate) * up."""
    denom: F32 = np.float32(1.0) + np.exp(-gate)  # [N, F]  (SiLU(g) = g / (1 + e^-g))
    return gate / denom * up  # [N, F]


def linear(x: F32, w: F32, w_t: F32) -> F32:
    """``x @ w`` given ``w`` ``[in, out]`` and its C-contiguous transpose ``w_t`` ``[out, in]``, by the call
    that is fastest for the row count N with OpenBLAS (one thread, weights not in the CPU cache: 10 SmolLM2
    layers' four matrices, 142 MB, measured on the 2-core VM; ``bench/model_decode.py`` shows the effect).

    * N = 1 (single-session decode): gemv over ``w``, ~15 % faster than any call over ``w_t``.
    * 2 <= N <= :data:`SMALL_BATCH_ROWS` (batched decode): ``w_t`` in blocks of :data:`ROW_BLOCK` rows,
      each ``block @ x.T``: ~3x faster than ``x @ w`` and ~1.5x faster than one ``w_t @ x.T``.
    * larger N (prefill): ``w_t @ x.T`` in one call, 1.2-2x faster than ``x @ w`` up to N ~ 128, on par
      beyond.

    The result is a new array, for N > 1 a transposed (Fortran-ordered) view of an ``[out, N]`` buffer; the
    rest of the block takes it as it is (a copy back to C order would cost more than it saves).
    """
    n = x.shape[0]
    if n == 1:
        one: F32 = x @ w  # [1, out]
        return one
    xt = x.T  # [in, N] a view
    if n > SMALL_BATCH_ROWS:
        whole: F32 = np.matmul(w_t, xt).T  # [N, out] (view of [out, N])
        return whole
    out = np.empty((w_t.shape[0], n), dtype=np.float32)  # [out, N]
    for j in range(0, w_t.shape[0], ROW_BLOCK):
        np.matmul(w_t[j:j + ROW_BLOCK], xt, out=out[j:j + ROW_BLOCK])  # [B, N]
    return out.T  # [N, out] (view of [out, N])


@dataclass(frozen=True, slots=True)
class AttentionSegment:
    """Rows ``start:stop`` of the batch belong to one session whose cache buffers for this layer are
    ``k_buf`` / ``v_buf`` (``[Hkv, capacity, hd]``) holding ``n_past`` positions before this step."""

    start: int
    stop: int
    k_buf: F32  # [Hkv, C, hd]
    v_buf: F32  # [Hkv, C, hd]
    n_past: int


def block(x: F32, w: LayerWeights, cos: F32, sin: F32, segments: Sequence[AttentionSegment],
          cfg: ModelConfig) -> F32:
    """One pre-norm Llama block over the N rows of ``x``; cos/sin are the rows' RoPE angles.

    The only side effect: this step's keys/values are written into each segment's cache slots
    ``n_past : n_past + T`` (the caller commits the new length once every layer has run).
    """
    n = x.shape[0]
    h, hkv, hd, qd, kvd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
    eps = np.float32(cfg.rms_eps)
    a = rms_norm(x, w.attn_norm, eps)  # [N, d]
    qkv = linear(a, w.wqkv, w.wqkv_t)  # [N, qd + 2 kvd]  one matmul for the whole batch
    if w.bqkv is not None:  # qwen2: Q/K/V biases
        qkv += w.bqkv  # [N, qd + 2 kvd]
    qk = apply_rope(qkv[:, :qd + kvd].reshape(n, h + hkv, hd), cos, sin)  # [N, H+Hkv, hd] one call
    q, k = qk[:, :h], qk[:, h:]  # [N, H, hd], [N, Hkv, hd]
    v = qkv[:, qd + kvd:].reshape(n, hkv, hd)  # [N, Hkv, hd]
    att = np.empty((n, qd), dtype=np.float32)  # [N, H*hd]
    for seg in segments:  # attention per session, over its own cache
        lo, hi, past = seg.start, seg.stop, seg.n_past
        end = past + (hi - lo)
        seg.k_buf[:, past:end] = k[lo:hi].transpose(1, 0, 2)  # [Hkv, T, hd] into the cache
        seg.v_buf[:, past:end] = v[lo:hi].transpose(1, 0, 2)  # [Hkv, T, hd]
        att[lo:hi] = attention(q[lo:hi], seg.k_buf[:, :end], seg.v_buf[:, :end], past)  # [T, H*hd]
    x = x + linear(att, w.wo, w.wo_t)  # [N, d]
    m = rms_norm(x, w.ffn_norm, eps)  # [N, d]
    gu = linear(m, w.w_gate_up, w.w_gate_up_t)  # [N, 2F]
    f = cfg.d_ff
    return x + linear(swiglu(gu[:, :f], gu[:, f:]), w.w_down, w.w_down_t)  # [N, d]
