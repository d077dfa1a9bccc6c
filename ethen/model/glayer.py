"""The ggml engine: a layer's seven matmuls run by llama.cpp's own CPU kernels (:mod:`ethen.model.ggml_lib`)
over the GGUF's blocks read in place.

A layer's weights are ggml tensors whose ``data`` point into one read-only memory map of the GGUF: nothing
is copied, nothing is cached on disk, and every tensor type ggml reads works (the K-quants, the IQ types,
F16, BF16, F32). A layer step is two ggml graphs, as the onnxruntime engine's (:mod:`ethen.model.qmodel`):

* ``attn_in``: ``x [N, d]`` -> RMSNorm -> Q, K, V (``ggml_mul_mat``) -> ``qkv [N, qd + 2 kvd]``;
* ``attn_out_ffn``: ``x``, ``att [N, qd]`` -> ``x + att Wo^T`` -> RMSNorm -> gate, up -> SwiGLU -> down ->
  residual -> ``x [N, d]``.

RoPE, the KV cache and attention stay where the onnxruntime engine has them (:func:`ethen.model.qmodel.
attend_rows`, the numba kernel for decode rows), so the KV cache, the mesh's wire format and replay are
unchanged. Q/K rows: llama GGUFs store Q and K rows permuted for ggml's interleaved RoPE (``GGML_ROPE_TYPE
_NORM``); ggml reads them in place, so Q and K come out in the file's order, and one gather per step
(``qkv[:, order]``, :func:`qk_order`) puts their columns in the rotate-half order the attention kernel
rotates (the onnxruntime engine un-permutes the rows instead: :func:`ethen.model.gguf_loader.unpermute_qk`).
Rotating pairs ``(2i, 2i+1)`` of the file's order and rotating halves of the un-permuted order are the same
numbers, so the gather is exact.

Q4_0 / Q4_K matrices (of a multiple of 8 rows) are the exception to "in place": at load they are repacked
into ggml's ``CPU_REPACK`` buffer (its interleaved 8x8 kernels, as llama.cpp does by default), which measured
1.37x faster decode and 1.32x faster 64-row prefill on TinyLlama's shape (interleaved, 1 thread), and the
file's pages the repacking read are released: resident, one copy either way.

Numerics: ggml quantizes the activations of a quantized matrix's product to int8 blocks (Q8_0 / Q8_K, as
llama.cpp does), F16 / BF16 weights multiply F16 / BF16 activations, F32 weights float32.

Threads: one persistent ggml thread pool per process and thread count (:func:`process_engine`; ``ethen
worker --threads``); graphs run one at a time under a lock (ggml's pool runs one graph at once). Its threads
spin a while between graphs as llama.cpp's under the ``shared`` pool (``ethen worker --thread-pool``'s
default), else they sleep at once (processes sharing the cores: ``ethen up``'s workers and gateway).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.attend import warm_in_background
from ethen.model.config import ModelConfig
from ethen.model.engine import THREAD_POOLS, default_threads
from ethen.model.errors import GGUFFormatError, ModelInputError, WeightsNotFoundError
from ethen.model.ggml_lib import GGML_TYPES, GgmlError, GgmlInitParams, GgmlLib, lib
from ethen.model.gguf_loader import TensorInfo, WeightStore, unpermute_qk
from ethen.model.heap import release_mapped
from ethen.model.layers import AttentionSegment
from ethen.model.qmodel import attend_rows

__all__ = ["CHUNK_ROWS", "REPACK_TYPES", "GgmlEngine", "GgmlLayer", "GgmlWeights", "ggml_block",
           "load_ggml_layers", "map_gguf", "pool_threads", "process_engine", "qk_order", "tensor_f32"]

F32 = NDArray[np.float32]

#: rows per graph run: a longer step (a prefill) runs its matmuls in chunks of this many rows, which bounds
#: the graph's scratch memory (TinyLlama's layer: ~33 KiB per row) without slowing the kernels
CHUNK_ROWS = 256
_GRAPH_NODES = 32
#: types ggml's CPU_REPACK buffer takes (AVX2: Q4_0 and Q4_K into 8x8 interleaved blocks; Q8_0 / Q6_K there
#: crashed in the issue's probe), for matrices of a multiple of 8 rows
REPACK_TYPES = ("Q4_0", "Q4_K")


class GgmlEngine:
    """The process's ggml: its thread pool, a scratch buffer for graphs, a work buffer, one graph at a time.
    Layers (:class:`GgmlLayer`) build their graphs through :meth:`input` and :meth:`run`, so an engine that
    runs them elsewhere (:class:`ethen.model.gbackend.BackendEngine`: any ggml backend's device) overrides
    those two and :attr:`buffer_type`."""

    #: the ggml buffer type the layers' weights are uploaded into at load; 0: read in place in the map
    buffer_type: int = 0

    def __init__(self, threads: int | None = None, spin: bool = True) -> None:
        self.lib: GgmlLib = lib()
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise GgmlError(f"threads = {threads!r}: must be >= 1")
        self.spin = spin
        self.pool = self.lib.threadpool(self.threads, None if spin else 0)
        self.lock = threading.Lock()
        self._scratch = np.empty(0, np.uint8)
        self._work = np.empty(0, np.uint8)
        self._overhead = int(self.lib.ggml_tensor_overhead())
        self._graph_overhead = int(self.lib.ggml_graph_overhead_custom(_GRAPH_NODES, False))

    def __repr__(self) -> str:
        return f"GgmlEngine(threads={self.threads}, spin={self.spin})"

    def run(self, data_bytes: int, build: Callable[[int], Sequence[int]],
            outputs: Sequence[F32]) -> None:
        """Build a graph in a fresh context (``build(ctx)`` returns its output tensors), run it, copy the
        outputs into ``outputs`` (float32 arrays of the outputs' shapes). ``data_bytes``: the bytes of the
        tensors ``build`` makes (their data lives in the context's scratch)."""
        g = self.lib
        # (+ 1/8 and 1 MiB: alignment padding, and margin; ggml aborts the process when a context is full)
        size = self._graph_overhead + _GRAPH_NODES * (self._overhead + 64) + data_bytes * 9 // 8 + (1 << 20)
        with self.lock:
            if self._scratch.nbytes < size:
                self._scratch = np.empty(size, np.uint8)
            base = self._scratch.ctypes.data
            ctx = g.ggml_init(GgmlInitParams(self._scratch.nbytes, base, False))
            if not ctx:
                raise GgmlError("ggml_init failed")
            try:
                outs = build(ctx)
                graph = g.ggml_new_graph_custom(ctx, _GRAPH_NODES, False)
                for t in outs:
                    g.ggml_build_forward_expand(graph, t)
                plan = g.ggml_graph_plan(graph, self.threads, self.pool)
                if plan.work_size > self._work.nbytes:
                    self._work = np.empty(plan.work_size, np.uint8)
                plan.work_data = self._work.ctypes.data if plan.work_size else None
                status = g.ggml_graph_compute(graph, ctypes.byref(plan))
                if status != 0:
                    raise GgmlError(f"ggml_graph_compute failed (status {status})")
                for t, out in zip(outs, outputs, strict=True):
                    at = int(g.ggml_get_data(t)) - base
                    out[...] = self._scratch[at:at + out.nbytes].view(np.float32).reshape(out.shape)
            finally:
                g.ggml_free(ctx)

    def input(self, ctx: int, arr: F32) -> int:
        """A float32 tensor over ``arr [N, cols]`` (C-contiguous, kept alive by the caller)."""
        t = int(self.lib.ggml_new_tensor_2d(ctx, 0, arr.shape[1], arr.shape[0]))
        self.lib.set_data(t, arr.ctypes.data)
        return t


@dataclass
class GgmlWeights:
    """Tensors of a no-alloc ggml context whose data point into the mapped GGUF (or into arrays kept here)."""

    engine: GgmlEngine
    file: NDArray[np.uint8]  # the read-only map of the GGUF
    n_tensors: int
    repack: bool = False  # Q4_0 / Q4_K matrices into ggml's CPU_REPACK buffer (:meth:`finish`)
    ctx: int = 0
    keep: list[NDArray[Any]] = field(default_factory=list)
    # tensors (and the address and bytes of their data) for the buffer: matrices to repack, or every tensor
    # where the engine has a buffer type (a device's)
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    buffer: int = 0  # the CPU_REPACK buffer (or the device's)
    repacked_bytes: int = 0  # its bytes

    def __post_init__(self) -> None:
        g = self.engine.lib
        self.ctx = int(g.ggml_init(GgmlInitParams(
            (self.n_tensors + 4) * int(g.ggml_tensor_overhead()) + 1024, None, True)))
        if not self.ctx:
            raise GgmlError("ggml_init failed")

    def matrix(self, t: TensorInfo) -> int:
        """Tensor ``t`` ``[rows, cols]`` in place in the file."""
        g = self.engine.lib
        kind = GGML_TYPES.get(t.kind)
        if kind is None:
            raise GGUFFormatError(f"tensor {t.name!r} has type {t.kind}, which the ggml engine does not read")
        ptr = int(g.ggml_new_tensor_2d(self.ctx, kind, t.cols, t.rows))
        if int(g.ggml_nbytes(ptr)) != t.nbytes:
            raise GGUFFormatError(f"tensor {t.name!r} ({t.kind} {t.rows}x{t.cols}) has {t.nbytes} bytes in "
                                  f"the file, ggml expects {int(g.ggml_nbytes(ptr))}")
        if self.engine.buffer_type or (self.repack and t.kind in REPACK_TYPES and t.rows % 8 == 0):
            self.pending.append((ptr, self.file.ctypes.data + t.offset, t.nbytes))  # data: the buffer's
        else:
            g.set_data(ptr, self.file.ctypes.data + t.offset)
        return ptr

    def finish(self) -> None:
        """Allocate the buffer for the pending tensors and copy them from the file into it: the engine's
        buffer type (a device's), else ggml's ``CPU_REPACK`` (interleaved rows for its 8x8 kernels); no-op
        without any."""
        if not self.pending:
            return
        g = self.engine.lib
        buft = self.engine.buffer_type or g.extra_buffer_type("CPU_REPACK")
        if buft is None:  # a build without it: read them in place
            for ptr, data, _n in self.pending:
                g.set_data(ptr, data)
        else:
            self.buffer = int(g.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft) or 0)
            if not self.buffer:
                raise GgmlError(f"allocating a ggml {g.ggml_backend_buft_name(buft).decode()} buffer failed")
            for ptr, data, n in self.pending:
                g.ggml_backend_tensor_set(ptr, data, 0, n)
            self.repacked_bytes = int(g.ggml_backend_buffer_get_size(self.buffer))
        self.pending = []

    def vector(self, arr: F32) -> int:
        """A float32 ``[n]`` tensor over ``arr`` (kept alive here)."""
        a = np.ascontiguousarray(arr, dtype=np.float32)
        self.keep.append(a)
        ptr = int(self.engine.lib.ggml_new_tensor_1d(self.ctx, 0, a.shape[0]))
        if self.engine.buffer_type:
            self.pending.append((ptr, a.ctypes.data, a.nbytes))
        else:
            self.engine.lib.set_data(ptr, a.ctypes.data)
        return ptr

    def close(self) -> None:
        if self.buffer:
            self.engine.lib.ggml_backend_buffer_free(self.buffer)
            self.buffer = 0
        if self.ctx:
            self.engine.lib.ggml_free(self.ctx)
            self.ctx = 0

    def __del__(self) -> None:
        self.close()


def qk_order(rows: int, n_head: int) -> NDArray[np.int64]:
    """For each rotate-half (un-permuted) row, the row of the GGUF's permuted order it is."""
    out: NDArray[np.int64] = unpermute_qk(np.arange(rows, dtype=np.int64), n_head)  # type: ignore[arg-type,assignment]
    return out


@dataclass(eq=False)
class GgmlLayer:
    """One block over ggml tensors in the mapped GGUF."""

    index: int
    weights: GgmlWeights
    attn_norm: int
    wq: int
    wk: int
    wv: int
    wo: int
    ffn_norm: int
    gate: int
    up: int
    down: int
    eps: float
    order: NDArray[np.int64] | None  # qkv columns in rotate-half order (None: the file's order is it)
    bias: F32 | None  # Q|K|V biases [qd + 2 kvd] in rotate-half order
    nbytes: int  # the layer's tensors' bytes in the file (what it holds: the pages it reads)
    file_nbytes: int

    def attn_in(self, x: F32, cfg: ModelConfig) -> F32:
        """``x [N, d]`` -> ``qkv [N, qd + 2 kvd]`` (RMSNorm, Q|K|V, Q/K columns in rotate-half order)."""
        eng = self.weights.engine
        n = x.shape[0]
        qd, kvd = cfg.q_dim, cfg.kv_dim
        qkv = np.empty((n, qd + 2 * kvd), np.float32)
        q, k, v = (np.empty((n, c), np.float32) for c in (qd, kvd, kvd))
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(n, lo + CHUNK_ROWS)
            xc = np.ascontiguousarray(x[lo:hi])

            def build(ctx: int, xc: F32 = xc) -> list[int]:
                g = eng.lib
                h = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, eng.input(ctx, xc), self.eps), self.attn_norm)
                return [g.ggml_mul_mat(ctx, w, h) for w in (self.wq, self.wk, self.wv)]

            rows = hi - lo
            # x, norm, scaled, q, k, v
            eng.run(rows * 4 * (3 * cfg.d_model + qd + 2 * kvd), build, [q[lo:hi], k[lo:hi], v[lo:hi]])
        np.concatenate((q, k, v), axis=1, out=qkv)
        if self.order is not None:
            qkv = qkv[:, self.order]
        if self.bias is not None:
            qkv += self.bias
        return qkv

    def attn_out_ffn(self, x: F32, att: F32, cfg: ModelConfig) -> F32:
        """``x [N, d]``, ``att [N, qd]`` -> ``x [N, d]`` (output projection, residual, RMSNorm, SwiGLU FFN,
        residual)."""
        eng = self.weights.engine
        n, d = x.shape
        out = np.empty((n, d), np.float32)
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(n, lo + CHUNK_ROWS)
            xc, ac = np.ascontiguousarray(x[lo:hi]), np.ascontiguousarray(att[lo:hi])

            def build(ctx: int, xc: F32 = xc, ac: F32 = ac) -> list[int]:
                g = eng.lib
                x2 = g.ggml_add(ctx, eng.input(ctx, xc), g.ggml_mul_mat(ctx, self.wo, eng.input(ctx, ac)))
                m = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x2, self.eps), self.ffn_norm)
                hdn = g.ggml_swiglu_split(ctx, g.ggml_mul_mat(ctx, self.gate, m),
                                          g.ggml_mul_mat(ctx, self.up, m))
                return [g.ggml_add(ctx, x2, g.ggml_mul_mat(ctx, self.down, hdn))]

            rows = hi - lo
            # x, att, o, x2, norm, scaled, gate, up, swiglu, down, out: every tensor's data is in the context
            eng.run(rows * 4 * (7 * d + cfg.q_dim + 3 * cfg.d_ff), build, [out[lo:hi]])
        return out


def ggml_block(x: F32, w: GgmlLayer, cos: F32, sin: F32, segments: Sequence[AttentionSegment],
               cfg: ModelConfig) -> F32:
    """One layer step (a pre-norm Llama block over ggml): RoPE, the cache writes and attention
    as the onnxruntime engine's (:func:`ethen.model.qmodel.attend_rows`)."""
    qkv = w.attn_in(x, cfg)  # [N, qd + 2 kvd]
    return w.attn_out_ffn(x, attend_rows(qkv, cos, sin, segments, cfg), cfg)  # [N, d]


def tensor_f32(file: NDArray[np.uint8], t: TensorInfo) -> F32:
    """Tensor ``t`` of the mapped ``file`` dequantized to float32 ``[elements]`` (norms, biases)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = file[t.offset:t.offset + t.nbytes].reshape(t.rows, -1)
    return np.asarray(dequantize(raw, GGMLQuantizationType[t.kind]), dtype=np.float32).reshape(-1)


def _layer(weights: GgmlWeights, table: dict[str, TensorInfo], i: int, cfg: ModelConfig) -> GgmlLayer:
    p = f"blk.{i}."

    def info(name: str) -> TensorInfo:
        t = table.get(p + name)
        if t is None:
            raise GGUFFormatError(f"GGUF lacks tensor {p + name!r}")
        return t

    mats = {n: weights.matrix(info(n + ".weight")) for n in
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    qd, kvd = cfg.q_dim, cfg.kv_dim
    order: NDArray[np.int64] | None = None
    if cfg.qk_permuted:
        order = np.concatenate([qk_order(qd, cfg.n_heads), qd + qk_order(kvd, cfg.n_kv_heads),
                                np.arange(qd + kvd, qd + 2 * kvd)])
    bias: F32 | None = None
    if cfg.attn_bias:
        bq = tensor_f32(weights.file, info("attn_q.bias"))
        bk = tensor_f32(weights.file, info("attn_k.bias"))
        if cfg.qk_permuted:
            bq, bk = unpermute_qk(bq, cfg.n_heads), unpermute_qk(bk, cfg.n_kv_heads)
        bias = np.concatenate([bq, bk, tensor_f32(weights.file, info("attn_v.bias"))])
    nbytes = sum(t.nbytes for n, t in table.items() if n.startswith(p))
    return GgmlLayer(i, weights, weights.vector(tensor_f32(weights.file, info("attn_norm.weight"))),
                     mats["attn_q"], mats["attn_k"], mats["attn_v"], mats["attn_output"],
                     weights.vector(tensor_f32(weights.file, info("ffn_norm.weight"))), mats["ffn_gate"],
                     mats["ffn_up"], mats["ffn_down"], float(cfg.rms_eps), order, bias, nbytes, nbytes)


def map_gguf(store: WeightStore) -> NDArray[np.uint8]:
    """The store's GGUF, mapped read-only."""
    try:
        return np.memmap(store.gguf_path, dtype=np.uint8, mode="r")  # [file bytes]
    except OSError as exc:
        raise WeightsNotFoundError(f"cannot read GGUF {store.gguf_path}: {exc}") from exc


def pool_threads(threads: int | None, pool: str) -> int:
    """The threads of a ggml engine on ``pool`` (:func:`process_engine`): ``threads``, else under ``shared``
    :func:`~ethen.model.engine.default_threads`, else 1."""
    if pool not in THREAD_POOLS:
        raise ModelInputError(f"thread pool {pool!r}: must be one of {', '.join(THREAD_POOLS)}")
    if threads is not None:
        return int(threads)
    if pool == "shared":
        return default_threads()
    # processes sharing the cores: ggml's barriers spin inside a graph, and two threads on an oversubscribed
    return 1  # 2-core VM decoded at 2.7-9.9 tok/s against 70 (docs/decisions/0100)


_ENGINE_LOCK = threading.Lock()
_ENGINES: dict[tuple[int, bool], GgmlEngine] = {}


def process_engine(threads: int | None = None, pool: str = "session") -> GgmlEngine:
    """The process's engine of ``threads`` and ``pool``, one per thread count and pool. Its pool's threads
    spin a while between graphs (as llama.cpp's) where ``pool`` is ``shared`` (``ethen worker``'s default:
    a worker alone on its machine), and sleep at once under ``session`` (``ethen up``'s workers,
    :func:`~ethen.mesh.worker.launch.spawn_worker`; a gateway's head), as the onnxruntime engine's pools do.
    Without ``threads``: under ``shared`` :func:`~ethen.model.engine.default_threads`, else 1."""
    n, shared = pool_threads(threads, pool), pool == "shared"
    with _ENGINE_LOCK:
        if (n, shared) not in _ENGINES:
            _ENGINES[n, shared] = GgmlEngine(n, spin=shared)
        return _ENGINES[n, shared]


def load_ggml_layers(pairs: Sequence[tuple[int, int]], store: WeightStore,
                     engine: GgmlEngine | None = None, repack: bool = True) -> list[list[GgmlLayer]]:
    """The layers of each inclusive ``(start, end)`` of ``store``'s GGUF over one map of the file;
    ``repack``: their Q4_0 / Q4_K matrices repacked into ggml's CPU_REPACK buffer (anonymous memory; the
    file's pages they were read from released)."""
    cfg = store.config
    n = cfg.n_layers
    for start, end in pairs:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end < n):
            raise ModelInputError(f"layer range {start!r}-{end!r} must satisfy 0 <= start <= end <= {n - 1}")
    if not store.tensors:
        raise GGUFFormatError(f"weight cache {store.directory} lacks a tensor table (delete it)")
    eng = engine or process_engine()
    warm_in_background()  # the decode attention kernel (and LLVM's pages released), while the layers load
    file = map_gguf(store)
    out = []
    for lo, hi in pairs:
        weights = GgmlWeights(eng, file, 9 * (hi - lo + 1), repack)  # a context per fragment
        out.append([_layer(weights, store.tensors, i, cfg) for i in range(lo, hi + 1)])
        weights.finish()
        if weights.repacked_bytes:
            release_mapped(store.gguf_path)  # the pages the repacking read
    return out
