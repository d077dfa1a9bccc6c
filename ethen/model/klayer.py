"""Decode steps of Q8_0 layers on numba block kernels (no onnxruntime copy), opt-in.

Why: onnxruntime's 8-bit ``MatMulNBits`` runs float32-grade products only on its int8 kernel
(``exact-int8``, three rows per row), whose prepacked layout takes 40 bytes per 34-byte Q8_0 block (1.18x
the file: over the issue's 1.15x), and its float32-compute 8-bit kernel dequantizes the whole matrix on
every call. Here each matrix is the file's int8 quants, copied once into an aligned ``[R, K]`` array, and its
float16 block scales as float32 ``[R, K / 32]``: 36 bytes per 34-byte block (1.06x), nothing else. The
kernels are :mod:`ethen.model.qhead`'s Q8_0 arithmetic (``w = d q`` exact in float32, 32 float32 lane
accumulators per output, summed at the end) over that layout: ``bench/quant_profile.py --q8-kernel``
(random Q8_0 blocks in TinyLlama-1.1B's shapes, 22 layers streamed, 1 row, 1 thread, one run): int8
activations 8.84 G weights/s, exact-int8 6.63, :class:`Q8Matrix` 6.77; max error over max ``|y|`` against
float64 6.0e-3 / 6.5e-7 / 2.5e-7. Over TinyLlama-shape Q8_0's real blocks (a probe, one run): 6.83 G
weights/s from the aligned copy against 6.40 reading the GGUF's 34-byte blocks in place.

So :func:`build_kernel_layer` gives a layer whose seven matrices are all Q8_0 a :class:`KernelLayer`:
steps of up to :data:`KERNEL_ROWS` rows (decode, batched decode rounds) run it; longer steps run the
layer's float32-compute graphs over the engine layout read in place
(:meth:`~ethen.model.engine.GraphBuilder.long_variant`, which prepack nothing), whose pages are released
after each such step (:class:`ethen.model.model.LayerStack`).

``$ETHEN_LAYER_KERNEL`` (:data:`LAYER_KERNEL_MODES`): ``off`` (the default) keeps the engine graphs for
every step; ``on`` uses the kernels wherever they apply (:func:`ethen.model.qmodel.load_quant_layers`
decides: a CPU engine at ``auto`` or ``exact`` accuracy with ``ETHEN_PREFILL=float32``). Opt-in because a
whole decode step measured slower than the default's exact-int8 graphs (docs/model.md).

Threads: one call is one thread (numba ``nogil``); with ``threads`` > 1, a matrix of at least
:data:`SPLIT_WEIGHTS` weights is split by rows over a process-wide pool (the calling thread takes the first
share). numba is imported in :func:`_kernels` (the first kernel layer a process builds), ``cache=True`` as
:mod:`ethen.model.qhead`'s.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import ModelInputError
from ethen.model.gguf_loader import unpermute_qk
from ethen.model.layers import rms_norm

__all__ = ["KERNEL_ROWS", "LAYER_KERNEL_MODES", "SPLIT_WEIGHTS", "KernelLayer", "Q8Matrix",
           "build_kernel_layer", "layer_kernel_mode"]

F32 = NDArray[np.float32]
U8 = NDArray[np.uint8]

#: steps of at most this many rows run the kernels (a decode step, a batched round of up to 8 sessions);
#: longer ones the float32 graphs (a group of 4 rows costs ~2.5x one row here, where the graphs pay one
#: dequantization of each matrix and then ~1/3 of a kernel row per row)
KERNEL_ROWS = 8
#: ``$ETHEN_LAYER_KERNEL`` values (default ``off``)
LAYER_KERNEL_MODES = ("off", "on")
#: matrices of at least this many weights are split over the threads (a split costs ~50 us of hand-off)
SPLIT_WEIGHTS = 1 << 20
#: the layer matrices, in the order they run
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def layer_kernel_mode() -> str:
    """``$ETHEN_LAYER_KERNEL`` (``off`` | ``on``, default ``off``); anything else is refused, named."""
    raw = os.environ.get("ETHEN_LAYER_KERNEL", "").strip() or "off"
    if raw not in LAYER_KERNEL_MODES:
        raise ModelInputError(f"ETHEN_LAYER_KERNEL = {raw!r}: must be one of {', '.join(LAYER_KERNEL_MODES)}")
    return raw


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's helper threads for split matrices (``workers`` of them, made once)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ethen-klayer")


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The compiled kernels ``(1 row, 4 rows)``: ``out[r, v] = h[r] . (d q)[v]`` for ``v`` in ``[a, b)``,
    ``q`` int8 ``[R, K]``, ``d`` float32 ``[R, K / 32]``, ``h`` float32 ``[N, K]``, ``out`` ``[N, R]``. Each
    row's arithmetic is the same in both (a batched round equals its rows alone, bit for bit).

    These are :mod:`ethen.model.qhead`'s Q8_0 kernels over another layout (32-byte blocks of quants, the
    scales apart, instead of the file's 34-byte blocks). One kernel for both layouts, with the block's byte
    stride read at run time, lost LLVM's vectorization: TinyLlama's gate matrix took 11 ms instead of ~1.7."""
    import numba

    jit = numba.njit(nogil=True, cache=True, fastmath=True, boundscheck=False)

    @jit
    def one(q: Any, d: Any, h: Any, out: Any, a: int, b: int) -> None:
        n, k = h.shape
        x = np.empty(32, np.float32)
        for v in range(a, b):
            qv, dv = q[v], d[v]  # 1-D views: faster than 2-D indexing
            for r in range(n):
                hr = h[r]
                x[:] = 0
                for blk in range(k // 32):
                    c, s = blk * 32, dv[blk]
                    for j in range(32):
                        x[j] += (s * np.float32(qv[c + j])) * hr[c + j]  # d q exact in float32
                t = np.float32(0)
                for j in range(32):
                    t += x[j]
                out[r, v] = t

    @jit
    def four(q: Any, d: Any, h: Any, out: Any, a: int, b: int) -> None:
        n, k = h.shape
        x0 = np.empty(32, np.float32)
        x1 = np.empty(32, np.float32)
        x2 = np.empty(32, np.float32)
        x3 = np.empty(32, np.float32)
        for v in range(a, b):
            qv, dv = q[v], d[v]
            for r in range(0, n - 3, 4):
                h0, h1, h2, h3 = h[r], h[r + 1], h[r + 2], h[r + 3]
                x0[:] = 0
                x1[:] = 0
                x2[:] = 0
                x3[:] = 0
                for blk in range(k // 32):
                    c, s = blk * 32, dv[blk]
                    for j in range(32):
                        w = s * np.float32(qv[c + j])
                        x0[j] += w * h0[c + j]
                        x1[j] += w * h1[c + j]
                        x2[j] += w * h2[c + j]
                        x3[j] += w * h3[c + j]
                t0 = np.float32(0)
                t1 = np.float32(0)
                t2 = np.float32(0)
                t3 = np.float32(0)
                for j in range(32):
                    t0 += x0[j]
                    t1 += x1[j]
                    t2 += x2[j]
                    t3 += x3[j]
                out[r, v] = t0
                out[r + 1, v] = t1
                out[r + 2, v] = t2
                out[r + 3, v] = t3

    return one, four


class Q8Matrix:
    """``W [R, K]`` of Q8_0 blocks as int8 quants ``[R, K]`` (copied once from the file's 34-byte blocks,
    aligned) and float32 block scales ``[R, K / 32]``: 36 bytes per block."""

    def __init__(self, raw: U8, rows: int, cols: int) -> None:
        nb = cols // 32
        arr = np.asarray(raw).view(np.ndarray)  # the mapped bytes
        if arr.dtype != np.uint8 or arr.shape != (rows, nb * 34) or cols % 32:
            raise ValueError(f"Q8_0 bytes must be uint8 [{rows}, {nb * 34}] with cols a multiple of 32, got "
                             f"{arr.dtype} {list(arr.shape)}, cols {cols}")
        blocks = arr.reshape(rows, nb, 34)  # a view: float16 d, then 32 int8 q
        self.rows, self.cols = rows, cols
        quants = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)  # [R, nb, 32] a copy, aligned
        self.quants: NDArray[np.int8] = quants.reshape(rows, cols)
        self.scales: F32 = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
        self._one, self._four = _kernels()

    @property
    def nbytes(self) -> int:
        return int(self.quants.nbytes + self.scales.nbytes)

    def matmul_into(self, h: F32, out: F32, start: int, stop: int) -> None:
        """``out[:, start:stop] = h @ W[start:stop].T`` (``h`` float32 C-contiguous ``[N, K]``, ``out``
        float32 C-contiguous ``[N, R]``); releases the GIL."""
        n4 = h.shape[0] // 4 * 4
        if n4:
            self._four(self.quants, self.scales, h[:n4], out[:n4], start, stop)
        if n4 < h.shape[0]:
            self._one(self.quants, self.scales, h[n4:], out[n4:], start, stop)


@dataclass(frozen=True, slots=True)
class KernelLayer:
    """One layer's norms and its seven Q8_0 matrices (:class:`Q8Matrix`), run by the block kernels."""

    attn_norm: F32  # [d]
    ffn_norm: F32  # [d]
    eps: np.float32
    mats: tuple[Q8Matrix, ...]  # MATRICES' order: q, k, v, o, gate, up, down
    q_rows: NDArray[np.intp] | None  # un-permutes Q's output columns (llama's Q/K row order), or None
    k_rows: NDArray[np.intp] | None
    bias: F32 | None  # [qd + 2 kvd] Q/K/V biases (qwen2), un-permuted
    threads: int

    @property
    def nbytes(self) -> int:
        """Bytes of the seven matrices, all in anonymous memory (int8 quants and float32 scales: 36 per
        34-byte block, 1.06x)."""
        return sum(m.nbytes for m in self.mats)

    def _mm(self, m: Q8Matrix, h: F32) -> F32:
        """``h [N, K] @ W.T`` -> ``[N, R]``, split by rows over the threads when ``W`` is large."""
        out: F32 = np.empty((h.shape[0], m.rows), dtype=np.float32)
        parts = min(self.threads, m.rows // 64) if m.rows * m.cols >= SPLIT_WEIGHTS else 1
        if parts <= 1:
            m.matmul_into(h, out, 0, m.rows)
            return out
        bounds = [m.rows * i // parts for i in range(parts + 1)]
        futures = [_pool(self.threads - 1).submit(m.matmul_into, h, out, bounds[i], bounds[i + 1])
                   for i in range(1, parts)]
        m.matmul_into(h, out, bounds[0], bounds[1])
        for f in futures:
            f.result()
        return out

    def attn_in(self, x: F32) -> F32:
        """``x [N, d]`` -> RMSNorm -> Q | K | V (+ biases) -> ``qkv [N, qd + 2 kvd]``."""
        h = rms_norm(x, self.attn_norm, self.eps)  # [N, d] (a new, C-contiguous array)
        q, k, v = (self._mm(m, h) for m in self.mats[:3])  # [N, qd], [N, kvd], [N, kvd]
        if self.q_rows is not None:
            q = q[:, self.q_rows]
        if self.k_rows is not None:
            k = k[:, self.k_rows]
        qkv: F32 = np.concatenate([q, k, v], axis=1)  # [N, qd + 2 kvd]
        if self.bias is not None:
            qkv += self.bias
        return qkv

    def attn_out_ffn(self, x: F32, att: F32) -> F32:
        """``x [N, d]``, ``att [N, qd]`` -> ``x + o(att)`` -> RMSNorm -> SwiGLU FFN -> residual ``[N, d]``."""
        x2 = x + self._mm(self.mats[3], np.ascontiguousarray(att))  # [N, d]
        h = rms_norm(x2, self.ffn_norm, self.eps)  # [N, d]
        gate, up = self._mm(self.mats[4], h), self._mm(self.mats[5], h)  # [N, F] x2
        hidden = np.asarray(gate / (np.float32(1.0) + np.exp(-gate)) * up, np.float32)  # [N, F] SiLU(gate) up
        out: F32 = x2 + self._mm(self.mats[6], hidden)  # [N, d]
        return out


def build_kernel_layer(raws: dict[str, tuple[str, U8, int, int]], attn_norm: F32, ffn_norm: F32, eps: float,
                       q_heads: int | None, k_heads: int | None, bias: F32 | None,
                       threads: int) -> KernelLayer | None:
    """The kernel layer over ``raws`` (each of :data:`MATRICES`: ``(type, raw [rows, row bytes], rows,
    cols)``, ``raw`` a view of the mapped GGUF), or None unless all seven are Q8_0. ``q_heads`` /
    ``k_heads``: un-permute Q / K (llama's row order) by that many heads."""
    if any(raws[n][0] != "Q8_0" or raws[n][3] % 32 for n in MATRICES):
        return None
    mats = tuple(Q8Matrix(raws[n][1], raws[n][2], raws[n][3]) for n in MATRICES)

    def order(rows: int, heads: int | None) -> NDArray[np.intp] | None:
        if heads is None:
            return None
        idx: NDArray[Any] = unpermute_qk(np.arange(rows)[:, None], heads)  # type: ignore[arg-type]
        return np.asarray(idx[:, 0], dtype=np.intp)  # [rows]: output column j is the file's row idx[j]

    return KernelLayer(attn_norm.astype(np.float32), ffn_norm.astype(np.float32), np.float32(eps), mats,
                       order(mats[0].rows, q_heads), order(mats[1].rows, k_heads), bias, max(1, int(threads)))
