"""The compute engine: onnxruntime graphs over weights kept in the GGUF's block layouts (:mod:`quant`).

A layer is two small graphs, each one ``session.run`` (per-op Python overhead was ~1/3 of decode with one
NumPy call per op):

* ``attn_in``: ``x [N, d]`` -> RMSNorm -> Q | K | V (one ``MatMulNBits`` when the three share a type)
  (+ biases) -> ``qkv [N, qd + 2 kvd]``;
* ``attn_out_ffn``: ``x [N, d]``, ``att [N, qd]`` -> ``x + att @ Wo.T`` -> RMSNorm -> gate | up -> SiLU(gate)
  * up -> down -> residual -> ``x [N, d]``.

RMSNorm is onnxruntime's one-op ``SimplifiedLayerNormalization`` (the ffn norm with the residual add before
it: ``SkipSimplifiedLayerNormalization``); Q4_1's min term is one ``Gemm`` with the main product as its
``C``. RoPE, the KV cache and attention are per session and outside the graphs: one numba call per session
for decode rows (:mod:`ethen.model.attend`), NumPy for longer segments (:mod:`ethen.model.layers`). The
head is one more graph (RMSNorm + the vocabulary matmul over the tied embedding's own blocks).

Choices where the issue is silent:

* Accuracy: :data:`ACCURACY_FAST` is ``MatMulNBits`` ``accuracy_level`` 4 (int8 activations per block,
  int8 dot products - what llama.cpp does with its Q8 activations; ``Engine``'s own default);
  :data:`ACCURACY_EXACT` (0) computes in float32 from the same weights (2-3x slower);
  :data:`ACCURACY_EXACT_INT8` gets float32-grade products from the int8 kernel by running each row as 3 rows
  it quantizes without loss (:meth:`GraphBuilder.split3`); :data:`ACCURACY_AUTO` (what ``--accuracy``
  defaults to) is exact-int8 for 8-bit blocks and exact for the rest.
* Constant folding is disabled, and optimization stops at onnxruntime's extended level (its last level
  folds the ``Cast`` of float16 constants, e.g. Q4_1's minimum terms, into float32 copies: the memory the
  issue removes), except for graphs with F16 weights, where that float32 copy is what makes them fast
  (:meth:`Engine.session_options`).
* Threads: ``threads`` intra-op threads (default :func:`default_threads`: the process's cores up to 4;
  ``ethen worker --threads``). ``pool`` (:data:`THREAD_POOLS`): ``session`` (the default) gives each session a
  pool of its own whose threads sleep between parallel ops (right where processes share the cores: the
  loopback mesh, a gateway); ``shared`` runs every session of the process on one pool whose threads spin
  (what llama.cpp does; :func:`shared_pool`), for a process that has its cores to itself (``ethen
  worker``'s default). Once a process has the shared pool, all its engines run on it (onnxruntime allows
  nothing else), whatever ``pool`` and ``threads`` they ask.
* Devices: ``cpu``, ``cuda`` (onnxruntime-gpu's ``CUDAExecutionProvider``; a clear error when absent) or
  ``auto`` (cuda when available, else cpu).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import ModelError
from ethen.model.onnx_wire import BFLOAT16, Node, Tensor, model_bytes
from ethen.model.quant import Dense, NBits, Packed, nibble_halves

__all__ = ["ACCURACY_AUTO", "ACCURACY_EXACT", "ACCURACY_EXACT_INT8", "ACCURACY_FAST", "DEVICES",
           "PREFILL_ROWS", "THREAD_POOLS", "Engine", "EngineError", "GraphBuilder", "default_threads",
           "process_pool", "resolve_accuracy", "shared_pool"]

F32 = NDArray[np.float32]

ACCURACY_FAST = 4  # int8 activations, int8 dot products
ACCURACY_EXACT = 0  # float32 compute
#: float32-grade results from the int8 kernel: x split into 3 rows it quantizes without loss
#: (:meth:`GraphBuilder.split3`); not an onnxruntime level (``MatMulNBits`` gets ``ACCURACY_FAST``)
ACCURACY_EXACT_INT8 = 16
#: the default: ``ACCURACY_EXACT_INT8`` for 8-bit blocks (Q8_0, Q5_K, Q6_K: as accurate as float32 compute,
#: 2x its decode speed, no nibble halves), ``ACCURACY_EXACT`` for 4-bit blocks (where the int8 split runs a
#: 512-row prefill 2x slower) and float weights; resolved per matrix in :meth:`GraphBuilder.linear`
ACCURACY_AUTO = 32
#: with ``Engine(long_prefill=True)`` (always from :func:`onnx_engine
#: <ethen.model.qmodel.onnx_engine>`), steps of at least this many rows (a prefill) run a graph's long
#: variant when it has one (:meth:`GraphBuilder.long_variant`): its 8-bit block matrices at exact-int8 go
#: through onnxruntime's float32-compute 8-bit kernel, which dequantizes the matrix on each call (~100 ms for
#: TinyLlama's gate|up, then one float32 GEMM) where the int8 split costs ~1.3 ms per row. Measured on one
#: thread: the two cross at ~100-128 rows (TinyLlama's gate|up and down), the kernel is 2.1-2.5x faster at
#: 512 rows, and its error is float32 compute's (2-3e-7 of max |y| against 5-10e-7). The variant reads the
#: weights in place from the backing file (:meth:`Engine.session`): ~2 MiB more for 8 layers of 91 MiB
PREFILL_ROWS = 128
DEVICES = ("auto", "cpu", "cuda")
#: ``Engine(pool=...)``: a pool of threads per session, or one per process (:func:`shared_pool`)
THREAD_POOLS = ("session", "shared")
_OPSET = 21


class EngineError(ModelError):
    """The engine cannot run as asked (e.g. ``--device cuda`` without onnxruntime-gpu or a GPU)."""


#: the default thread count's cap (only 1 and 2 threads were measured: a 2-core VM)
MAX_DEFAULT_THREADS = 4


def default_threads() -> int:
    """The cores this process may run on, at most :data:`MAX_DEFAULT_THREADS` (``ethen worker --threads``
    sets a count instead).
    Why not 1: the 3-worker loopback mesh on 2 cores, the same workers at 1 and 2 threads interleaved
    (``bench/mesh_decode.py --threads-ab``), decoded 8 sessions 1.21x and 4 sessions 1.12x faster at 2, one
    session as fast (1.02x): a batched round's many-row matmuls split well over threads, and in a pipeline
    only one or two stages compute at a time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores))


def resolve_accuracy(accuracy: int, bits: int) -> int:
    """The level a ``bits``-bit block matrix runs at under ``accuracy`` (:data:`ACCURACY_AUTO`: exact-int8
    for 8 bits, exact for 4)."""
    if accuracy == ACCURACY_AUTO:
        return ACCURACY_EXACT_INT8 if bits == 8 else ACCURACY_EXACT
    return accuracy


class GraphBuilder:
    """A small ONNX graph: float32 inputs, nodes, initializers (weights), float32 outputs (written by
    :mod:`ethen.model.onnx_wire`, without importing the ``onnx`` package)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.inits: list[Tensor] = []
        self.inputs: list[tuple[str, list[int | str]]] = []
        self.outputs: list[tuple[str, list[int | str]]] = []
        self._n = 0
        self.weight_bytes = 0  # bytes of the weights as this graph holds them
        # the long variant: (first node, end node, the one node that replaces nodes[first:end]) per 8-bit
        # exact-int8 matmul; None once a matmul the variant could not keep weight-free was added
        self._long: list[tuple[int, int, Node]] | None = []
        # F16 weights: let onnxruntime fold their Cast into a float32 copy (:meth:`Engine.session_options`)
        self.fold_f16 = False

    def fresh(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def input(self, name: str, cols: int) -> str:
        self.inputs.append((name, ["N", cols]))
        return name

    def output(self, name: str, cols: int) -> None:
        self.outputs.append((name, ["N", cols]))

    def const(self, arr: NDArray[Any], stem: str = "w", weight: bool = True) -> str:
        name = self.fresh(stem)
        self.inits.append(Tensor.of(name, arr))
        if weight:
            self.weight_bytes += int(arr.nbytes)
        return name

    def bf16_const(self, bits: NDArray[np.uint16]) -> str:
        name = self.fresh("w_bf16")
        self.inits.append(Tensor.of(name, bits, BFLOAT16))
        self.weight_bytes += int(bits.nbytes)
        return name

    def op(self, op_type: str, inputs: Sequence[str], domain: str = "",
           **attrs: int | float | list[int]) -> str:
        out = self.fresh(op_type.lower())
        self.node(op_type, inputs, [out], domain, **attrs)
        return out

    def node(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], domain: str = "",
             **attrs: int | float | list[int]) -> None:
        """A node with the output names given (e.g. a graph output's)."""
        self.nodes.append(Node(op_type, list(inputs), list(outputs), domain, dict(attrs)))

    def rms_norm(self, x: str, weight: F32, eps: float) -> str:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (onnxruntime's one-op RMSNorm)."""
        g = self.const(weight.astype(np.float32), "g")
        return self.op("SimplifiedLayerNormalization", [x, g], axis=-1, epsilon=float(eps))  # [N, d]

    def add_rms_norm(self, x: str, skip: str, weight: F32, eps: float) -> tuple[str, str]:
        """``(rms_norm(x + skip), x + skip)`` in one op (onnxruntime's ``SkipSimplifiedLayerNormalization``:
        the residual add and the next norm)."""
        g = self.const(weight.astype(np.float32), "g")
        normed, total = self.fresh("skipnorm"), self.fresh("residual")
        self.node("SkipSimplifiedLayerNormalization", [x, skip, g], [normed, "", "", total], "com.microsoft",
                  epsilon=float(eps))
        return normed, total  # [N, d] x2

    def linear(self, x: str, w: Packed, accuracy: int) -> str:
        """``x [N, K] @ W.T`` -> ``[N, R]`` for ``W`` in its packed layout."""
        if isinstance(w, Dense):
            self._long = None  # float weights: onnxruntime would pack a second float32 copy for the variant
            if w.kind == "F32":
                return self.op("MatMul", [x, self.const(w.data_t)])  # [N, R]
            src = self.bf16_const(w.data_t.view(np.uint16)) if w.kind == "BF16" else self.const(w.data_t)
            self.fold_f16 = self.fold_f16 or w.kind == "F16"
            return self.op("MatMul", [x, self.op("Cast", [src], to=1)])  # [K, R] float32 per call
        nb = w.cols // w.block
        accuracy = resolve_accuracy(accuracy, w.bits)
        if accuracy == ACCURACY_EXACT_INT8:
            first, weights = len(self.nodes), self._nbits_weights(w)
            rows = self.op("Reshape", [self.split3(x, w.cols, w.block), self.const(
                np.array([-1, w.cols], np.int64), "shape", False)])  # [3N, K]
            y3 = self.op("Reshape", [self._nbits(rows, w, ACCURACY_FAST, weights), self.const(
                np.array([3, -1, w.rows], np.int64), "shape", False)])  # [3, N, R]
            y = self.op("ReduceSum", [y3, self.const(np.array([0], np.int64), "ax", False)], keepdims=0)
            if w.bits == 8 and self._long is not None:  # the long variant: one float32-compute matmul
                one = self._nbits_node(x, w, ACCURACY_EXACT, weights, y)  # [N, R] as y
                self._long.append((first, len(self.nodes), one))
            elif w.bits != 8:
                self._long = None  # 4 bits: the variant's float32 kernel would prepack a second copy
        else:
            self._long = None
            # float32 compute over 8 bits: as two 4-bit halves over [x, x] (onnxruntime's 8-bit CPU kernel
            # at accuracy 0 dequantizes the whole matrix per call, 10-20x slower; see quant.nibble_halves)
            mat = nibble_halves(w) if w.bits == 8 and accuracy == ACCURACY_EXACT else w
            xin = x if mat is w else self.op("Concat", [x, x], axis=1)  # [N, K] or [N, 2K]
            y = self._nbits(xin, mat, accuracy)  # [N, R]
        if w.mins_f16 is None and w.mins is None:
            return y
        if w.mins is not None:  # K-quants: w = d sc q - dmin m, the min term a 4-bit matrix (quant.k_mins)
            nsb = w.cols // 256
            sub = self.op("Reshape", [x, self.const(np.array([-1, nsb, 8, 32], np.int64), "shape", False)])
            xsum = self.op("ReduceSum", [sub, self.const(np.array([3], np.int64), "ax", False)],
                           keepdims=0)  # [N, nsb, 8]
            x16 = self.op("Mul", [xsum, self.const(np.array(16, np.float32), "c16", False)])  # exact
            xm = self.op("Reshape", [self.op("Concat", [xsum, x16], axis=2), self.const(
                np.array([-1, 16 * nsb], np.int64), "shape", False)])  # [N, 16 nsb]
            # float32 compute at every accuracy: the min term is exact and ~1/16 of the main matmul (as
            # int8 activations, a block's xsum would be quantized with 16 xsum's step)
            return self.op("Add", [y, self._nbits(xm, w.mins, ACCURACY_EXACT)])  # [N, R]
        blocks = self.op("Reshape", [x, self.const(np.array([-1, nb, w.block], np.int64), "shape", False)])
        xsum = self.op("ReduceSum", [blocks, self.const(np.array([2], np.int64), "ax", False)],
                       keepdims=0)  # [N, nb]
        assert w.mins_f16 is not None
        mins = self.op("Cast", [self.const(w.mins_f16)], to=1)  # [nb, R]  Q4_1: w = d q + m
        return self.op("Gemm", [xsum, mins, y])  # [N, R]  xsum @ mins + y

    def split3(self, x: str, cols: int, block: int) -> str:
        """``x [N, cols]`` -> ``[3N, cols / block, block]``: rows ``x1``, ``x2``, ``r``, ``x = x1 + x2 + r``,
        where ``x1 = round(x / s1) s1`` per block (``s1 = max |x| / 127``: exactly what the int8 kernel's own
        per-block quantization keeps, so it loses nothing of ``x1``), ``x2`` the same of ``x - x1``, ``r`` the
        rest (``|r| <= max |x| / 127 / 254 / 2`` per block; the kernel quantizes it with its own error of
        ~1/254 of that). So the three int8 products summed are float32-grade: per block, ~1e-7 of its
        largest |x| (float32 compute: ~6e-8 of each value, plus its summation error)."""
        nb = cols // block
        r = self.op("Reshape", [x, self.const(np.array([-1, nb, block], np.int64), "shape", False)])
        ax = self.const(np.array([2], np.int64), "ax", False)
        c127 = self.const(np.array(127, np.float32), "c", False)
        tiny = self.const(np.array(1e-30, np.float32), "c", False)  # an all-zero block: 0 / tiny = 0
        parts = []
        for _ in range(2):
            amax = self.op("ReduceMax", [self.op("Abs", [r]), ax], keepdims=1)  # [N, nb, 1]
            s = self.op("Max", [self.op("Div", [amax, c127]), tiny])
            q = self.op("Mul", [self.op("Round", [self.op("Div", [r, s])]), s])  # s * an int in -127..127
            parts.append(q)
            r = self.op("Sub", [r, q])
        return self.op("Concat", [*parts, r], axis=0)  # [3N, nb, block]

    def _nbits_weights(self, mat: NBits) -> list[str]:
        """The initializers of ``mat``'s ``MatMulNBits``: data, scales[, zero points]."""
        names = [self.const(mat.data), self.const(mat.scales)]
        return names + ([self.const(mat.zero_points)] if mat.zero_points is not None else [])

    def _nbits_node(self, x: str, mat: NBits, accuracy: int, weights: list[str], out: str) -> Node:
        return Node("MatMulNBits", [x, *weights], [out], "com.microsoft",
                    {"K": mat.cols, "N": mat.rows, "bits": mat.bits, "block_size": mat.block,
                     "accuracy_level": accuracy})

    def _nbits(self, x: str, mat: NBits, accuracy: int, weights: list[str] | None = None) -> str:
        """One ``MatMulNBits``: ``x [N, K] @ mat.T`` -> ``[N, R]`` (over ``weights`` when given)."""
        out = self.fresh("matmulnbits")
        self.nodes.append(self._nbits_node(x, mat, accuracy, self._nbits_weights(mat) if weights is None
                                           else weights, out))
        return out  # [N, R]

    def long_variant(self) -> GraphBuilder | None:
        """This graph for steps of :data:`PREFILL_ROWS` rows or more: each 8-bit exact-int8 matmul (the
        int8 split, 3 rows per row) replaced by one float32-compute ``MatMulNBits`` over the same weights
        (onnxruntime prepacks nothing for it and reads the backing file in place: +1.3 MiB of anonymous
        memory for a 22 MiB matrix). None when the graph has no such matmul, or has one the variant would
        need a second prepacked copy of (4-bit blocks, float weights). The variant shares this graph's
        initializers: build both sessions with :meth:`Engine.sessions`."""
        if not self._long:
            return None
        out = GraphBuilder(f"{self.name}-long")
        out.inits, out.inputs, out.outputs, out.weight_bytes = self.inits, self.inputs, self.outputs, 0
        nodes, at = [], 0
        for first, end, node in self._long:
            nodes += [*self.nodes[at:first], node]
            at = end
        out.nodes = nodes + self.nodes[at:]
        out._long = None
        out.fold_f16 = self.fold_f16
        return out

    def model_bytes(self) -> bytes:
        return model_bytes(self.name, self.nodes, self.inits, self.inputs, self.outputs,
                           [("", _OPSET), ("com.microsoft", 1)], ir_version=10)


_pool_lock = threading.Lock()
_pool_threads: int | None = None  # the size of the process's shared intra-op pool, once set


def process_pool() -> int | None:
    """The size of the process's shared pool (:func:`shared_pool`), None while it has none."""
    return _pool_threads


def shared_pool(threads: int) -> int:
    """The size of the process's one shared pool of intra-op threads (onnxruntime's global thread pools),
    which the first call makes ``threads`` big: a later call gets that size whatever it asks, since every
    session of a process that has the pool must run on it (onnxruntime refuses a session a pool of its own
    then: "use_per_session_threads must be false when using a global thread pool").

    The pool's threads spin between the parallel ops of a run and for a while (~50 ms here) after it ends,
    as llama.cpp's do: onnxruntime stops spinning at the end of a run only for a session's own pool
    (``session.force_spinning_stop``), and a pool per session cannot spin either, as 60 pools (SmolLM2's 30
    layers, two graphs each) spinning in turn made a 1-row step 2x slower. Measured on 2 cores, 2 threads,
    alternated fresh processes (``bench/model_decode.py --vs-llama-cpp`` has the same-run figures):
    SmolLM2's 30 layers, 1 row 20.7-35.1 -> 14.7-17.4 ms, 8 rows 64.8-69.9 -> 52.0-56.5 ms, 128-row prefill
    361-394 -> 280-359 ms; TinyLlama-shape Q4_K 1 row 110 -> 96 ms, 8 rows 492 -> 348 ms; and 4 threads in
    the process instead of 63, RssAnon after a few 4-row steps +81 -> +69 MiB for the 30 layers (each pool
    thread kept its own scratch buffers)."""
    global _pool_threads
    from onnxruntime.capi import _pybind_state as ort_c

    with _pool_lock:
        if _pool_threads is None:
            # (Fail: the pools exist already, made by other code; their size is unknown here)
            with contextlib.suppress(ort_c.Fail):
                ort_c.set_global_thread_pool_sizes(threads, 1)
            _pool_threads = threads
        return _pool_threads


class Engine:
    """onnxruntime sessions on one device with one thread count (one engine per process)."""

    def __init__(self, device: str = "auto", threads: int | None = None,
                 accuracy: int = ACCURACY_FAST, long_prefill: bool = False, pool: str = "session") -> None:
        import onnxruntime as ort

        if device not in DEVICES:
            raise EngineError(f"device {device!r} is not one of {', '.join(DEVICES)}")
        available = ort.get_available_providers()
        has_cuda = "CUDAExecutionProvider" in available
        if device == "cuda" and not has_cuda:
            raise EngineError(
                "device 'cuda' needs onnxruntime-gpu with a CUDA GPU (pip install onnxruntime-gpu); "
                f"this onnxruntime offers {', '.join(available)}")
        self.device = "cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu"
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise EngineError(f"threads = {threads!r}: must be >= 1")
        if pool not in THREAD_POOLS:
            raise EngineError(f"thread pool {pool!r} is not one of {', '.join(THREAD_POOLS)}")
        if pool == "shared" or process_pool() is not None:
            # the process's pool (made here or by an earlier engine): once it exists, every session runs on
            # it, with its size (shared_pool)
            self.threads, self.pool = shared_pool(self.threads), "shared"
        else:
            self.pool = "session"
        self.accuracy = accuracy
        # build graphs' long variants (GraphBuilder.long_variant) for steps of PREFILL_ROWS rows or more
        self.long_prefill = long_prefill
        self._ort = ort
        self.providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if self.device == "cuda"
                          else ["CPUExecutionProvider"])

    def __repr__(self) -> str:
        return (f"Engine(device={self.device!r}, threads={self.threads}, accuracy={self.accuracy}, "
                f"long_prefill={self.long_prefill}, pool={self.pool!r})")

    def session(self, graph: GraphBuilder, backing: Path | None = None) -> Any:
        """The graph's session. With ``backing`` (a file path), the graph's large initializers are written
        there (the engine layout, about the GGUF's size) and the model refers to them as ONNX external data,
        which onnxruntime memory-maps: what it prepacks it copies, what it reads in place stays file-backed
        pages (the float32-compute 8-bit kernel's weights: +1.3 MiB of anonymous memory for a 22 MiB
        matrix, against +23 MiB when the same bytes came as ``add_external_initializers`` values, which
        onnxruntime copies). Measured, 20 SmolLM2 layers and a 4-row step: RssAnon +67 MiB, against +78 MiB
        as ``add_external_initializers`` values and +126 MiB with the weights in the model bytes; outputs bit
        for bit the same. Without a writable ``backing``: the weights go in the model."""
        return self.sessions([graph], backing)[0]

    def sessions(self, graphs: Sequence[GraphBuilder], backing: Path | None = None) -> list[Any]:
        """One session per graph, the graphs sharing the first one's initializers (its variants:
        :meth:`GraphBuilder.long_variant`), written once to ``backing`` as in :meth:`session`."""
        ort = self._ort
        so = self.session_options(graphs)
        if backing is not None:
            try:
                written = _write_initializers(graphs[0], backing)
            except OSError:
                written = False  # e.g. a read-only cache: the weights stay in the model bytes
            if written:  # the model comes as bytes: where its external data's relative names resolve
                so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                            str(backing.parent))
        return [ort.InferenceSession(g.model_bytes(), so, providers=self.providers,
                                     disabled_optimizers=["ConstantFolding"]) for g in graphs]

    def session_options(self, graphs: Sequence[GraphBuilder]) -> Any:
        """The ``onnxruntime.SessionOptions`` :meth:`sessions` builds ``graphs``' sessions with."""
        ort = self._ort
        so = ort.SessionOptions()
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        if self.pool == "shared" or process_pool() is not None:
            # the process's one pool (shared_pool), sized and spinning as set there; also for an engine of
            # a pool per session made before another engine made that pool (onnxruntime allows no other then)
            so.use_per_session_threads = False
        else:  # a pool of the session's own, its threads asleep between parallel ops (a shared machine)
            so.intra_op_num_threads = self.threads
            so.inter_op_num_threads = 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # no CPU arena: its buffers grow to the largest step's shapes and stay (a 512-row prefill left a
        # 20-layer worker at 740-850 MiB of anonymous memory for the rest of its life; 213-252 MiB without
        # the arena, decode and prefill times unchanged in the same run; ``tests/model/test_memory.py``).
        # Run options that shrink the arena after a large step only got it to 480-580 MiB.
        so.enable_cpu_mem_arena = False
        # Optimization stops at the extended level: the last level folds each ``Cast`` of a float16
        # constant into a float32 copy, which ``Gemm`` / ``MatMul`` then prepack. For Q4_1's min term that
        # copy is waste: 8 layers (d_model 1024) of a tiny Q4_1 model, 1 thread, fresh processes, RssAnon
        # 60.4 -> 49.6 MiB for 53.8 MiB of layers in the file (RSS 83.7 -> 78.2 MiB), decode steps 18.3 /
        # 19.5 ms -> 16.2 / 19.8 ms (noise); 30 SmolLM2 layers 83 -> 71 MiB at load. F16 weights keep the
        # fold (``fold_f16``): as a float32 copy (~2x the file: 350 MiB for 172 MiB) a step took 26-33 ms,
        # with a Cast per call 194-208 ms. (BF16 casts per call at either level: 240 ms.)
        fold = any(g.fold_f16 for g in graphs)
        so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if fold
                                       else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
        return so


_ALIGN = 64
_MIN_BYTES = 4096  # smaller initializers (norm weights, shapes) stay in the model


def _write_initializers(graph: GraphBuilder, path: Path) -> bool:
    """Write ``graph``'s large initializers to ``path`` (rewritten on every load, never trusted from an
    earlier run: a new file replaces it atomically, and a session still mapping the old one keeps it) and
    make them its external data; False when none is large."""
    big = [t for t in graph.inits if len(t.raw) >= _MIN_BYTES]
    if not big:
        return False
    offsets, size = [], 0
    for t in big:
        offsets.append(size)
        size += -(-len(t.raw) // _ALIGN) * _ALIGN
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        for t, off in zip(big, offsets, strict=True):
            f.seek(off)
            f.write(t.raw)
        f.truncate(size)
    os.replace(tmp, path)  # atomic: workers sharing layers may write the same file at once
    for t, off in zip(big, offsets, strict=True):
        t.external = (path.name, off, len(t.raw))
        t.raw = b""
    return True
