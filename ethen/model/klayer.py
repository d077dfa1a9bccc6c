"""Decode steps of Q8_0 layers on block kernels that read the GGUF in place (no onnxruntime copy).

Why: onnxruntime's 8-bit ``MatMulNBits`` runs float32-grade products only on its int8 kernel
(``exact-int8``, three rows per row), whose prepacked layout takes 40 bytes per 34-byte Q8_0 block (1.18x
the file: over the issue's 1.15x), and its float32-compute 8-bit kernel dequantizes the whole matrix on
every call. :class:`~ethen.model.qhead.BlockHead`'s Q8_0 kernel (``w = d q`` exact in float32, float32
lane accumulators; the logits head's) reads the file's int8 quants where they lie and keeps only the block
scales as float32 (4 bytes per block: 38 / 34 = 1.12x the file), at exact-int8's decode speed.
``bench/quant_profile.py --q8-kernel`` (random Q8_0 blocks in TinyLlama-1.1B's shapes, 22 layers streamed,
1 row, 1 thread, one run): int8 activations 7.28 G weights/s, exact-int8 4.87, this kernel 5.00, max error
over max ``|y|`` against float64 6.0e-3 / 6.5e-7 / 1.6e-7.

So :func:`build_kernel_layer` gives a layer whose seven matrices are all Q8_0 a :class:`KernelLayer`:
steps of up to :data:`KERNEL_ROWS` rows (decode, batched decode rounds) run it; longer steps run the
layer's float32-compute graphs over the engine layout read in place
(:meth:`~ethen.model.engine.GraphBuilder.long_variant`, which prepack nothing), whose pages are released
after each such step (:func:`ethen.model.heap.trim_after`). Nothing is prepacked for such a layer.

``$ETHEN_LAYER_KERNEL`` (:data:`LAYER_KERNEL_MODES`): ``auto`` (the default) uses the kernels wherever they
apply (:func:`ethen.model.qmodel.load_quant_layers` decides: a CPU engine at ``auto`` or ``exact`` accuracy
with ``ETHEN_PREFILL=float32``); ``off`` keeps the engine graphs for every step (as before).

Threads: one call is one thread (numba ``nogil``); with ``threads`` > 1, a matrix of at least
:data:`SPLIT_WEIGHTS` weights is split by rows over a process-wide pool (the calling thread takes the first
share).
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
from ethen.model.qhead import BlockHead

__all__ = ["KERNEL_ROWS", "LAYER_KERNEL_MODES", "SPLIT_WEIGHTS", "KernelLayer", "build_kernel_layer",
           "layer_kernel_mode"]

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


@dataclass(frozen=True, slots=True)
class KernelLayer:
    """One layer's norms and its seven Q8_0 matrices as block kernels over the mapped GGUF."""

    attn_norm: F32  # [d]
    ffn_norm: F32  # [d]
    eps: np.float32
    mats: tuple[BlockHead, ...]  # MATRICES' order: q, k, v, o, gate, up, down
    q_rows: NDArray[np.intp] | None  # un-permutes Q's output columns (llama's Q/K row order), or None
    k_rows: NDArray[np.intp] | None
    bias: F32 | None  # [qd + 2 kvd] Q/K/V biases (qwen2), un-permuted
    threads: int

    @property
    def nbytes(self) -> int:
        """Bytes the decode step keeps resident: the matrices' pages of the file (read in place) and the
        float32 scales (Q8_0: 38 bytes per 34-byte block, 1.12x)."""
        return sum(int(m.quants.nbytes) for m in self.mats) + self.held_nbytes

    @property
    def held_nbytes(self) -> int:
        """Bytes this layer holds in memory of its own (the float32 scales; the quants are file pages)."""
        return sum(m.nbytes for m in self.mats)

    def _mm(self, m: BlockHead, h: F32) -> F32:
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
    mats = tuple(BlockHead("Q8_0", raws[n][1], raws[n][2], raws[n][3]) for n in MATRICES)

    def order(rows: int, heads: int | None) -> NDArray[np.intp] | None:
        if heads is None:
            return None
        idx: NDArray[Any] = unpermute_qk(np.arange(rows)[:, None], heads)  # type: ignore[arg-type]
        return np.asarray(idx[:, 0], dtype=np.intp)  # [rows]: output column j is the file's row idx[j]

    return KernelLayer(attn_norm.astype(np.float32), ffn_norm.astype(np.float32), np.float32(eps), mats,
                       order(mats[0].rows, q_heads), order(mats[1].rows, k_heads), bias, max(1, int(threads)))
