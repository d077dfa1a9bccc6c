"""The orchestrator's head (final RMSNorm + ``[N, d] x [d, V]``) with the matmul split by vocabulary ranges
over ``threads`` threads.

Why: on every decode step the head sits on the critical path of the sessions it serves, between the last
stage's output and the next token's embedding, and it reads the whole head matrix. While it runs the
workers wait for the next step, so their cores are idle: splitting the vocabulary over two threads makes the
head faster (``bench/mesh_hosts.py`` prints both, measured in the same run).

Choices where the issue is silent:

- What is split: ends over the GGUF's blocks (:class:`~ethen.model.qmodel.QuantEmbedAndHead`) with a block
  kernel (:class:`~ethen.model.qhead.BlockHead`: Q8_0 heads at accuracy ``exact``): the norm once, then
  each thread runs the kernel (it releases the GIL) over its vocabulary range of one output array. Each
  logit is computed by the same kernel call path for its row whatever the range, so the split logits are
  bitwise the unsplit ones (tests). Other heads (one engine graph, or ggml's) run on their engine's own
  threads: called as they are. Cut points are multiples of 256. Failover replay does not involve the head
  (it rebuilds workers' caches from recorded stage inputs).
- ``threads = 1`` is the unsplit head (``Orchestrator(head_threads=1)``); the default is 2.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from ethen.model.errors import ModelInputError
from ethen.model.model import Ends
from ethen.model.qhead import BlockHead

__all__ = ["SplitHead"]

F32 = npt.NDArray[np.float32]

_ALIGN = 256  # column cut points are multiples of this


class SplitHead:
    """``hidden[N, d]`` -> ``logits[N, V]``: ``ends.logits`` with its matmul split by columns."""

    def __init__(self, ends: Ends, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"head_threads = {threads!r}: must be >= 1")
        self.ends = ends
        self.threads = threads
        if ends.block_head is None:  # one engine graph (its own threads): called as it is
            self._pool, self.split = None, False
            return
        self._blocks: BlockHead = ends.block_head
        self._d, self._vocab = ends.block_head.cols, ends.block_head.rows
        step = -(-self._vocab // threads // _ALIGN) * _ALIGN
        cuts = [min(self._vocab, i * step) for i in range(threads + 1)]
        self._parts = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        self._pool = (ThreadPoolExecutor(len(self._parts) - 1, thread_name_prefix="ethen-head")
                      if len(self._parts) > 1 else None)
        self.split = self._pool is not None  # False: the unsplit head (a benchmark's same-run baseline)

    def __call__(self, hidden: F32) -> F32:
        if self._pool is None or not self.split:
            return self.ends.logits(hidden)
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32 or hidden.ndim != 2 \
                or hidden.shape[1] != self._d:
            shape = list(hidden.shape) if isinstance(hidden, np.ndarray) else type(hidden).__name__
            raise ModelInputError(f"hidden must be float32 [N, {self._d}], got {shape}")
        hb = self.ends.normed(hidden)  # [N, d] C-contiguous
        out: F32 = np.empty((hb.shape[0], self._vocab), dtype=np.float32)  # [N, V]
        self._run([functools.partial(self._blocks.matmul_into, hb, out, a, b) for a, b in self._parts])
        return out

    def _run(self, calls: Sequence[Callable[[], object]]) -> None:
        """The first call on this thread, the others on the pool's; returns when all are done."""
        assert self._pool is not None
        pending: list[Future[object]] = [self._pool.submit(c) for c in calls[1:]]
        calls[0]()
        for fut in pending:
            fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
