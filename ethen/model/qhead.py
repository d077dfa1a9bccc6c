"""The logits head over the GGUF's own blocks, read in place from the memory-mapped file (numba kernels).

``BlockHead`` computes ``h [N, d] @ W.T`` for the head ``W [V, d]`` (the tied token embedding or
``output.weight``) straight from the file's blocks: the int8 quants are read where they lie in the
mapped GGUF, the float16 block scales are converted once to small float32 arrays
(``[V, d / 32]``: 3.5 MB for SmolLM2 against the file's 30 MB head). No float32 copy of the head, no repack.

The kernel (:data:`KERNEL_TYPES`): ``Q8_0``, 34 bytes per 32 weights, ``w = d q`` (``q`` int8).

Which head runs where (automatic, chosen by measurement: ``bench/model_decode.py --head``, SmolLM2's shape
``[49152, 576]``, 1 thread, one run): the engine graph wherever the engine runs the head on its int8
kernel (accuracy ``auto``, the default, for a Q8_0 head: exact-int8; or ``fast``): measured 1.5-1.6x
faster than the kernel (ms, kernel / exact-int8 graph: 1 row 3.87 / 2.48, 2 rows 5.28 / 4.02, 4 rows
9.66 / 6.69, 8 rows 19.04 / 11.93; logits within 7e-7 of the largest). Otherwise the kernel for Q8_0
heads at ``exact`` (ms, kernel / nibble-halves graph: 1 row 4.10 / 7.64, 2 rows 6.29 / 13.96, 4 rows
9.51 / 16.10, 8 rows 18.28 / 20.24), the engine graph for every other type. (Kernels for Q4_0 / Q4_1 /
Q6_K heads and the head-choice setting were removed, issue 43: onnxruntime's graphs beat them, 1 row
2.1-2.4 ms against 4.9-5.0 on Q4_0 / Q4_1, 8 rows 26.5 against 75.1 on Q6_K.) :func:`build_block_head`
returns None for the engine graph (:class:`~ethen.model.qmodel.QuantEmbedAndHead`'s other path).

Numerics: float32 throughout, over the file's weights: each weight ``w = d q`` (exact in float32, an
11-bit scale times an 8-bit integer) is multiplied by the input and added to one of 32 float32 lane
accumulators (lane = position in the block), summed at the end of
the vocabulary row (``fastmath``: the vectorizer's order for that final sum). SmolLM2's head, random input:
at most 3.9e-6 from a float64 reference (logits up to 17.5); ``tests/model/test_qhead.py`` checks each
type on tiny models.

Speed: Q8_0 has 1-, 2- and 4-row kernels (a call with N rows runs groups of 4, then 2, then 1): in a group,
each converted weight is used for every row of it, so the group reads the head once (batched decode rounds;
a prefill asks for its last row only). ``nogil``: the orchestrator's
:class:`~ethen.mesh.orchestrator.head.SplitHead` runs vocabulary ranges on its threads; one call is one
thread (no numba threading layer, the engine's threads untouched).

numba is imported only in :func:`_kernels` (the first head built in a process). ``cache=True``: the JIT
compile is written next to this module (or to numba's user cache dir if that is read-only), and later
processes load the compiled kernels: building and first calling a head in a fresh process took 1.1-1.2 s
compiling (once per numba / CPU / source version) and 0.33-0.35 s from the cache.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import ModelInputError

__all__ = ["AUTO_TYPES", "KERNEL_TYPES", "BlockHead", "build_block_head"]

F32 = NDArray[np.float32]
U8 = NDArray[np.uint8]

#: Head types with a block kernel here (others: the engine graph)
KERNEL_TYPES = ("Q8_0",)
#: Types whose kernel runs where the engine would compute the head in float32: measured faster than its graph
AUTO_TYPES = ("Q8_0",)
#: (weights per block, bytes per block, offset of the float16 scale ``d``) of each kernel type
_BLOCKS = {"Q8_0": (32, 34, 0)}


@functools.cache
def _kernels() -> dict[str, tuple[Any, ...]]:
    """The compiled kernels by type: ``(1 row, 2 rows, 4 rows)`` for Q8_0 (numba is imported here, on the
    first head a process builds)."""
    import numba

    jit = numba.njit(nogil=True, cache=True, fastmath=True, boundscheck=False)

    # Q8_0 ``w = d q``: per vocabulary row a 32-lane float32 accumulator per input row, ``acc[j] += d q_j
    # x_j`` over the blocks, summed at the end. 2 and 4 input rows share each converted weight.
    @jit
    def q8_0_1(q: Any, sc: Any, mn: Any, h: Any, out: Any, a: int, b: int) -> None:
        n, d = h.shape
        nb = d // 32
        x = np.empty(32, np.float32)
        for v in range(a, b):
            qv, sv = q[v], sc[v]  # 1-D views: ~6 % faster than 2-D indexing
            for r in range(n):
                hr = h[r]
                x[:] = 0
                for blk in range(nb):
                    base = blk * 34 + 2
                    c = blk * 32
                    s = sv[blk]
                    for j in range(32):
                        w = s * np.float32(qv[base + j])  # exact: 11-bit d times 8-bit q
                        x[j] += w * hr[c + j]
                t = np.float32(0)
                for j in range(32):
                    t += x[j]
                out[r, v] = t

    @jit
    def q8_0_2(q: Any, sc: Any, mn: Any, h: Any, out: Any, a: int, b: int) -> None:
        n, d = h.shape
        nb = d // 32
        x = np.empty(32, np.float32)
        y = np.empty(32, np.float32)
        for v in range(a, b):
            qv, sv = q[v], sc[v]
            for r in range(0, n, 2):
                r1 = min(r + 1, n - 1)
                h0, h1 = h[r], h[r1]
                x[:] = 0
                y[:] = 0
                for blk in range(nb):
                    base = blk * 34 + 2
                    c = blk * 32
                    s = sv[blk]
                    for j in range(32):
                        w = s * np.float32(qv[base + j])
                        x[j] += w * h0[c + j]
                        y[j] += w * h1[c + j]
                t0 = np.float32(0)
                t1 = np.float32(0)
                for j in range(32):
                    t0 += x[j]
                    t1 += y[j]
                out[r, v] = t0
                out[r1, v] = t1

    @jit
    def q8_0_4(q: Any, sc: Any, mn: Any, h: Any, out: Any, a: int, b: int) -> None:
        n, d = h.shape
        nb = d // 32
        x = np.empty(32, np.float32)
        y = np.empty(32, np.float32)
        z = np.empty(32, np.float32)
        u = np.empty(32, np.float32)
        for v in range(a, b):
            qv, sv = q[v], sc[v]
            for r in range(0, n, 4):
                r1, r2, r3 = min(r + 1, n - 1), min(r + 2, n - 1), min(r + 3, n - 1)
                h0, h1, h2, h3 = h[r], h[r1], h[r2], h[r3]
                x[:] = 0
                y[:] = 0
                z[:] = 0
                u[:] = 0
                for blk in range(nb):
                    base = blk * 34 + 2
                    c = blk * 32
                    s = sv[blk]
                    for j in range(32):
                        w = s * np.float32(qv[base + j])
                        x[j] += w * h0[c + j]
                        y[j] += w * h1[c + j]
                        z[j] += w * h2[c + j]
                        u[j] += w * h3[c + j]
                t0 = np.float32(0)
                t1 = np.float32(0)
                t2 = np.float32(0)
                t3 = np.float32(0)
                for j in range(32):
                    t0 += x[j]
                    t1 += y[j]
                    t2 += z[j]
                    t3 += u[j]
                out[r, v] = t0
                out[r1, v] = t1
                out[r2, v] = t2
                out[r3, v] = t3

    return {"Q8_0": (q8_0_1, q8_0_2, q8_0_4)}


class BlockHead:
    """``h [N, d]`` -> ``h @ W.T [N, V]`` over ``W``'s GGUF blocks ``raw [V, row bytes]`` (a view of the
    mapped file, read in place)."""

    def __init__(self, kind: str, raw: U8, rows: int, cols: int) -> None:
        if kind not in KERNEL_TYPES:
            raise ValueError(f"no head kernel for {kind} (kernels: {', '.join(KERNEL_TYPES)})")
        per, size, d_at = _BLOCKS[kind]
        if cols % per:
            raise ValueError(f"a {kind} head needs a multiple of {per} columns, got {cols}")
        nb = cols // per
        arr = np.asarray(raw).view(np.ndarray)  # the mapped bytes, no copy (a memmap as a plain ndarray)
        if arr.dtype != np.uint8 or arr.shape != (rows, nb * size):
            raise ValueError(f"{kind} head bytes must be uint8 [{rows}, {nb * size}], got "
                             f"{arr.dtype} {list(arr.shape)}")
        self.kind, self.rows, self.cols = kind, rows, cols
        blocks = arr.reshape(rows, nb, size)  # a view
        # float16 scales -> float32 once ([V, nb]; the quants stay in the file)
        self.scales: F32 = np.ascontiguousarray(blocks[:, :, d_at:d_at + 2]).view(np.float16)[..., 0].astype(
            np.float32)
        self.mins: F32 = np.zeros((1, 1), np.float32)  # (the kernels' signature: no type here has minimums)
        self.quants: NDArray[Any] = arr.view(np.int8)  # [V, row bytes]
        self._kernels = _kernels()[kind]

    @property
    def nbytes(self) -> int:
        """Bytes this head holds in memory (the scales; the quants are the file's pages)."""
        return int(self.scales.nbytes)

    def matmul_into(self, h: F32, out: F32, start: int, stop: int) -> None:
        """``out[:, start:stop] = h @ W[start:stop].T`` (``h`` float32 C-contiguous ``[N, d]``, ``out``
        float32 C-contiguous ``[N, V]``); releases the GIL."""
        kernels = self._kernels
        n, lo = h.shape[0], 0
        while lo < n:  # groups of the widest kernel that fits: 4, 2, 1 rows
            k = len(kernels) - 1
            while k and n - lo < (1 << k):
                k -= 1
            hi = n if len(kernels) == 1 else lo + ((n - lo) >> k << k)
            kernels[k](self.quants, self.scales, self.mins, h[lo:hi], out[lo:hi], start, stop)
            lo = hi

    def __call__(self, h: F32) -> F32:
        """``h [N, d]`` -> ``[N, V]`` on this thread."""
        x = np.ascontiguousarray(h, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.cols:
            raise ModelInputError(f"hidden must be float32 [N, {self.cols}], got {list(x.shape)}")
        out: F32 = np.empty((x.shape[0], self.rows), dtype=np.float32)
        self.matmul_into(x, out, 0, self.rows)
        return out


def build_block_head(kind: str, raw: U8, rows: int, cols: int, engine_int8: bool = False) -> BlockHead | None:
    """The block-kernel head of a ``kind`` head, or None for the engine graph: ``kind`` is outside
    :data:`AUTO_TYPES`, or ``engine_int8``: the engine would run this head on its int8 kernel, at
    ``exact-int8`` (the default accuracy for 8-bit blocks) or ``fast``, which measured faster than the
    kernel at every row count."""
    types = () if engine_int8 else AUTO_TYPES
    if kind not in types or cols % _BLOCKS[kind][0]:
        return None
    return BlockHead(kind, raw, rows, cols)
