"""The request path's cache of authenticated store keys: a principal is cached in memory by the SHA-256 of the
presented key (not the key), dropped on every key revocation or policy change (:meth:`KeyCache.clear`: the
:class:`~ethen.store.admission.Admission` polls the ``store_changes`` counter), and ``last_used_at`` is
written at most once a minute per key, off the request path."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable

from .models import Principal
from .store import LAST_USED_GRANULARITY, Store

__all__ = ["KeyCache"]

_MAX_KEYS = 100_000  # key cache bound (cleared when full)


class KeyCache:
    """Principals by the SHA-256 of their key, at most :data:`_MAX_KEYS` (cleared when full). ``spawn`` runs
    the ``last_used_at`` writes in the background."""

    def __init__(self, store: Store, spawn: Callable[[Awaitable[None]], None]) -> None:
        self.store = store
        self._keys: dict[bytes, tuple[Principal, float]] = {}
        self._gen = 0
        self._spawn = spawn

    def clear(self) -> None:
        """Drop every cached principal (a key was revoked or a policy changed); a lookup in flight when this
        runs is not cached."""
        self._gen += 1
        self._keys.clear()

    async def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked store key (cached), else ``None``."""
        digest = hashlib.sha256(key.encode()).digest()
        now = time.monotonic()
        hit = self._keys.get(digest)
        if hit is not None:
            principal, used = hit
            if now - used >= LAST_USED_GRANULARITY.total_seconds():
                self._keys[digest] = (principal, now)
                self._spawn(self.store.touch_key(principal.key_id))
            return principal
        gen = self._gen
        found = await self.store.authenticate(key)
        if found is not None and gen == self._gen:  # no invalidation happened during the lookup
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            self._keys[digest] = (found, now)
        return found
