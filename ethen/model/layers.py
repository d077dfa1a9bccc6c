"""The Llama forward pass's NumPy pieces the engines share, float32, with a shape comment on each line:
:func:`rms_norm`, :func:`rope_tables` / :func:`apply_rope`, :func:`attention` (grouped-query, causal, over a
KV cache) and :class:`AttentionSegment` (one session's rows and cache in a batch). The matmuls run in the
engines (:mod:`ethen.model.qmodel`, :mod:`ethen.model.glayer`).

Shapes: ``N`` rows of hidden state (the tokens of one or several sessions, concatenated), ``d`` model width,
``H`` query heads, ``Hkv`` key/value heads, ``G = H / Hkv`` queries per KV head, ``hd`` head size, ``S``
cached positions of one session.

RoPE is the Hugging Face "rotate half" form; this matches the engines' un-permuted Q/K rows (see
``gguf_loader``). Scalars are ``np.float32`` so NumPy 2 never promotes to float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["ATTENTION_BLOCK", "AttentionSegment", "apply_rope", "attention", "rms_norm", "rope_tables"]

F32 = NDArray[np.float32]


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


@dataclass(frozen=True, slots=True)
class AttentionSegment:
    """Rows ``start:stop`` of the batch belong to one session whose cache buffers for this layer are
    ``k_buf`` / ``v_buf`` (``[Hkv, capacity, hd]``) holding ``n_past`` positions before this step."""

    start: int
    stop: int
    k_buf: F32  # [Hkv, C, hd]
    v_buf: F32  # [Hkv, C, hd]
    n_past: int
