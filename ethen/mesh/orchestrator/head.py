"""The orchestrator's head (final RMSNorm + ``[N, d] x [d, V]``) with the matmul split by vocabulary ranges
over ``threads`` threads.

Why: on every decode step the head sits on the critical path of the sessions it serves, between the last
stage's output and the next token's embedding, and it is a read of the whole ``[d, V]`` float32 matrix
(113 MB for the model here). While it runs the workers wait for the next step, so their cores are idle:
splitting the vocabulary over two threads (numpy releases the GIL inside BLAS, BLAS itself stays
single-threaded as the mesh processes run it) makes the head 1.4-1.6x faster for 1 and 4-8 rows on the
2-core VM here (``bench/mesh_hosts.py`` prints both, measured in the same run).

Choices where the issue is silent:

- **Numerics**: the norm is computed once, exactly as :meth:`~ethen.model.model.EmbedAndHead.logits` does,
  and each thread writes its range of one output array with the call the unsplit head makes for that row
  count (:func:`~ethen.model.layers.linear`): one row, a gemv over columns ``a:b`` of ``head_t [d, V]``;
  2-8 rows, blocks of ``ROW_BLOCK`` rows of ``head [V, d]`` (the tied embedding, no copy) from ``a`` to
  ``b``. Cut points are multiples of 256, so every block and every logit's dot product is the unsplit
  one's: bitwise the unsplit logits for 1-8 rows (tests). More rows (a prefill's) take one call per range,
  last-ulp close. Failover replay does not involve the head (it rebuilds workers' caches from recorded
  stage inputs).
- **Speed** (real weights, one BLAS thread per call, median of 41, ``OPENBLAS_NUM_THREADS=1``): unsplit /
  split over 2 threads, 1 row 6.5 / 4.0 ms, 2 rows 11.7 / 12.8, 4 rows 13.5 / 9.1, 8 rows 16.2 / 10.2;
  before the 2+ row head went over ``head [V, d]`` (``h @ head_t``) it took 38-46 ms unsplit at 2-8 rows.
- ``threads = 1`` is the unsplit head (``Orchestrator(head_threads=1)``); the default is 2.
- Ends over the GGUF's blocks (:class:`~ethen.model.qmodel.QuantEmbedAndHead`, ``ETHEN_WEIGHTS=quantized``,
  the default) with a block kernel (:class:`~ethen.model.qhead.BlockHead`: Q8_0 heads at accuracy
  ``exact``) are split the same way: the norm once, then each thread runs the kernel
  (it releases the GIL) over its vocabulary range of one output array. Each logit is computed by the same
  kernel call path for its row whatever the range, so the split logits are bitwise the unsplit ones
  (tests). Other head types are one engine graph whose session runs on the engine's own intra-op threads:
  called as they are.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from ethen.model.errors import ModelInputError
from ethen.model.layers import ROW_BLOCK, SMALL_BATCH_ROWS, rms_norm
from ethen.model.model import EmbedAndHead, Ends
from ethen.model.qhead import BlockHead
from ethen.model.qmodel import QuantEmbedAndHead

__all__ = ["SplitHead"]

F32 = npt.NDArray[np.float32]

_ALIGN = 256  # column cut points are multiples of this


def _rows(head: F32, ht: F32, out_t: F32, a: int, b: int, step: int) -> None:
    """``out_t[a:b] = head[a:b] @ ht`` in blocks of ``step`` rows (cut at the same multiples of ``step`` as
    one unsplit call, so each logit is the same dot product)."""
    for j in range(a, b, step):
        k = min(b, j + step)
        np.matmul(head[j:k], ht, out=out_t[j:k])  # [k - j, N]


class SplitHead:
    """``hidden[N, d]`` -> ``logits[N, V]``: :meth:`EmbedAndHead.logits` with its matmul split by columns."""

    def __init__(self, ends: Ends, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"head_threads = {threads!r}: must be >= 1")
        self.ends = ends
        self.threads = threads
        self._blocks: BlockHead | None = None
        if isinstance(ends, QuantEmbedAndHead):
            if ends.block_head is None:  # one engine graph (its own threads): called as it is
                self._pool, self.split = None, False
                return
            self._blocks = ends.block_head
            self._d, self._vocab = ends.block_head.cols, ends.block_head.rows
        else:
            self._float32: EmbedAndHead = ends
            d, vocab = ends.output_head_t.shape
            self._d, self._vocab = int(d), int(vocab)
        step = -(-self._vocab // threads // _ALIGN) * _ALIGN
        cuts = [min(self._vocab, i * step) for i in range(threads + 1)]
        self._parts = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        self._eps = np.float32(ends.config.rms_eps)
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
        if self._blocks is not None:  # the block kernel over vocabulary ranges, one output array
            assert isinstance(self.ends, QuantEmbedAndHead)
            hb = self.ends.normed(hidden)  # [N, d] C-contiguous
            out_b: F32 = np.empty((hb.shape[0], self._vocab), dtype=np.float32)  # [N, V]
            self._run([functools.partial(self._blocks.matmul_into, hb, out_b, a, b) for a, b in self._parts])
            return out_b
        ends = self._float32
        h = rms_norm(hidden, ends.output_norm, self._eps)  # [N, d]
        if h.shape[0] == 1:  # a gemv over head_t [d, V], columns a:b per thread
            w = ends.output_head_t
            out: F32 = np.empty((1, self._vocab), dtype=np.float32)  # [1, V]
            self._run([functools.partial(np.matmul, h, w[:, a:b], out=out[:, a:b]) for a, b in self._parts])
            return out
        # 2+ rows: what ``linear`` does over head [V, d], vocabulary rows a:b per thread
        head, ht = ends.output_head, h.T  # [V, d], [d, N]
        out_t: F32 = np.empty((self._vocab, h.shape[0]), dtype=np.float32)  # [V, N]
        step = ROW_BLOCK if h.shape[0] <= SMALL_BATCH_ROWS else self._vocab
        self._run([functools.partial(_rows, head, ht, out_t, a, b, step) for a, b in self._parts])
        return out_t.T  # [N, V] (a view of [V, N], as ``linear`` returns it)

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
