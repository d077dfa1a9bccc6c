"""Per-session KV cache for a contiguous range of layers, with a measurable footprint.

Buffers are preallocated as ``[L, Hkv, capacity, hd]`` float32 for K and for V and grow by doubling (capped
at the context length), so a decode step writes one slot per layer and never copies the whole cache.
``nbytes`` is the memory actually allocated; :meth:`KVCache.nbytes_after` tells a worker, before it runs a
step, what the footprint would become, so a memory cap can refuse the step cleanly instead of running out of
memory.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import KVCacheFullError, ModelInputError

__all__ = ["DEFAULT_INITIAL_CAPACITY", "KVCache"]

DEFAULT_INITIAL_CAPACITY = 64


class KVCache:
    """Keys and values of one session for ``n_layers`` consecutive layers."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY) -> None:
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("max_tokens", max_tokens), ("initial_capacity", initial_capacity)):
            if not isinstance(value, int) or value <= 0:
                raise ModelInputError(f"KVCache {name} must be a positive int, got {value!r}")
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.length = 0  # positions 0 .. length-1 are cached
        cap = min(initial_capacity, max_tokens)
        self.k: NDArray[np.float32] = np.zeros((n_layers, n_kv_heads, cap, head_dim), dtype=np.float32)
        self.v: NDArray[np.float32] = np.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V (what the session costs the worker now)."""
        return int(self.k.nbytes + self.v.nbytes)

    def bytes_for_capacity(self, capacity: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * capacity * self.head_dim * 4

    def _grown_capacity(self, needed: int) -> int:
        cap = self.capacity
        while cap < needed:
            cap *= 2
        return min(cap, self.max_tokens)

    def nbytes_after(self, n_new: int) -> int:
        """Bytes allocated once ``n_new`` more positions are appended (for enforcing a memory cap first)."""
        needed = self.length + n_new
        if needed > self.max_tokens:
            raise KVCacheFullError(
                f"KV cache would hold {needed} positions, over max_tokens={self.max_tokens}")
        return self.bytes_for_capacity(self._grown_capacity(needed))

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more positions (doubling the buffers when needed)."""
        needed = self.length + n_new
        if needed > self.max_tokens:
            raise KVCacheFullError(
                f"KV cache would hold {needed} positions, over max_tokens={self.max_tokens}")
        if needed <= self.capacity:
            return
        cap = self._grown_capacity(needed)
        shape = (self.n_layers, self.n_kv_heads, cap, self.head_dim)
        k = np.zeros(shape, dtype=np.float32)
        v = np.zeros(shape, dtype=np.float32)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def commit(self, n_new: int) -> None:
        """Mark ``n_new`` positions (already written by every layer) as cached."""
        if self.length + n_new > self.capacity:
            raise ModelInputError(f"commit of {n_new} positions exceeds capacity {self.capacity}")
        self.length += n_new

    def truncate(self, length: int) -> None:
        """Forget positions ``length ..`` (e.g. to redo a step whose reply was lost). Keeps the buffers."""
        if not isinstance(length, int) or not 0 <= length <= self.length:
            raise ModelInputError(f"truncate length must be in [0, {self.length}], got {length!r}")
        self.length = length
