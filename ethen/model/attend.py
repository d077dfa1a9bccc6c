"""RoPE, the KV-cache write and attention of a few new rows of one session in one compiled call (numba).

:func:`rope_attend` does for rows ``qkv [T, qd + 2 kvd]`` of one session what
:func:`ethen.model.layers.apply_rope`, the cache writes and :func:`ethen.model.layers.attention` do in
NumPy, in one call: about 15 NumPy calls per layer and session become one. A decode step of SmolLM2 ran them
in ~60 us per layer, ~1.9 ms of a ~16 ms step over 30 layers (``bench/model_decode.py --vs-llama-cpp``
and ``bench/mesh_decode.py`` measure the effect; docs/model.md has the figures).

:data:`MAX_ROWS` bounds the rows it is used for (decode and batched-decode rounds: one row per session);
longer segments (a prefill) keep NumPy's path, where BLAS multiplies ``T x S`` score matrices faster than a
per-row loop.

Numerics: float32 throughout, as NumPy's path. RoPE is computed as there (``x1 c - x2 s``, ``x2 c + x1 s``,
no fused multiply-add). The score dot products and the weighted sum of values are float32 sums in the
vectorizer's order (``fastmath`` ``reassoc`` only: no reciprocal or fused-multiply-add shortcuts), so they
differ from BLAS's order in the last bits; ``tests/model/test_attend.py`` holds them within 2e-6 of the
largest output of NumPy's path (relative), and the engine's greedy text tests run through it.

numba is imported in :func:`_kernel` only, on the first call of a process (``cache=True``: compiled once per
install, loaded from the cache later).
"""

from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.heap import release_mapped, trim

__all__ = ["MAX_ROWS", "rope_attend", "warm", "warm_in_background"]

F32 = NDArray[np.float32]

#: Segments of at most this many rows run here; longer ones keep NumPy's path (:mod:`ethen.model.layers`).
MAX_ROWS = 8


_LOCK = threading.Lock()


def _kernel() -> Any:
    with _LOCK:  # one compile / cache load per process, also when warm() runs on its own thread
        return _compiled()


@functools.cache
def _compiled() -> Any:
    import numba

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def rope(qkv: Any, cos: Any, sin: Any, n_rot: int, hd: int) -> None:
        # qkv [T, (H + Hkv) hd + ...]: rotate each of the first n_rot heads of each row in place
        half = hd // 2
        for t in range(qkv.shape[0]):
            for j in range(n_rot):
                o = j * hd
                for i in range(half):
                    x1 = qkv[t, o + i]
                    x2 = qkv[t, o + half + i]
                    qkv[t, o + i] = x1 * cos[t, i] - x2 * sin[t, i]
                    qkv[t, o + half + i] = x2 * cos[t, i] + x1 * sin[t, i]

    @numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
    def attend(qkv: Any, k_buf: Any, v_buf: Any, n_past: int, h: int, hkv: int, out: Any) -> None:
        # qkv [T, qd + 2 kvd] (Q, K rotated), k_buf / v_buf [Hkv, C, hd], out [T, H hd]
        t_rows = qkv.shape[0]
        hd = k_buf.shape[2]
        g = h // hkv
        qd = h * hd
        kvd = hkv * hd
        for t in range(t_rows):  # this step's keys / values into the cache
            for j in range(hkv):
                for i in range(hd):
                    k_buf[j, n_past + t, i] = qkv[t, qd + j * hd + i]
                    v_buf[j, n_past + t, i] = qkv[t, qd + kvd + j * hd + i]
        scale = np.float32(1.0 / np.sqrt(hd))
        p = np.empty(n_past + t_rows, np.float32)  # [S] one query's weights
        acc = np.empty(hd, np.float32)
        for t in range(t_rows):
            s_len = n_past + t + 1  # causal: row t sees keys 0 .. n_past + t
            for qh in range(h):
                kh = qh // g
                qo = qh * hd
                m = np.float32(-np.inf)
                for s in range(s_len):
                    dot = np.float32(0)
                    for i in range(hd):
                        dot += qkv[t, qo + i] * k_buf[kh, s, i]
                    dot = dot * scale
                    p[s] = dot
                    if dot > m:
                        m = dot
                tot = np.float32(0)
                for s in range(s_len):
                    e = np.float32(np.exp(p[s] - m))
                    p[s] = e
                    tot += e
                acc[:] = 0
                for s in range(s_len):
                    w = p[s] / tot
                    for i in range(hd):
                        acc[i] += w * v_buf[kh, s, i]
                for i in range(hd):
                    out[t, qo + i] = acc[i]

    return rope, attend


def rope_attend(qkv: F32, cos: F32, sin: F32, k_buf: F32, v_buf: F32, n_past: int, n_heads: int,
                n_kv_heads: int, out: F32) -> None:
    """For ``T`` new rows of one session: rotate Q and K of ``qkv [T, qd + 2 kvd]`` in place by
    ``cos`` / ``sin [T, hd / 2]``, write K and V into ``k_buf`` / ``v_buf [Hkv, C, hd]`` at positions
    ``n_past .. n_past + T - 1``, and write the causal grouped-query attention of the T queries over the
    ``n_past + T`` cached positions into ``out [T, H hd]``. Arrays C-contiguous float32; the caller checks
    the shapes (:class:`~ethen.model.model.LayerStack` does)."""
    rope, attend = _kernel()
    rope(qkv, cos, sin, n_heads + n_kv_heads, k_buf.shape[2])
    attend(qkv, k_buf, v_buf, n_past, n_heads, n_kv_heads, out)


def warm() -> None:
    """Compile the kernels (or load them from numba's cache) and run them once on a tiny input: ~0.35 s
    of CPU in a fresh process. That leaves LLVM's code resident (the pages of ``libllvmlite.so`` it ran:
    measured 107.5 MiB of resident growth in a fresh process), which the compiled kernels never run again:
    they are dropped from the process (:func:`~ethen.model.heap.release_mapped`; a later compile reads them
    back in) and the heap trimmed, leaving 40.6 MiB of numba's runtime."""
    z = np.zeros((1, 4 * 16), np.float32)  # 2 query heads, 1 KV head of 16
    rope_attend(z, z[:, :8], z[:, :8], np.zeros((1, 2, 16), np.float32), np.zeros((1, 2, 16), np.float32),
                0, 2, 1, np.zeros((1, 32), np.float32))
    llvm = sys.modules.get("llvmlite")  # numba's, imported by the compile above
    if llvm is not None and llvm.__file__:
        release_mapped(Path(llvm.__file__).parent)
    trim()


def warm_in_background() -> threading.Thread:
    """:func:`warm` on a daemon thread, so a worker's start-up does not wait for it (a decode step that
    comes first waits for the kernels instead of compiling them twice)."""
    t = threading.Thread(target=warm, name="ethen-attend-warm", daemon=True)
    t.start()
    return t
