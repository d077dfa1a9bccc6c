"""Layers whose weights stay in the GGUF's own blocks, run by the engine (:mod:`ethen.model.engine`).

:func:`load_quant_layer_stack` reads the matrices of layers ``start..end`` straight from the GGUF, packs
them (:func:`ethen.model.quant.pack`, Q/K rows un-permuted by :func:`ethen.model.gguf_loader.unpermute_qk`:
a row permutation never crosses a quantization block) and compiles two graphs per layer, their weights
file-backed (``<cache dir>/engine/*.bin``, rewritten on each load, see :meth:`Engine.session`). The result
is a :class:`~ethen.model.model.LayerStack` (same ``forward`` / ``forward_batch``, same KV cache); its
:func:`quant_block` is one Llama block with the matmuls and norms in the graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.attend import MAX_ROWS, rope_attend, warm_in_background
from ethen.model.config import ModelConfig
from ethen.model.engine import (
    ACCURACY_AUTO,
    ACCURACY_EXACT,
    ACCURACY_FAST,
    PREFILL_ROWS,
    THREAD_POOLS,
    Engine,
    GraphBuilder,
    resolve_accuracy,
)
from ethen.model.errors import GGUFFormatError, ModelInputError, WeightsNotFoundError
from ethen.model.gguf_loader import TensorInfo, WeightStore, unpermute_qk
from ethen.model.heap import release_mapped, trim
from ethen.model.layers import AttentionSegment, apply_rope, attention, rms_norm
from ethen.model.qhead import BlockHead, build_block_head
from ethen.model.quant import PACKED_BITS, Packed, pack

__all__ = ["QuantEmbedAndHead", "QuantLayer", "attend_rows", "load_quant_layers", "onnx_engine",
           "quant_block"]

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class QuantLayer:
    """One block: two compiled graphs and the bytes of the weights they hold."""

    index: int
    attn_in: Any  # onnxruntime session: x [N, d] -> qkv [N, qd + 2 kvd]
    attn_out_ffn: Any  # x [N, d], att [N, qd] -> x [N, d]
    nbytes: int  # packed weight bytes
    file_nbytes: int  # bytes of this layer's tensors in the GGUF
    # the same graphs for steps of PREFILL_ROWS rows or more, where a graph has a long variant
    # (GraphBuilder.long_variant: 8-bit blocks at exact-int8); None: the graph above serves every step
    attn_in_long: Any = None
    attn_out_ffn_long: Any = None
    # the folder of the engine-layout files its sessions map (heap.release_mapped after long steps)
    backing: Path | None = None


def attend_rows(qkv: F32, cos: F32, sin: F32, segments: Sequence[AttentionSegment], cfg: ModelConfig) -> F32:
    """RoPE, this step's K/V into each segment's cache, attention: ``qkv [N, qd + 2 kvd]`` -> ``[N, qd]``."""
    n = qkv.shape[0]
    h, hkv, hd, qd, kvd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
    att = np.empty((n, qd), dtype=np.float32)  # [N, H*hd]
    if all(seg.stop - seg.start <= MAX_ROWS for seg in segments):  # decode rounds: one compiled call each
        for seg in segments:
            lo, hi = seg.start, seg.stop
            rope_attend(qkv[lo:hi], cos[lo:hi], sin[lo:hi], seg.k_buf, seg.v_buf, seg.n_past, h, hkv,
                        att[lo:hi])  # [T, H*hd]; K/V into the cache
        return att
    qk = apply_rope(qkv[:, :qd + kvd].reshape(n, h + hkv, hd), cos, sin)  # [N, H+Hkv, hd]
    q, k = qk[:, :h], qk[:, h:]  # [N, H, hd], [N, Hkv, hd]
    v = qkv[:, qd + kvd:].reshape(n, hkv, hd)  # [N, Hkv, hd]
    for seg in segments:
        lo, hi, past = seg.start, seg.stop, seg.n_past
        end = past + (hi - lo)
        seg.k_buf[:, past:end] = k[lo:hi].transpose(1, 0, 2)  # [Hkv, T, hd]
        seg.v_buf[:, past:end] = v[lo:hi].transpose(1, 0, 2)  # [Hkv, T, hd]
        att[lo:hi] = attention(q[lo:hi], seg.k_buf[:, :end], seg.v_buf[:, :end], past)  # [T, H*hd]
    return att


def quant_block(x: F32, w: QuantLayer, cos: F32, sin: F32, segments: Sequence[AttentionSegment],
                cfg: ModelConfig) -> F32:
    """One pre-norm Llama block over engine graphs; writes this step's K/V into the segments."""
    long = x.shape[0] >= PREFILL_ROWS
    attn_in = w.attn_in_long if long and w.attn_in_long is not None else w.attn_in
    attn_out_ffn = w.attn_out_ffn_long if long and w.attn_out_ffn_long is not None else w.attn_out_ffn
    qkv = attn_in.run(None, {"x": x})[0]  # [N, qd + 2 kvd]  RMSNorm + Q|K|V (+ biases)
    att = attend_rows(qkv, cos, sin, segments, cfg)  # [N, qd]
    out: F32 = attn_out_ffn.run(None, {"x": x, "att": att})[0]  # [N, d]  x + o(att) + FFN(...)
    return out


class _Tensors:
    """The GGUF's tensors by name, from the store's tensor table over one read-only map of the file (the
    ``GGUFReader`` is not opened again: it parses every tokenizer string, ~130 MB of Python objects)."""

    def __init__(self, store: WeightStore) -> None:
        if not store.tensors:
            raise GGUFFormatError(f"weight cache {store.directory} lacks a tensor table (delete it)")
        self.table = store.tensors
        self.path = store.gguf_path
        self.backing_dir = store.directory / "engine"  # the engine-layout files (Engine.session's backing)
        try:
            self.file = np.memmap(self.path, dtype=np.uint8, mode="r")  # [file bytes]
        except OSError as exc:
            raise WeightsNotFoundError(f"cannot read GGUF {self.path}: {exc}") from exc

    def info(self, name: str) -> TensorInfo:
        t = self.table.get(name)
        if t is None:
            raise GGUFFormatError(f"GGUF {self.path} lacks tensor {name!r}")
        return t

    def get(self, name: str) -> tuple[str, NDArray[np.uint8], int, int]:
        """``(type, raw [rows, row_bytes], rows, cols)`` of tensor ``name``, raw a view of the file."""
        t = self.info(name)
        raw = self.file[t.offset:t.offset + t.nbytes].reshape(t.rows, -1)  # [rows, row_bytes]
        return t.kind, raw, t.rows, t.cols

    def f32(self, name: str) -> F32:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        kind, raw, _rows, _cols = self.get(name)
        return np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(-1)

    def nbytes(self, prefix: str) -> int:
        return sum(t.nbytes for n, t in self.table.items() if n.startswith(prefix))


def _packed_rows(tensors: _Tensors, names: Sequence[str], heads: Sequence[int | None]) -> list[Packed]:
    """Pack ``names`` (each [rows, cols]); consecutive tensors of one type become one matrix (rows
    concatenated: one ``MatMulNBits`` instead of several). ``heads[i]``: un-permute Q/K rows."""
    groups: list[tuple[str, list[NDArray[np.uint8]], int]] = []
    for name, nh in zip(names, heads, strict=True):
        kind, raw, _rows, cols = tensors.get(name)
        if nh is not None:
            raw = unpermute_qk(raw, nh)  # type: ignore[arg-type,assignment]  # rows: bytes move whole
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(raw)
        else:
            groups.append((kind, [raw], cols))
    return [pack(kind, np.concatenate(raws, axis=0), sum(r.shape[0] for r in raws), cols)
            for kind, raws, cols in groups]


def _concat(g: GraphBuilder, x: str, mats: Sequence[Packed], accuracy: int) -> str:
    outs = [g.linear(x, m, accuracy) for m in mats]
    return outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)


def _qkv_bias(tensors: _Tensors, i: int, cfg: ModelConfig) -> F32 | None:
    """Layer ``i``'s Q|K|V biases ``[qd + 2 kvd]`` (Q/K un-permuted like their rows), None without."""
    if not cfg.attn_bias:
        return None
    p = f"blk.{i}."
    bq, bk = tensors.f32(p + "attn_q.bias"), tensors.f32(p + "attn_k.bias")
    if cfg.qk_permuted:
        bq, bk = unpermute_qk(bq, cfg.n_heads), unpermute_qk(bk, cfg.n_kv_heads)
    return np.concatenate([bq, bk, tensors.f32(p + "attn_v.bias")])


def _norm_qkv(g: GraphBuilder, x: str, tensors: _Tensors, i: int, cfg: ModelConfig, accuracy: int) -> None:
    """Layer ``i``'s RMSNorm and Q|K|V (+ biases) of ``x``, as ``g``'s output ``qkv [N, qd + 2 kvd]``."""
    p = f"blk.{i}."
    normed = g.rms_norm(x, tensors.f32(p + "attn_norm.weight"), cfg.rms_eps)  # [N, d]
    permuted = cfg.qk_permuted
    qkv_m = _packed_rows(tensors, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                         [cfg.n_heads if permuted else None, cfg.n_kv_heads if permuted else None, None])
    qkv = _concat(g, normed, qkv_m, accuracy)  # [N, qd + 2 kvd]
    bias = _qkv_bias(tensors, i, cfg)
    if bias is not None:
        qkv = g.op("Add", [qkv, g.const(bias, "b")])
    g.node("Identity", [qkv], ["qkv"])
    g.output("qkv", cfg.q_dim + 2 * cfg.kv_dim)


def _compile_layer(tensors: _Tensors, i: int, cfg: ModelConfig, engine: Engine) -> QuantLayer:
    p = f"blk.{i}."
    d, f = cfg.d_model, cfg.d_ff
    acc = engine.accuracy
    a = GraphBuilder(f"layer{i}-attn-in")
    _norm_qkv(a, a.input("x", d), tensors, i, cfg, acc)  # [N, d] -> qkv [N, qd + 2 kvd]
    b = GraphBuilder(f"layer{i}-attn-out-ffn")
    xb, att = b.input("x", d), b.input("att", cfg.q_dim)
    o = _concat(b, att, _packed_rows(tensors, [p + "attn_output.weight"], [None]), acc)  # [N, d]
    m, x2 = b.add_rms_norm(o, xb, tensors.f32(p + "ffn_norm.weight"), cfg.rms_eps)  # [N, d] x2
    gu = _packed_rows(tensors, [p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])
    both = _concat(b, m, gu, acc)  # [N, 2F]

    def cols(lo: int, hi: int) -> str:  # both[:, lo:hi]
        ends = [b.const(np.array([v], np.int64), "s", False) for v in (lo, hi, 1)]
        return b.op("Slice", [both, *ends])

    gate, up = cols(0, f), cols(f, 2 * f)  # [N, F] x2
    hdn = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])  # [N, F] SiLU(gate) * up
    down = _concat(b, hdn, _packed_rows(tensors, [p + "ffn_down.weight"], [None]), acc)
    b.node("Add", [x2, down], ["out"])
    b.output("out", d)
    nbytes = a.weight_bytes + b.weight_bytes  # (before the sessions take the initializers' bytes)
    back = tensors.backing_dir
    a_short, a_long = _sessions(engine, a, back / f"{a.name}-acc{engine.accuracy}.bin")
    b_short, b_long = _sessions(engine, b, back / f"{b.name}-acc{engine.accuracy}.bin")
    return QuantLayer(i, a_short, b_short, nbytes, tensors.nbytes(p), a_long, b_long, back)


def _sessions(engine: Engine, g: GraphBuilder, backing: Path) -> tuple[Any, Any]:
    """``g``'s session and its long variant's (None unless the engine asks for it and ``g`` has one),
    sharing the weights' backing file."""
    long = g.long_variant() if engine.long_prefill else None
    if long is None:
        return engine.session(g, backing), None
    short_s, long_s = engine.sessions([g, long], backing)
    return short_s, long_s


def onnx_engine(threads: int | None = None, pool: str = "session", accuracy: str = "auto",
                device: str = "auto") -> Engine:
    """The onnxruntime engine on ``device`` (auto|cpu|cuda) at ``accuracy`` (auto|exact|fast: ``--accuracy``,
    checked by :class:`~ethen.model.choose.EngineOptions`). exact: float32 compute (greedy text as a
    float64 reference's on the banner prompt); auto (the default): exact-int8 (float32-grade products from
    the int8 kernel over 3 rows per row, :meth:`GraphBuilder.split3`) for 8-bit blocks, exact for the rest
    (``ACCURACY_AUTO``).
    ``threads`` default :func:`~ethen.model.engine.default_threads`. Steps of ``PREFILL_ROWS`` rows or more
    of exact-int8 8-bit matrices always run through onnxruntime's float32-compute kernel (``long_prefill``:
    2.1-2.6x faster prefill, float32 compute's error).
    ``pool`` (session|shared, :data:`~ethen.model.engine.THREAD_POOLS`; ``ethen worker --thread-pool``,
    whose default is shared)."""
    levels = {"auto": ACCURACY_AUTO, "exact": ACCURACY_EXACT, "fast": ACCURACY_FAST}
    if accuracy not in levels:
        raise ModelInputError(f"--accuracy {accuracy!r}: must be one of {', '.join(levels)}")
    if pool not in THREAD_POOLS:
        raise ModelInputError(f"thread pool {pool!r}: must be one of {', '.join(THREAD_POOLS)}")
    return Engine(device, threads, levels[accuracy], long_prefill=True, pool=pool)


def load_quant_layers(pairs: Sequence[tuple[int, int]], store: WeightStore,
                      engine: Engine | None = None) -> list[list[QuantLayer]]:
    """The compiled layers of each inclusive ``(start, end)`` of ``store``'s GGUF (the file is mapped once);
    :func:`ethen.model.model.load_layer_stacks` makes them :class:`~ethen.model.model.LayerStack` s."""
    cfg = store.config
    n = cfg.n_layers
    for start, end in pairs:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end < n):
            raise ModelInputError(f"layer range {start!r}-{end!r} must satisfy 0 <= start <= end <= {n - 1}")
    eng = engine or onnx_engine()
    tensors = _Tensors(store)
    warm_in_background()  # the decode attention kernel, while the graphs compile
    out = [[_compile_layer(tensors, i, cfg, eng) for i in range(lo, hi + 1)] for lo, hi in pairs]
    trim()  # the packing's temporary arrays, freed, back to the OS
    release_mapped(tensors.backing_dir)  # the engine files' pages prepacking read (heap.release_mapped)
    return out


class QuantEmbedAndHead:
    """The orchestrator's ends over the GGUF's blocks: ``embed`` dequantizes the asked rows
    of the (memory-mapped) token embedding; ``logits`` is the final RMSNorm and the head's matmul over its
    own blocks (the tied embedding is not copied): a :class:`~ethen.model.qhead.BlockHead` kernel reading
    the mapped file in place (Q8_0 heads where the engine would compute in float32:
    :func:`~ethen.model.qhead.build_block_head`), else one engine graph (RMSNorm +
    ``MatMulNBits``)."""

    def __init__(self, store: WeightStore, engine: Engine | None = None) -> None:
        from gguf import GGMLQuantizationType

        config = store.config
        self.config = config
        tensors = _Tensors(store)
        kind, raw, _rows, _cols = tensors.get("token_embd.weight")
        self._embd_kind = GGMLQuantizationType[kind]
        self._embd_raw = raw  # [V, row_bytes], a view of the mapped file: only the rows asked are read
        head = "token_embd.weight" if "output.weight" not in tensors.table else "output.weight"
        hk, hraw, hrows, hcols = tensors.get(head)
        self.head_kind = hk
        self.output_norm: F32 = tensors.f32("output_norm.weight")  # [d]
        eng = engine or onnx_engine()
        int8 = resolve_accuracy(eng.accuracy, PACKED_BITS.get(hk, 0)) != ACCURACY_EXACT  # the engine's kernel
        self.block_head: BlockHead | None = build_block_head(hk, hraw, hrows, hcols, int8)
        self._session: Any = None
        if self.block_head is not None:
            self.nbytes = self.block_head.nbytes
            return
        g = GraphBuilder("head")
        x = g.input("x", config.d_model)
        h = g.rms_norm(x, self.output_norm, config.rms_eps)  # [N, d]
        y = g.linear(h, pack(hk, hraw, hrows, hcols), eng.accuracy)  # [N, V]
        g.node("Identity", [y], ["logits"])
        g.output("logits", hrows)
        self.nbytes = g.weight_bytes
        self._session = eng.session(g, tensors.backing_dir / f"head-acc{eng.accuracy}.bin")

    def _check(self, hidden: F32) -> None:
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32 or hidden.ndim != 2 \
                or hidden.shape[1] != self.config.d_model:
            shape = list(hidden.shape) if isinstance(hidden, np.ndarray) else type(hidden).__name__
            raise ModelInputError(f"hidden must be float32 [N, {self.config.d_model}], got {shape}")

    def normed(self, hidden: F32) -> F32:
        """The final RMSNorm of ``hidden[N, d]`` (what :meth:`logits` computes first), checked."""
        self._check(hidden)
        return np.ascontiguousarray(rms_norm(hidden, self.output_norm, np.float32(self.config.rms_eps)))

    def embed(self, token_ids: Sequence[int] | NDArray[np.integer]) -> F32:
        """``token_ids[T]`` -> ``hidden[T, d]`` float32."""
        from gguf.quants import dequantize

        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise ModelInputError(f"token_ids must be a non-empty 1-D sequence, got shape {list(ids.shape)}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ModelInputError(f"token_ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ModelInputError(f"token id {int(ids[bad][0])} is outside [0, {self.config.vocab_size})")
        rows = np.asarray(dequantize(np.asarray(self._embd_raw[ids]), self._embd_kind), dtype=np.float32)
        return np.ascontiguousarray(rows.reshape(len(ids), self.config.d_model))  # [T, d]

    def logits(self, hidden: F32) -> F32:
        """``hidden[N, d]`` -> ``logits[N, V]`` float32 (the block kernel on this thread, or the graph)."""
        if self.block_head is not None:
            return self.block_head(self.normed(hidden))
        self._check(hidden)
        out: F32 = self._session.run(None, {"x": np.ascontiguousarray(hidden)})[0]
        return out
