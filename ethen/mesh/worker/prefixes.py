"""The worker's prefix cache (issue 45 item 3): KV rows of recent prompt prefixes, LRU, bounded by bytes.

A prefix is named by the orchestrator's hash chain over the prompt's token blocks
(:data:`PREFIX_BLOCK` tokens each, seeded by the model hash: :mod:`ethen.mesh.orchestrator.prefix`), so the
key never holds token text and a worker of another model never matches. Entries are per fragment (a fragment
is the unit a session's KV cache is kept by): one entry holds the K and V rows ``0 .. n-1`` of one fragment,
copied out of a session (never shared with it), and answers for every block hash of its chain up to ``n``.
Seeding copies the first rows into a new session's cache, so sessions never share mutable state.

Not thread-safe by itself: the server calls it under its store lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ethen.model.kv_cache import KVCache

__all__ = ["MAX_REPORTED_PREFIXES", "PREFIX_BLOCK", "PrefixCache"]

PREFIX_BLOCK = 64
"""Tokens per block of the prefix hash chain."""

MAX_REPORTED_PREFIXES = 512
"""At most this many ``hash@fragment`` names go in a Health answer."""


@dataclass(slots=True)
class _Entry:
    fragment: int
    hashes: tuple[str, ...]  # hashes[k] names rows 0 .. (k+1)*PREFIX_BLOCK-1
    k: NDArray[np.float32]  # [L, Hkv, n, hd]
    v: NDArray[np.float32]

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class PrefixCache:
    """``(block hash, fragment) -> KV rows``; least recently used entries go first past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0  # steps seeded from the cache
        self.tokens_reused = 0  # positions those steps did not compute
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # longest hash -> entry (LRU)
        self._index: dict[tuple[str, int], tuple[str, int]] = {}  # any block hash -> its entry's key

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, prefix_hash: str, fragments: Sequence[int]) -> bool:
        return all((prefix_hash, f) in self._index for f in fragments)

    def remember(self, hashes: Sequence[str], fragment: int, cache: KVCache) -> None:
        """Keep the rows of the longest prefix in ``hashes`` that ``cache`` holds (a copy)."""
        blocks = min(len(hashes), cache.length // PREFIX_BLOCK)
        if blocks <= 0:
            return
        key = (hashes[blocks - 1], fragment)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        n = blocks * PREFIX_BLOCK
        entry = _Entry(fragment, tuple(hashes[:blocks]), cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy())
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        for h in entry.hashes:
            self._index[(h, fragment)] = key  # the newest (longest) entry answers
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        for h in entry.hashes:
            if self._index.get((h, entry.fragment)) == key:
                del self._index[(h, entry.fragment)]
        for other_key, other in reversed(self._entries.items()):  # a shorter prefix another entry still has
            if other.fragment == entry.fragment:
                for h in other.hashes:
                    self._index.setdefault((h, other.fragment), other_key)

    def seed(self, prefix_hash: str, length: int, fragment: int, cache: KVCache) -> bool:
        """Copy rows ``0 .. length-1`` named by ``prefix_hash`` into the empty ``cache``; False: not held."""
        key = self._index.get((prefix_hash, fragment))
        if key is None or cache.length != 0:
            return False
        entry = self._entries[key]
        if length <= 0 or length % PREFIX_BLOCK or length > entry.k.shape[2] \
                or entry.hashes[length // PREFIX_BLOCK - 1] != prefix_hash:
            return False
        self._entries.move_to_end(key)
        cache.reserve(length)
        cache.k[:, :, :length] = entry.k[:, :, :length]
        cache.v[:, :, :length] = entry.v[:, :, :length]
        cache.commit(length)
        return True

    def names(self, limit: int = MAX_REPORTED_PREFIXES) -> list[str]:
        """``hash@fragment`` of the held prefixes, most recently used first (at most ``limit``)."""
        out: list[str] = []
        for key in reversed(self._entries):
            entry = self._entries[key]
            for h in reversed(entry.hashes):
                if len(out) >= limit:
                    return out
                if self._index.get((h, entry.fragment)) == key:
                    out.append(f"{h}@{entry.fragment}")
        return out
