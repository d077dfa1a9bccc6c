"""Where entries live: :class:`MemoryBackend` (one process: an LRU bounded by ``max_entries`` whose entries
expire ``ttl_s`` after they were stored; the caller passes the monotonic time in) and :class:`RedisBackend`
(the ``[shared]`` Redis: ``SET key value PX ttl``, so every instance sharing the Redis serves what any of
them stored).

Redis: keys are ``<key_prefix>:cache:<sha256>``; Redis expires them. ``max_entries`` is not enforced there
(bound the Redis with ``maxmemory`` and an ``allkeys-lru`` / ``volatile-lru`` policy). The entries/bytes
gauges are best effort: a background task counts the cache's keys and their sizes (``SCAN`` +
``STRLEN``) every ``measure_every_s`` (10 s) while the cache is used, so they lag by that much and cover
every instance's entries. A Redis error is a miss (a lookup) or a skipped write, logged once per outage by
:class:`~ethen.gateway.redis_state.SharedState`; the request is served either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from ethen.gateway.errors import SharedStateUnavailableError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ethen.gateway.redis_state import SharedState

__all__ = ["Backend", "MemoryBackend", "RedisBackend"]

log = logging.getLogger("ethen.gateway.cache")


class Backend(Protocol):
    """An entry store: ``get`` / ``put`` raw entries by key; ``entries`` / ``size`` (bytes) for the gauges."""

    @property
    def entries(self) -> int: ...
    @property
    def size(self) -> int: ...
    async def get(self, key: str, now: float) -> bytes | None: ...
    def put(self, key: str, raw: bytes, now: float) -> None: ...
    async def aclose(self) -> None: ...


class MemoryBackend:
    """An LRU of at most ``max_entries`` entries, each served for ``ttl_s`` after it was stored. ``now`` is
    monotonic time (seconds); the methods do no I/O and read no clock."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires at, raw)
        self._bytes = 0

    @property
    def entries(self) -> int:
        return len(self._items)

    @property
    def size(self) -> int:
        """The stored entries' sizes (their encoded bytes; not Python's object overhead)."""
        return self._bytes

    def lookup(self, key: str, now: float) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] <= now:
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return item[1]

    async def get(self, key: str, now: float) -> bytes | None:
        return self.lookup(key, now)

    def put(self, key: str, raw: bytes, now: float) -> None:
        if key in self._items:
            self._drop(key)
        self._items[key] = (now + self.ttl_s, raw)
        self._bytes += len(raw)
        while len(self._items) > self.max_entries:
            self._drop(next(iter(self._items)))

    def _drop(self, key: str) -> None:
        _, raw = self._items.pop(key)
        self._bytes -= len(raw)

    async def aclose(self) -> None:
        self._items.clear()
        self._bytes = 0


class RedisBackend:
    """Entries in the ``[shared]`` Redis (module docstring). Writes run as background tasks (a miss's
    answer does not wait for Redis)."""

    def __init__(self, shared: SharedState, ttl_s: float, *, measure_every_s: float = 10.0) -> None:
        self.shared = shared
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.prefix = shared.key("cache", "")
        self.measure_every_s = measure_every_s
        self._entries = 0
        self._bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._measurer: asyncio.Task[None] | None = None

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def size(self) -> int:
        return self._bytes

    async def get(self, key: str, now: float) -> bytes | None:
        self._measure_soon()
        k = self.prefix + key
        try:
            raw = await self.shared.call(lambda r: r.get(k))
        except SharedStateUnavailableError:
            return None
        return raw if isinstance(raw, bytes) else None

    def put(self, key: str, raw: bytes, now: float) -> None:
        k, px = self.prefix + key, self.ttl_ms

        async def write() -> None:
            with contextlib.suppress(SharedStateUnavailableError):
                await self.shared.call(lambda r: r.set(k, raw, px=px))

        task = asyncio.get_running_loop().create_task(write())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Wait for the writes under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def measure(self) -> None:
        """Count the cache's keys and their sizes (``SCAN MATCH <prefix>:cache:*`` + ``STRLEN``)."""
        pattern = self.prefix + "*"

        async def count(r: Redis) -> tuple[int, int]:
            n = size = 0
            async for batch in _batches(r, pattern):
                pipe = r.pipeline(transaction=False)
                for k in batch:
                    pipe.strlen(k)
                sizes = await pipe.execute()
                n += len(batch)
                size += sum(int(s) for s in sizes)
            return n, size

        self._entries, self._bytes = await self.shared.call(count)

    def _measure_soon(self) -> None:
        if self._measurer is None:
            self._measurer = asyncio.get_running_loop().create_task(self._measure_loop())

    async def _measure_loop(self) -> None:
        while True:
            with contextlib.suppress(SharedStateUnavailableError):
                await self.measure()
            await asyncio.sleep(self.measure_every_s)

    async def aclose(self) -> None:
        await self.flush()
        if self._measurer is not None:
            self._measurer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._measurer
            self._measurer = None


async def _batches(r: Redis, pattern: str) -> AsyncIterator[list[bytes]]:
    batch: list[bytes] = []
    async for k in r.scan_iter(match=pattern, count=500):
        batch.append(k)
        if len(batch) >= 500:
            yield batch
            batch = []
    if batch:
        yield batch
