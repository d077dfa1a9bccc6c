"""The orchestrator's ends on ggml: :class:`GgmlEmbedAndHead`, the final RMSNorm and the head's matmul as one
ggml graph over the head's blocks read in place in the mapped GGUF (the tied embedding is not copied)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import GGUFFormatError
from ethen.model.gguf_loader import WeightStore
from ethen.model.glayer import (
    CHUNK_ROWS,
    GgmlEngine,
    GgmlWeights,
    map_gguf,
    process_engine,
    tensor_f32,
)
from ethen.model.qmodel import QuantEmbedAndHead

__all__ = ["GgmlEmbedAndHead"]

F32 = NDArray[np.float32]


class GgmlEmbedAndHead(QuantEmbedAndHead):
    """:class:`~ethen.model.qmodel.QuantEmbedAndHead` (same ``embed``, ``normed``) whose ``logits`` run on
    ggml."""

    def __init__(self, store: WeightStore, engine: GgmlEngine | None = None) -> None:
        from gguf import GGMLQuantizationType

        if not store.tensors:
            raise GGUFFormatError(f"weight cache {store.directory} lacks a tensor table (delete it)")
        self.config = store.config
        table = store.tensors
        self.engine = engine or process_engine()
        file = map_gguf(store)
        embd = table["token_embd.weight"]
        self._embd_kind = GGMLQuantizationType[embd.kind]
        self._embd_raw = file[embd.offset:embd.offset + embd.nbytes].reshape(embd.rows, -1)  # [V, row_bytes]
        head = table.get("output.weight", embd)
        self.head_kind = head.kind
        self.output_norm: F32 = tensor_f32(file, table["output_norm.weight"])  # [d]
        self.block_head = None
        self._session = None
        self._weights = GgmlWeights(self.engine, file, 2)
        self._head = self._weights.matrix(head)
        self._norm = self._weights.vector(self.output_norm)
        self._weights.finish()  # (an engine on a device: the two tensors uploaded into its buffer)
        self._rows = head.rows
        self.nbytes = head.nbytes

    def logits(self, hidden: F32) -> F32:
        """``hidden[N, d]`` -> ``logits[N, V]`` float32."""
        self._check(hidden)
        eng, d = self.engine, self.config.d_model
        n = hidden.shape[0]
        out = np.empty((n, self._rows), np.float32)
        eps = float(self.config.rms_eps)
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(n, lo + CHUNK_ROWS)
            xc = np.ascontiguousarray(hidden[lo:hi])

            def build(ctx: int, xc: F32 = xc) -> list[int]:
                g = eng.lib
                h = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, eng.input(ctx, xc), eps), self._norm)
                return [g.ggml_mul_mat(ctx, self._head, h)]

            eng.run((hi - lo) * 4 * (3 * d + self._rows), build, [out[lo:hi]])  # x, norm, scaled, logits
        return out
