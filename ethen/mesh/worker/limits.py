"""A worker's defaults for what one caller may ask of it (``ethen worker`` flags override the first two).

- :data:`MAX_PREFILL_TOKENS`: rows of ``hidden`` one ``Forward`` may carry (``--max-prefill-tokens``). The
  model's context is 8,192 positions; 2,048 keeps one call's compute to seconds on a CPU worker, and the
  orchestrator splits longer prompts into steps of at most this many tokens (same constant), so a prompt of
  any length up to the context still runs.
- :data:`MAX_SESSIONS_PER_CALLER`: sessions one caller may hold open at once (``--max-sessions-per-caller``);
  a new one beyond it gets ``RESOURCE_EXHAUSTED``. Sessions still end by ``CloseSession`` or the idle TTL. A
  caller is its token's principal plus its peer host (:mod:`ethen.mesh.auth`); a worker without tokens knows
  only the peer host (every process on one host is then one caller). The orchestrator opens one worker
  session per stage, so 64 lets one orchestrator run at least 32 generations through a worker at once.
- :data:`PREFILL_CHUNK_TOKENS`: a long step is computed in chunks of this many positions, one fragment at a
  time, and the caller's deadline / cancellation is checked between chunks, so an abandoned prefill stops
  within one chunk's compute (a fraction of a second) instead of holding the compute thread to the end.
  Steps of at most this many tokens run in one call, bit for bit as before.
- :data:`PREFILL_SLICE_COST` (issue 23, item 5): a longer step is computed one *slice* per turn of the
  worker's step batcher, other callers' decode steps going in between (:mod:`ethen.mesh.worker.batching`).
  A slice is bounded in compute terms, not in rows: rows x layers x (1 + context / ATTENTION_CONTEXT) stays
  within this (:func:`slice_rows`): ~16 rows through 10 layers at the start of a prompt, ~9 at position
  2,048 (attention over the cached positions then costs about as much as the weights), at least one row.
  Such a slice costs about one decode step of the same layers (``bench/mesh_fairness.py``), so another
  caller's decode step waits about one of its own compute times.
"""

from __future__ import annotations

__all__ = ["ATTENTION_CONTEXT", "MAX_PREFILL_TOKENS", "MAX_SESSIONS_PER_CALLER", "PREFILL_CHUNK_TOKENS",
           "PREFILL_SLICE_COST", "slice_rows"]

MAX_PREFILL_TOKENS = 2048
MAX_SESSIONS_PER_CALLER = 64
PREFILL_CHUNK_TOKENS = 128
PREFILL_SLICE_COST = 160.0  # row-layers at context 0
ATTENTION_CONTEXT = 3072  # cached positions whose attention costs as much as the layer's weights per row


def slice_rows(layers: int, start: int) -> int:
    """Rows of the next slice of a long step through ``layers`` layers (first row at ``start``)."""
    cost_per_row = max(1, layers) * (1.0 + start / ATTENTION_CONTEXT)
    return max(1, min(PREFILL_CHUNK_TOKENS, int(PREFILL_SLICE_COST / cost_per_row)))
