"""The orchestrator's head (final RMSNorm + ``[N, d] x [d, V]``) with the matmul split by vocabulary columns
over ``threads`` threads.

Why: on every decode step the head sits on the critical path of the sessions it serves, between the last
stage's output and the next token's embedding, and it is a read of the whole ``[d, V]`` float32 matrix
(113 MB for the model here). While it runs the workers wait for the next step, so their cores are idle:
splitting the columns over two threads (numpy releases the GIL inside BLAS, BLAS itself stays
single-threaded as the mesh processes run it) took the head from 7.3 to 5.5 ms for one row and from 22.5
to 12.2 ms for eight rows on the 2-core VM here (``bench/mesh_hosts.py`` prints both, measured in the same
run).

Choices where the issue is silent:

- **Numerics**: the norm is computed once, exactly as :meth:`~ethen.model.model.EmbedAndHead.logits` does,
  and each thread writes its column range of one output array. Every logit is the same dot product over
  ``d`` as in one call; cut points are multiples of 256 columns. For 1-4 rows the logits are bitwise those
  of the unsplit head here; for 8 rows OpenBLAS's gemm blocking differs in the last ulp (max 7e-6), the
  order by which a batched ``[B, d]`` head already differs from a one-row one, and greedy output stays that
  of the single process (tests). Failover replay does not involve the head (it rebuilds workers' caches
  from recorded stage inputs).
- ``threads = 1`` is the unsplit head (``Orchestrator(head_threads=1)``); the default is 2.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from ethen.model.errors import ModelInputError
from ethen.model.layers import rms_norm
from ethen.model.model import EmbedAndHead

__all__ = ["SplitHead"]

F32 = npt.NDArray[np.float32]

_ALIGN = 256  # column cut points are multiples of this


class SplitHead:
    """``hidden[N, d]`` -> ``logits[N, V]``: :meth:`EmbedAndHead.logits` with its matmul split by columns."""

    def __init__(self, ends: EmbedAndHead, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"head_threads = {threads!r}: must be >= 1")
        self.ends = ends
        self.threads = threads
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
        h = rms_norm(hidden, self.ends.output_norm, self._eps)  # [N, d]
        w = self.ends.output_head_t
        out: F32 = np.empty((h.shape[0], self._vocab), dtype=np.float32)
        pending: list[Future[F32]] = [self._pool.submit(np.matmul, h, w[:, a:b], out=out[:, a:b])
                                      for a, b in self._parts[1:]]
        a, b = self._parts[0]
        np.matmul(h, w[:, a:b], out=out[:, a:b])
        for fut in pending:
            fut.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
