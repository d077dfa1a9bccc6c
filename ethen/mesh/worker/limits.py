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
"""

from __future__ import annotations

__all__ = ["MAX_PREFILL_TOKENS", "MAX_SESSIONS_PER_CALLER", "PREFILL_CHUNK_TOKENS"]

MAX_PREFILL_TOKENS = 2048
MAX_SESSIONS_PER_CALLER = 64
PREFILL_CHUNK_TOKENS = 128
