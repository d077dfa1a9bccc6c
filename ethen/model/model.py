"""The pieces a pipeline is made of: :class:`LayerStack` (a worker's layers), the orchestrator's ends
(:data:`Ends`: embeddings, final norm and head, over the GGUF's blocks) and :class:`Model` (all of it, in one
process). The layers and ends run on ggml (:mod:`ethen.model.glayer`, :mod:`ethen.model.gqhead`) or
onnxruntime (:mod:`ethen.model.qmodel`), as :func:`~ethen.model.choose.engine_kind` chooses.

Choices where the issue is silent:

* **Positions are explicit and strict.** ``forward`` takes the absolute position of every row and requires,
  per session, ``positions == kv.length + arange(T)``: the rows must continue exactly where the session's
  cache ends. Anything else (a gap, a repeat, a replay onto a non-empty cache) is a :class:`ModelInputError`
  naming the expected and received positions - Petals bug #587 (wrong positions after replay onto a
  replacement) cannot pass silently. To redo a step, call ``kv.truncate(n)`` first, explicitly.
* **Batching.** ``forward_batch`` concatenates the new rows of B sessions (``seq_lens`` rows each; 1 for
  decode), runs the big matmuls once for all rows, and attention per session over its own cache.
* **Concurrency.** A :class:`LayerStack` holds no per-session state (weights are read-only), so several
  threads may call it at once, but calls that touch the same :class:`KVCache` must be serialized by the
  caller.
* **Validation before mutation.** Every argument is checked (and the caches reserved) before any cache is
  written, so a rejected call leaves every session as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from ethen.model.chat_template import ChatTemplate
from ethen.model.choose import DEFAULT_OPTIONS, EngineOptions, check_onnx, engine_kind
from ethen.model.config import ModelConfig
from ethen.model.engine import Engine
from ethen.model.errors import ModelInputError
from ethen.model.gbackend import devices, ggml_engine
from ethen.model.gguf_loader import WeightStore, open_weight_store
from ethen.model.glayer import GgmlEngine, GgmlLayer, ggml_block, load_ggml_layers
from ethen.model.gqhead import GgmlEmbedAndHead
from ethen.model.heap import trim_after
from ethen.model.kv_cache import DEFAULT_INITIAL_CAPACITY, KVCache
from ethen.model.layers import AttentionSegment, rope_tables
from ethen.model.qmodel import QuantEmbedAndHead, QuantLayer, load_quant_layers, onnx_engine, quant_block
from ethen.model.tokenizer import Tokenizer

__all__ = [
    "Ends",
    "LayerStack",
    "Model",
    "engine_for",
    "load_embed_and_head",
    "load_layer_stacks",
    "load_model",
    "parse_layer_ranges",
]

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]


@functools.lru_cache(maxsize=4)
def _rope(max_positions: int, head_dim: int, theta: float, scale: float,
          freq_factors: tuple[float, ...] | None) -> tuple[F32, F32]:
    return rope_tables(max_positions, head_dim, theta, scale, freq_factors)


def parse_layer_ranges(spec: str) -> list[tuple[int, int]]:
    """``"0-9,10-19"`` -> ``[(0, 9), (10, 19)]`` (inclusive); a single layer may be written ``"7"``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelInputError(f"layer ranges must look like '0-9,10-19', got {spec!r}")
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        lo_s, dash, hi_s = part.strip().partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if dash else lo
        except ValueError:
            raise ModelInputError(f"layer range {part.strip()!r} in {spec!r} is not 'start-end'") from None
        if lo < 0 or hi < lo:
            raise ModelInputError(f"layer range {part.strip()!r} in {spec!r} must have 0 <= start <= end")
        out.append((lo, hi))
    return out


def _as_positions(positions: object, n: int) -> I64:
    arr = np.asarray(positions)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ModelInputError(f"positions must have shape [{n}], got {list(arr.shape)}")
    if n and not np.issubdtype(arr.dtype, np.integer):
        raise ModelInputError(f"positions must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class LayerStack:
    """Consecutive layers ``start..end`` (inclusive) with a pure-in-spirit ``forward`` over a KV cache."""

    def __init__(self, config: ModelConfig, layers: Sequence[QuantLayer | GgmlLayer]) -> None:
        if not layers:
            raise ModelInputError("a LayerStack needs at least one layer")
        idx = [w.index for w in layers]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ModelInputError(f"LayerStack layers must be consecutive, got {idx}")
        self.config = config
        self.layers: tuple[QuantLayer | GgmlLayer, ...] = tuple(layers)
        self.start: int = idx[0]
        self.end: int = idx[-1]  # inclusive
        self._cos, self._sin = _rope(config.context_length, config.head_dim, config.rope_theta,
                                     config.rope_scaling_factor, config.rope_freq_factors)
        # the engine-layout folders to release after a long step (heap.release_mapped): those of layers
        # with long variants, which read the weights in place (a release costs ~13 ms of /proc/self/smaps
        # and the pages other kernels read again, e.g. Q4_1's scales: +2.5 ms on SmolLM2's next step)
        self._mapped = tuple(sorted({w.backing for w in layers if isinstance(w, QuantLayer) and w.backing
                                     and (w.attn_in_long is not None or w.attn_out_ffn_long is not None)}))

    def __repr__(self) -> str:
        return f"LayerStack(layers={self.start}-{self.end})"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_indices(self) -> range:
        return range(self.start, self.end + 1)

    @property
    def nbytes(self) -> int:
        """Bytes of this stack's weights."""
        return sum(w.nbytes for w in self.layers)

    def new_kv_cache(self, initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
                     max_tokens: int | None = None) -> KVCache:
        """An empty cache shaped for this stack (``max_tokens`` defaults to the context length)."""
        cfg = self.config
        limit = cfg.context_length if max_tokens is None else max_tokens
        if not isinstance(limit, int) or not 0 < limit <= cfg.context_length:
            raise ModelInputError(f"max_tokens must be in [1, {cfg.context_length}], got {max_tokens!r}")
        return KVCache(self.n_layers, cfg.n_kv_heads, cfg.head_dim, limit, initial_capacity)

    def forward(self, hidden: F32, positions: Sequence[int] | NDArray[np.integer], kv: KVCache) -> F32:
        """``hidden[T, d]`` float32 at absolute ``positions[T]`` -> ``hidden[T, d]``; appends T positions."""
        n = hidden.shape[0] if isinstance(hidden, np.ndarray) and hidden.ndim == 2 else -1
        return self.forward_batch(hidden, positions, [kv], [n])

    def forward_batch(self, hidden: F32, positions: Sequence[int] | NDArray[np.integer],
                      kvs: Sequence[KVCache], seq_lens: Sequence[int] | None = None) -> F32:
        """Several sessions at once: rows of ``hidden[N, d]`` are split into ``seq_lens`` (default: one
        row per session, i.e. batched decode); session i's rows go with ``kvs[i]``.
        Returns ``hidden[N, d]``."""
        cfg = self.config
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32:
            got = hidden.dtype if isinstance(hidden, np.ndarray) else type(hidden).__name__
            raise ModelInputError(f"hidden must be a float32 ndarray, got {got}")
        if hidden.ndim != 2 or hidden.shape[1] != cfg.d_model or hidden.shape[0] == 0:
            raise ModelInputError(f"hidden must have shape [N>0, {cfg.d_model}], got {list(hidden.shape)}")
        n = hidden.shape[0]
        if not np.isfinite(hidden).all():
            raise ModelInputError("hidden contains NaN or infinite values")
        if not kvs:
            raise ModelInputError("kvs must name at least one KV cache")
        lens = [1] * len(kvs) if seq_lens is None else [int(t) for t in seq_lens]
        if len(lens) != len(kvs) or any(t <= 0 for t in lens) or sum(lens) != n:
            raise ModelInputError(
                f"seq_lens {lens} must be positive, one per KV cache ({len(kvs)}), summing to N={n}")
        if len({id(kv) for kv in kvs}) != len(kvs):
            raise ModelInputError("the same KV cache appears twice in one batch")
        pos = _as_positions(positions, n)
        starts = np.cumsum([0, *lens])
        for i, kv in enumerate(kvs):
            if not isinstance(kv, KVCache) or (kv.n_layers, kv.n_kv_heads, kv.head_dim) != (
                    self.n_layers, cfg.n_kv_heads, cfg.head_dim):
                raise ModelInputError(f"kvs[{i}] is not a KV cache for {self!r}")
            seg = pos[starts[i]:starts[i + 1]]
            if seg[0] != kv.length or (len(seg) > 1 and np.any(np.diff(seg) != 1)):
                raise ModelInputError(
                    f"positions of session {i} must be {kv.length}..{kv.length + len(seg) - 1} "
                    f"(its KV cache holds {kv.length}), got {seg[0]}..{seg[-1]}"
                    + ("" if len(seg) < 2 or not np.any(np.diff(seg) != 1) else " with gaps"))
            if kv.length + len(seg) > kv.max_tokens:
                raise ModelInputError(
                    f"session {i} would reach {kv.length + len(seg)} positions, "
                    f"over max_tokens={kv.max_tokens}")
        for kv, t in zip(kvs, lens, strict=True):
            kv.reserve(t)
        cos, sin = self._cos[pos], self._sin[pos]  # [N, hd/2] x2
        x = hidden
        for li, w in enumerate(self.layers):
            segments = [AttentionSegment(int(starts[i]), int(starts[i + 1]), kv.k[li], kv.v[li], kv.length)
                        for i, kv in enumerate(kvs)]
            if isinstance(w, GgmlLayer):
                x = ggml_block(x, w, cos, sin, segments, cfg)
            else:
                x = quant_block(x, w, cos, sin, segments, cfg)
        for kv, t in zip(kvs, lens, strict=True):
            kv.commit(t)
        trim_after(n, self._mapped)  # a prefill's freed buffers and read pages back to the OS (heap.py)
        return x


#: The orchestrator's ends over the GGUF's blocks (:class:`~ethen.model.gqhead.GgmlEmbedAndHead` is one).
Ends = QuantEmbedAndHead


class Model:
    """The whole model in one process: the single-process reference for generation and benchmarks."""

    def __init__(self, config: ModelConfig, ends: Ends, stack: LayerStack, tokenizer: Tokenizer,
                 chat_template: ChatTemplate) -> None:
        if (stack.start, stack.end) != (0, config.n_layers - 1):
            raise ModelInputError(f"Model needs layers 0-{config.n_layers - 1}, got {stack!r}")
        self.config = config
        self.ends = ends
        self.stack = stack
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def new_kv_cache(self, initial_capacity: int = DEFAULT_INITIAL_CAPACITY) -> KVCache:
        return self.stack.new_kv_cache(initial_capacity)

    def logits(self, token_ids: Sequence[int] | NDArray[np.integer], kv: KVCache,
               all_positions: bool = False) -> F32:
        """Feed ``token_ids`` after what ``kv`` holds; logits of the last token ``[V]`` (or ``[T, V]``)."""
        x = self.ends.embed(token_ids)  # [T, d]
        pos = np.arange(kv.length, kv.length + x.shape[0])  # [T]
        h = self.stack.forward(x, pos, kv)  # [T, d]
        return self.ends.logits(h if all_positions else h[-1:])[slice(None) if all_positions else 0]

    def logits_batch(self, token_ids: Sequence[int] | NDArray[np.integer], kvs: Sequence[KVCache]) -> F32:
        """Batched decode: one new token per session -> ``logits[B, V]``."""
        x = self.ends.embed(token_ids)  # [B, d]
        pos = np.array([kv.length for kv in kvs], dtype=np.int64)  # [B]
        return self.ends.logits(self.stack.forward_batch(x, pos, kvs))  # [B, V]


def _store(store: WeightStore | None) -> WeightStore:
    return store if store is not None else open_weight_store()


def _kind(s: WeightStore, options: EngineOptions) -> str:
    """:func:`~ethen.model.choose.engine_kind` for ``s`` (ggml's devices read for ``--device cuda`` only:
    a CUDA device of ggml's takes it from onnxruntime-gpu)."""
    return engine_kind(s.tensors or {}, options, devices() if options.device == "cuda" else ())


def _use_ggml(s: WeightStore, engine: Engine | GgmlEngine | None, options: EngineOptions) -> bool:
    """Whether the quantized path runs on ggml: an engine given decides, else
    :func:`~ethen.model.choose.engine_kind` (``options``: ``--engine``, ``--accuracy``; the model's size)."""
    if engine is not None:
        return isinstance(engine, GgmlEngine)
    return _kind(s, options) == "ggml"


def _ggml(engine: Engine | GgmlEngine | None, options: EngineOptions) -> GgmlEngine:
    """The ggml engine given, else the one ``options.device`` asks for (a GPU device's, or the CPU's;
    default threads, a pool per session)."""
    return engine if isinstance(engine, GgmlEngine) else ggml_engine(None, "session", options.device)


def engine_for(store: WeightStore, threads: int | None = None, pool: str = "session",
               options: EngineOptions = DEFAULT_OPTIONS) -> Engine | GgmlEngine:
    """The engine of ``threads`` on ``pool`` (session|shared: ``ethen worker --threads`` / ``--thread-pool``)
    that :func:`~ethen.model.choose.engine_kind` chooses for ``store`` under ``options`` (``--engine`` /
    ``--accuracy`` / ``--device``; ggml's device: :func:`~ethen.model.gbackend.ggml_engine`). Without
    ``threads``: the default (:func:`~ethen.model.engine.default_threads`; ggml under ``session``: 1,
    :func:`~ethen.model.glayer.process_engine`)."""
    if _kind(store, options) == "ggml":
        return ggml_engine(threads, pool, options.device)
    return onnx_engine(threads, pool, options.accuracy, options.device)


def _onnx(engine: Engine | GgmlEngine | None, options: EngineOptions) -> Engine:
    """The onnx engine given, else the one ``options`` ask for (default threads, a pool per session)."""
    if isinstance(engine, Engine):
        return engine
    return onnx_engine(None, "session", options.accuracy, options.device)


def load_layer_stacks(ranges: str | Sequence[tuple[int, int]], store: WeightStore | None = None,
                      engine: Engine | GgmlEngine | None = None,
                      options: EngineOptions = DEFAULT_OPTIONS) -> list[LayerStack]:
    """One stack per fragment, e.g. ``"0-9,10-19"`` or ``[(0, 9), (10, 19)]``.

    The weights stay in the GGUF's blocks, run by ggml (:mod:`ethen.model.glayer`) or onnxruntime
    (:mod:`ethen.model.qmodel`) as ``engine`` (an :class:`Engine` or a :class:`GgmlEngine`) or else
    :func:`~ethen.model.choose.engine_kind` says for ``options``."""
    s = _store(store)
    pairs = parse_layer_ranges(ranges) if isinstance(ranges, str) else list(ranges)
    if _use_ggml(s, engine, options):
        return [LayerStack(s.config, layers) for layers in load_ggml_layers(pairs, s, _ggml(engine, options))]
    check_onnx(s.tensors or {})
    return [LayerStack(s.config, layers) for layers in load_quant_layers(pairs, s, _onnx(engine, options))]


def load_embed_and_head(store: WeightStore | None = None, engine: Engine | GgmlEngine | None = None,
                        options: EngineOptions = DEFAULT_OPTIONS) -> Ends:
    """The orchestrator's ends over the GGUF's blocks (the tied head is not copied), the head's matmul on
    ggml or onnxruntime as :func:`load_layer_stacks` chooses."""
    s = _store(store)
    if _use_ggml(s, engine, options):
        return GgmlEmbedAndHead(s, _ggml(engine, options))
    check_onnx(s.tensors or {})
    return QuantEmbedAndHead(s, _onnx(engine, options))


def load_model(store: WeightStore | None = None, engine: Engine | GgmlEngine | None = None,
               options: EngineOptions = DEFAULT_OPTIONS) -> Model:
    """The whole model in one process, on the engine :func:`load_layer_stacks` chooses."""
    s = _store(store)
    stack = load_layer_stacks([(0, s.config.n_layers - 1)], s, engine, options)[0]
    return Model(s.config, load_embed_and_head(s, engine, options), stack, s.load_tokenizer(),
                 s.load_chat_template())
