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
- :func:`chunk_rows` (issue 23, item 5): every step of more than one row is computed one *slice* per turn
  of the worker's step batcher (:mod:`ethen.mesh.worker.batching`), a slice being one or more layers of one
  chunk of rows, and a slice ends at the next layer as soon as another caller's step is queued: another
  caller's decode step waits for at most one layer of one chunk. A step of at most
  :data:`PREFILL_CHUNK_TOKENS` rows is one chunk (its bits are those of one ``LayerStack.forward``); a
  longer one goes in chunks of :func:`chunk_rows` rows, fewer as the context grows (attention over the
  cached positions: 64 rows up to position 1,024, 32 up to 4,096, then 16), so one layer of a chunk costs
  about one 10-layer decode step (~7 ms on a 2-vCPU VM, ``bench/mesh_fairness.py``). The rows depend only
  on the chunk's first position, never on timing, so a replay of the same step gives the same bits.
"""

from __future__ import annotations

__all__ = ["ATTENTION_CONTEXT", "CHUNK_ROW_BUDGET", "MAX_DECODE_BATCH", "MAX_PREFILL_TOKENS",
           "MAX_SESSIONS_PER_CALLER", "MIN_CHUNK_TOKENS", "PREFILL_CHUNK_TOKENS", "chunk_rows"]

MAX_PREFILL_TOKENS = 2048
MAX_SESSIONS_PER_CALLER = 64
PREFILL_CHUNK_TOKENS = 128
CHUNK_ROW_BUDGET = 96.0  # rows x (1 + first position / ATTENTION_CONTEXT) of one chunk of a long step
ATTENTION_CONTEXT = 2048  # cached positions whose attention costs about as much as a layer's weights per row
MIN_CHUNK_TOKENS = 16
MAX_DECODE_BATCH = 16  # decode steps a worker computes as one batched step (a ForwardBatch of more: several)


def chunk_rows(start: int) -> int:
    """Rows of the next chunk of a step longer than :data:`PREFILL_CHUNK_TOKENS` whose first row is at
    position ``start``: the largest of 64, 32, 16 within :data:`CHUNK_ROW_BUDGET`."""
    rows = PREFILL_CHUNK_TOKENS // 2
    while rows > MIN_CHUNK_TOKENS and rows * (1.0 + start / ATTENTION_CONTEXT) > CHUNK_ROW_BUDGET:
        rows //= 2
    return rows
