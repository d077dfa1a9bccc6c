"""A worker's settings (:class:`WorkerConfig`) and its ``--layers`` syntax (:func:`parse_fragments`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ethen.mesh.worker.limits import MAX_DECODE_BATCH, MAX_PREFILL_TOKENS, MAX_SESSIONS_PER_CALLER
from ethen.model.choose import DEFAULT_OPTIONS, EngineOptions
from ethen.model.engine import THREAD_POOLS
from ethen.model.model import parse_layer_ranges

__all__ = ["WorkerConfig", "check_threads", "parse_fragments"]


def check_threads(threads: int | None, pool: str | None) -> None:
    """Refuse (a ``ValueError`` naming the flag and the value) a ``--threads`` below 1 or a ``--thread-pool``
    not in :data:`~ethen.model.engine.THREAD_POOLS`."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads!r}: must be a positive integer")
    if pool is not None and pool not in THREAD_POOLS:
        raise ValueError(f"--thread-pool {pool!r}: must be one of {', '.join(THREAD_POOLS)}")


def parse_fragments(text: str) -> list[tuple[int, int]]:
    """``"0-9,10-19"`` -> ``[(0, 9), (10, 19)]`` (sorted; a single layer may be written ``"7"``); overlapping
    fragments are refused. Raises ``ValueError`` naming the text."""
    out = sorted(parse_layer_ranges(text))
    for (_, a_last), (b_first, _) in itertools.pairwise(out):
        if b_first <= a_last:
            raise ValueError(f"layers {text!r}: fragments overlap")
    return out


class WorkerConfig:
    def __init__(
        self,
        node_id: str,
        fragments: Sequence[tuple[int, int]],
        capacity_score: float = 1.0,
        max_cache_bytes: int = 512 * 1024 * 1024,
        session_ttl_s: float = 300.0,
        max_sessions: int = 256,
        batch_window_s: float = 0.001,
        max_batch: int = MAX_DECODE_BATCH,
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        max_sessions_per_caller: int = MAX_SESSIONS_PER_CALLER,
        max_prefix_bytes: int | None = None,
        threads: int | None = None,
        thread_pool: str = "shared",
        engine_options: EngineOptions = DEFAULT_OPTIONS,
    ) -> None:
        if not node_id:
            raise ValueError("node_id must be non-empty")
        if not fragments:
            raise ValueError("a worker serves at least one fragment")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if max_sessions_per_caller < 1:
            raise ValueError(f"max_sessions_per_caller must be >= 1, got {max_sessions_per_caller}")
        check_threads(threads, thread_pool)
        self.node_id = node_id
        self.fragments = sorted(fragments)
        self.capacity_score = capacity_score
        self.max_cache_bytes = max_cache_bytes
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self.batch_window_s = batch_window_s
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_sessions_per_caller = max_sessions_per_caller
        # the prefix cache (issue 45): a quarter of the sessions' cap unless set
        self.max_prefix_bytes = max_cache_bytes // 4 if max_prefix_bytes is None else max_prefix_bytes
        # the engine's threads (None: its default, ethen.model.model.engine_for) and thread pool
        # (``shared``: one spinning pool, a worker alone on its machine; ``session``: workers sharing cores)
        self.threads = threads
        self.thread_pool = thread_pool
        # which engine runs the layers (``--engine`` / ``--accuracy`` / ``--device``: ethen.model.choose)
        self.engine_options = engine_options

    @property
    def layers(self) -> list[int]:
        return [layer for first, last in self.fragments for layer in range(first, last + 1)]
