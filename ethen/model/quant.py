"""GGUF tensor blocks -> the block layout of onnxruntime's ``MatMulNBits`` (weight-only 4/8-bit matmul).

``MatMulNBits`` computes ``y = x @ W.T`` for ``W [R, K]`` stored as R rows of ``K / block`` blocks, each
block ``block`` unsigned ``bits``-bit values ``u`` with a float32 scale ``s`` and an integer zero point
``z`` (default ``2^(bits-1)``): ``w = s * (u - z)``. Every GGUF type is written in that form, with the
same integers the file holds; a type that also has a per-block *minimum* (``w = s * u + min``: Q4_1 and
the K-quants' ``- dmin * m``) gets a second, small term ``xsum @ mins`` where ``xsum [N, K / block]`` is
the sum of x over each block (computed in the graph, :mod:`ethen.model.engine`): for Q4_1 a float ``Gemm``
over float16 minimums (``m + 8 d`` at the default ``z``, or ``m`` with ``z = 0`` where a block's
``m + 8 d`` is not a float16: :func:`_q4_1_shifted_mins`), for the K-quants (``z = 0``) a 4-bit
``MatMulNBits`` of ``K / 16`` columns (:func:`k_mins`: 6-bit ``m`` as two nibbles, scale ``-dmin``).

=====  ==========================================  ===========================  =====================
type   file (bytes / 32 weights)                   here (bytes / 32)            exact?
=====  ==========================================  ===========================  =====================
Q4_0   18: f16 d, 16 B nibbles (w = d (q - 8))     20: 4-bit, f32 scale         yes (f16 -> f32)
Q4_1   20: f16 d, f16 m, nibbles (w = d q + m)     22: f16 m + 8 d (or m, z 0)  yes
Q8_0   34: f16 d, 32 int8 (w = d q)                36: 8-bit, u = q + 128       yes
Q4_K   18 (144 / 256): 6-bit sc, m; f16 d, dmin    22.06: f32 d*sc, mins        yes (d * sc fits f32)
Q5_K   22 (176 / 256)                              38.06: 8-bit (u = q)         yes
Q6_K   26.25 (210 / 256): int8 sc per 16           40: 8-bit, block 16          yes (u = q + 96)
F16    64                                          64 (float32 in memory)       yes
BF16   64                                          64 (cast per call)           yes
F32    128                                         128                          yes
=====  ==========================================  ===========================  =====================

So Q4_0, Q4_1 and Q8_0 stay within 1.125x of the file (Q4_1 1.1x); Q4_K takes 1.23x (its 6-bit
sub-block scales become float32: ``MatMulNBits`` wants one float scale per block; the min term takes 12.5
bytes per 256 weights), and Q5_K / Q6_K, which ``MatMulNBits`` cannot hold in 5 or 6 bits, take 1.5-1.7x
as 8-bit blocks (nothing is requantized: every weight is the file's value, bit for bit, once scaled). At
float32 compute (``ACCURACY_EXACT``) the engine runs an 8-bit matrix as two 4-bit halves
(:func:`nibble_halves`: 41 bytes / 32 for Q8_0), onnxruntime's only fast float32 path.

F16 weights run from the float32 copy onnxruntime folds their ``Cast`` into (2x the file in memory; a cast
per call made decode 6-7x slower: :meth:`ethen.model.engine.Engine.session_options`). BF16 weights are cast
per call (1x the file, file-backed; ~9x slower than F16: onnxruntime does not fold that cast, and a float32
copy would double the memory of the models that need it most).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["BYTES_PER_BLOCK", "DENSE_TYPES", "PACKED_BITS", "QUANT_TYPES", "Dense", "NBits", "Packed",
           "k_mins", "nibble_halves", "pack", "row_bytes"]

U8 = NDArray[np.uint8]
F32 = NDArray[np.float32]

#: (weights per block, bytes per block) of each GGUF type
BYTES_PER_BLOCK: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
#: the bits each block type is packed in (:func:`pack`)
PACKED_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
DENSE_TYPES = ("F32", "F16", "BF16")


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of ``cols`` weights of GGUF type ``kind``."""
    per, size = BYTES_PER_BLOCK[kind]
    if cols % per:
        raise ValueError(f"a {kind} row needs a multiple of {per} weights, got {cols}")
    return cols // per * size


@dataclass(frozen=True, slots=True)
class NBits:
    """``W [R, K]`` as ``MatMulNBits`` blocks; ``mins`` the optional per-block minimum term."""

    rows: int
    cols: int
    bits: int  # 4 or 8
    block: int  # 16 or 32
    data: NDArray[Any]  # uint8 [R, K / block, block * bits / 8]
    scales: F32  # [R * K / block]
    zero_points: U8 | None  # [R * ceil(K / block * bits / 8)] packed; None: 2^(bits - 1)
    mins_f16: NDArray[np.float16] | None = None  # [K / block, R]: w += min (Q4_1)
    mins: NBits | None = None  # the K-quants' - dmin * m as a 4-bit matrix [R, K / 16] (:func:`k_mins`)

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scales, self.zero_points, self.mins_f16)
        own = sum(int(p.nbytes) for p in parts if p is not None)
        return own + (self.mins.nbytes if self.mins is not None else 0)


@dataclass(frozen=True, slots=True)
class Dense:
    """``W.T [K, R]`` as stored (float32, float16 or bfloat16 bits in a uint16 array), cast per call."""

    rows: int
    cols: int
    kind: str  # "F32" | "F16" | "BF16"
    data_t: NDArray[np.generic]  # [K, R]

    @property
    def nbytes(self) -> int:
        return int(self.data_t.nbytes)


Packed = NBits | Dense


def _f16(b: U8) -> F32:
    """Little-endian float16 fields ``b [..., 2]`` -> float32 ``[...]``."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(vals: NDArray[Any]) -> U8:
    """``vals [..., n]`` 4-bit values -> ``[..., n / 2]`` bytes, element 2i in the low nibble."""
    out: U8 = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
    return out


def _zero_nibbles(rows: int, nb: int) -> U8:
    return np.zeros(rows * ((nb + 1) // 2), dtype=np.uint8)  # 4-bit zero points, all 0


def _q4_1_shifted_mins(d: F32, mins: NDArray[np.float16]) -> NDArray[np.float16] | None:
    """Q4_1's ``w = d q + m`` as ``d (q - 8) + (m + 8 d)``: ``m + 8 d`` per block ``[R, nb]`` when every one
    is a float16 (so the minimum term keeps the file's 2 bytes per block), else None. Why: the 4-bit matrix
    then runs at ``MatMulNBits``' default zero point (8), without a zero-point input of zeros, which made
    onnxruntime's float32-compute kernel ~14 % slower (``bench/quant_profile.py --zero-points``: SmolLM2's
    four matrices of a layer, streamed, 1 row, 769 against 669 us) and was read in place on every call.
    Exact: ``d (q - 8)`` is what the kernel computes for ``q`` at zero point 8, and ``m + 8 d`` is checked to
    be representable (in SmolLM2's file all but 2 of 3.3 million blocks are; a matrix with one that is not
    keeps zero points of 0 and ``m``). Numerically the product is no worse: the two terms no longer cancel
    (``m`` is near ``-8 d`` when a block's weights are centred)."""
    with np.errstate(over="ignore", invalid="ignore"):
        exact = mins.astype(np.float64) + 8.0 * d.astype(np.float64)  # [R, nb] (d: a float16's value)
        shifted = exact.astype(np.float16)
    if not (np.isfinite(shifted).all() and (shifted.astype(np.float64) == exact).all()):
        return None
    return shifted


def _k_scale_min(scales: U8) -> tuple[U8, U8]:
    """The K-quants' 12 bytes of packed 6-bit (scale, min) -> ``[n, 8]`` each (``gguf.quants.Q4_K``)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.uint8), mn.astype(np.uint8)


def pack(kind: str, raw: U8, rows: int, cols: int) -> Packed:
    """``raw [rows, row_bytes]`` (a GGUF tensor of ``kind``, rows = output features) -> engine layout."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, row_bytes(kind, cols))
    if kind in DENSE_TYPES:
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
        return Dense(rows, cols, kind, np.ascontiguousarray(raw.view(dtype).reshape(rows, cols).T))  # [K, R]
    r = rows
    vals: NDArray[Any]
    blk: NDArray[Any]
    qs: NDArray[Any]
    ql: NDArray[Any]
    qh: NDArray[Any]
    if kind == "Q4_0":
        blk = raw.reshape(r, -1, 18)
        qs = blk[:, :, 2:]  # [R, nb, 16]: element j low nibble, j + 16 high nibble
        vals = np.concatenate([qs & 15, qs >> 4], axis=2)  # [R, nb, 32]
        return NBits(r, cols, 4, 32, _nibbles(vals), _f16(blk[:, :, 0:2]).reshape(-1), None)
    if kind == "Q4_1":
        blk = raw.reshape(r, -1, 20)
        qs = blk[:, :, 4:]
        vals = np.concatenate([qs & 15, qs >> 4], axis=2)  # [R, nb, 32]
        nb = blk.shape[1]
        d = _f16(blk[:, :, 0:2])  # [R, nb]
        mins = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16)[..., 0]  # [R, nb]
        shifted = _q4_1_shifted_mins(d, mins)
        if shifted is not None:  # w = d (q - 8) + (m + 8 d): the default zero point, no zero-point input
            return NBits(r, cols, 4, 32, _nibbles(vals), d.reshape(-1), None,
                         mins_f16=np.ascontiguousarray(shifted.T))
        return NBits(r, cols, 4, 32, _nibbles(vals), d.reshape(-1), _zero_nibbles(r, nb),
                     mins_f16=np.ascontiguousarray(mins.T))
    if kind == "Q8_0":
        blk = raw.reshape(r, -1, 34)
        vals = (blk[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [R, nb, 32]
        return NBits(r, cols, 8, 32, vals, _f16(blk[:, :, 0:2]).reshape(-1), None)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        kb: NDArray[Any] = raw.reshape(-1, size)  # [R * nsb, size]
        blk = kb
        n = blk.shape[0]
        d, dmin = _f16(blk[:, 0:2]), blk[:, 2:4]
        sc, m = _k_scale_min(blk[:, 4:16])  # [n, 8] x2
        if kind == "Q4_K":
            qs = blk[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            vals = (qs & 15).reshape(n, 8, 32)
        else:
            qh = blk[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            ql = blk[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            vals = ((ql & 15).reshape(n, 8, 32) | ((qh & 1) << 4)).astype(np.uint8)
        nsb = n // r
        scales = (d[:, None] * sc.astype(np.float32)).reshape(-1)  # [R * nb] exact in float32
        kmins = k_mins(m.reshape(r, nsb, 8), _f16(dmin).reshape(r, nsb))
        nb = nsb * 8
        if kind == "Q4_K":
            return NBits(r, cols, 4, 32, _nibbles(vals.reshape(r, nb, 32)), scales, _zero_nibbles(r, nb),
                         mins=kmins)
        return NBits(r, cols, 8, 32, vals.reshape(r, nb, 32), scales, np.zeros(r * nb, np.uint8), mins=kmins)
    if kind == "Q6_K":
        sb: NDArray[Any] = raw.reshape(-1, 210)
        blk = sb
        n = blk.shape[0]
        ql = blk[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 15).reshape(n, 8, 32)
        qh = blk[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 3).reshape(n, 8, 32)
        vals = ((ql | (qh << 4)) + 96).astype(np.uint8)  # q in 0..63, w = s (q - 32) = s (u - 128)
        sc = blk[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        scales = (_f16(blk[:, 208:210])[:, None] * sc).reshape(-1)  # [R * K / 16]
        return NBits(r, cols, 8, 16, vals.reshape(r, -1, 16), scales, None)
    raise ValueError(f"tensor type {kind} has no engine layout (supported: {QUANT_TYPES + DENSE_TYPES})")


def k_mins(m: U8, dmin: F32) -> NBits:
    """The K-quants' minimum term ``- dmin * m`` (``m [R, nsb, 8]`` 6-bit per 32-weight sub-block, ``dmin
    [R, nsb]`` per 256-weight super-block) as a 4-bit ``MatMulNBits`` matrix ``[R, 16 nsb]``, block 16, one
    block per super-block: ``[m & 15 (8 values), m >> 4 (8 values)]``, scale ``-dmin``, zero point 0.
    :meth:`ethen.model.engine.GraphBuilder.linear` multiplies it by ``[xsum, 16 xsum]`` per super-block
    (``xsum`` the sums of x over its 8 sub-blocks): ``-dmin ((m & 15) xsum + (m >> 4) 16 xsum) = -dmin m
    xsum``, exact (``16 xsum`` is). Why: the term was a float ``MatMul`` over ``Cast(m) * Cast(dmin)``
    built on every call (TinyLlama's gate|up, 1 row, float32 compute: 0.55 ms next to the 4-bit matmul's
    2.5 ms; now 0.2 ms); it reads 12.5 bytes per super-block (was 10)."""
    r, nsb = dmin.shape
    vals = np.concatenate([m & 15, m >> 4], axis=2).astype(np.uint8)  # [R, nsb, 16]
    return NBits(r, 16 * nsb, 4, 16, _nibbles(vals), np.ascontiguousarray(-dmin, np.float32).reshape(-1),
                 _zero_nibbles(r, nsb))


def nibble_halves(w: NBits) -> NBits:
    """An 8-bit ``W [R, K]`` as one 4-bit matrix ``[W_hi | W_lo]`` of ``[R, 2K]`` (to multiply ``[x, x]``),
    exact: with ``u = 16 h + l`` and zero point ``z`` (a multiple of 16), ``s (u - z) = 16 s (h - z / 16) +
    s l``. Why: onnxruntime's CPU ``MatMulNBits`` has no float32-compute kernel for 8 bits (at accuracy 0
    it dequantizes the whole matrix on every call: SmolLM2's Q8_0 head took 134-208 ms per token against
    10 ms as halves), while 4 bits has one. Costs 8 more bytes of scales per block (Q8_0: 41 bytes per 32
    weights against the file's 34). The per-block minimum term is not carried (the caller keeps ``w``'s)."""
    if w.bits != 8:
        raise ValueError(f"nibble_halves splits 8-bit blocks, got {w.bits}-bit")
    r, nb = w.rows, w.cols // w.block
    u = w.data.reshape(r, nb, w.block)  # [R, nb, block]
    z = (np.full((r, nb), 128, np.uint8) if w.zero_points is None
         else np.asarray(w.zero_points, np.uint8).reshape(r, nb))  # [R, nb]
    if (z % 16).any():
        raise ValueError("nibble_halves needs zero points that are multiples of 16")
    data = np.concatenate([_nibbles(u >> 4), _nibbles(u & 15)], axis=1)  # [R, 2 nb, block / 2]
    s = w.scales.reshape(r, nb)
    scales = np.concatenate([16 * s, s], axis=1).reshape(-1).astype(np.float32)  # [R * 2 nb] (16 s exact)
    zp = _nibbles(np.concatenate([z >> 4, np.zeros_like(z)], axis=1)).reshape(-1)  # [R * nb]: 2 per byte
    return NBits(r, 2 * w.cols, 4, w.block, np.ascontiguousarray(data), scales, zp)
