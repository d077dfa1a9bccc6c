"""Joined mesh workers in the gateway's store (SQLite or Postgres), the shared membership of a deployment that
has a ``[store]`` and no ``[shared]`` Redis: the second backend of
:class:`~ethen.mesh.orchestrator.shared_members.MemberBackend`.

The rows are :mod:`ethen.store.members`' ``mesh_members`` table (one per provider and node; expiry by the
database's clock). The store is async (SQLAlchemy + aiosqlite / asyncpg) and the membership is synchronous
(its own thread and the registry's gRPC threads, never the gateway's event loop), so :class:`StoreMembers`
runs a private event loop on a daemon thread with its own small engine (one pooled connection) and waits for
each call at most ``timeout_s``; a call that does not finish in time is cancelled. Any store error, a
timeout or a missing table becomes :class:`SharedMembersUnavailable`. SQLite: ``synchronous=NORMAL`` for
this engine (WAL: no fsync per announcement; an announcement lost to a power cut is re-sent within 2 s).
Lapsed rows are swept by the writer at most once per expiry period.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from ethen.mesh.orchestrator.shared_members import Announcement, SharedMembersUnavailable
from ethen.store.engine import make_engine
from ethen.store.errors import StoreError
from ethen.store.members import MemberTable

__all__ = ["StoreMembers"]

T = TypeVar("T")


class StoreMembers:
    """The joined workers of mesh provider ``provider_id`` in the store at ``url`` (``sqlite:///...`` or
    ``postgresql://...``)."""

    kind = "store"

    def __init__(self, url: str, provider_id: str, *, timeout_s: float = 1.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.instance_id = uuid.uuid4().hex[:12]
        try:
            engine = make_engine(url, pool_size=1, sqlite_synchronous="NORMAL")
        except StoreError as exc:
            raise SharedMembersUnavailable(f"store: {exc.message}") from None
        self._engine = engine
        self._table = MemberTable(engine, provider_id)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ethen-membership-store",
                                        daemon=True)
        self._thread.start()
        self._swept_at = float("-inf")  # monotonic time of the last sweep of lapsed rows
        self._closed = False

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise SharedMembersUnavailable("store: the membership is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SharedMembersUnavailable(f"store: no answer within {self.timeout_s:g} s") from None
        except StoreError as exc:
            raise SharedMembersUnavailable(f"store: {exc.message}") from None
        except (OSError, ConnectionError) as exc:
            raise SharedMembersUnavailable(f"store: {type(exc).__name__}: {exc}") from None

    def write(self, a: Announcement, ttl_s: float) -> None:
        """Record ``a`` (database clock: now), lapsing ``ttl_s`` seconds after unless announced again."""
        ttl_ms = max(1, int(ttl_s * 1000))
        self._call(self._table.announce(a.node_id, a.address, a.fragments, ttl_ms, self.instance_id))
        now = time.monotonic()
        if now - self._swept_at >= ttl_s:
            self._swept_at = now
            self._call(self._table.sweep())

    def delete(self, node_id: str, address: str) -> bool:
        """Drop ``node_id``'s row if it still names ``address``; True when it did."""
        return self._call(self._table.forget(node_id, address))

    def read(self) -> dict[str, Announcement]:
        """Every live announcement, by node id (one query)."""
        rows = self._call(self._table.live())
        return {r.node_id: Announcement(r.node_id, r.address, r.fragments) for r in rows}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._engine.dispose(), self._loop).result(self.timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._loop.close()
