"""Joined mesh workers in the gateway's store (SQLite or Postgres), the shared membership of a deployment that
has a ``[store]`` and no ``[shared]`` Redis: the second backend of
:class:`~ethen.mesh.orchestrator.shared_members.MemberBackend`.

The rows are :mod:`ethen.store.members`' ``mesh_members`` table (one per provider and node; expiry by the
database's clock). The membership is synchronous (its own thread and the registry's gRPC threads, never the
gateway's event loop), with its own small engine, every call bounded by ``timeout_s``:

- **SQLite**: a synchronous pysqlite engine (one connection, calls serialized by a lock waited for at most
  ``timeout_s``; ``busy_timeout`` = ``timeout_s``, so a write waiting for the ledger writer's lock gives up
  in time): a read is one ~0.15 ms statement in the caller's thread. ``synchronous=NORMAL`` (WAL: no fsync
  per announcement; one lost to a power cut is re-sent within 2 s).
- **Postgres** (asyncpg only): a private event loop on a daemon thread runs the async engine; each call waits
  at most ``timeout_s`` and is cancelled after that.

Any store error, a timeout or a missing table becomes :class:`SharedMembersUnavailable`. Lapsed rows are
swept by the writer at most once per expiry period.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ethen.mesh.orchestrator.shared_members import Announcement, SharedMembersUnavailable
from ethen.store import MemberRow, MemberTable, StoreError, SyncMemberTable, open_member_table

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
        self._swept_at = float("-inf")  # monotonic time of the last sweep of lapsed rows
        self._closed = False
        self._sync: SyncMemberTable | None = None
        self._table: MemberTable | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            table = open_member_table(url, provider_id, timeout_s=timeout_s)
            if isinstance(table, SyncMemberTable):
                self._sync = table
                return
            self._table = table
        except StoreError as exc:
            raise SharedMembersUnavailable(f"store: {exc.message}") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ethen-membership-store",
                                        daemon=True)
        self._thread.start()

    def _run(self, sync: Callable[[SyncMemberTable], T],
             aio: Callable[[MemberTable], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise SharedMembersUnavailable("store: the membership is closed")
        try:
            if self._sync is not None:
                if not self._lock.acquire(timeout=self.timeout_s):
                    raise SharedMembersUnavailable(f"store: busy for {self.timeout_s:g} s")
                try:
                    return sync(self._sync)
                finally:
                    self._lock.release()
            assert self._table is not None and self._loop is not None
            future = asyncio.run_coroutine_threadsafe(aio(self._table), self._loop)
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
        args = (a.node_id, a.address, a.fragments, max(1, int(ttl_s * 1000)), self.instance_id)
        self._run(lambda t: t.announce(*args), lambda t: t.announce(*args))
        now = time.monotonic()
        if now - self._swept_at >= ttl_s:
            self._swept_at = now
            self._run(lambda t: t.sweep(), lambda t: t.sweep())

    def delete(self, node_id: str, address: str) -> bool:
        """Drop ``node_id``'s row if it still names ``address``; True when it did."""
        return self._run(lambda t: t.forget(node_id, address), lambda t: t.forget(node_id, address))

    def read(self) -> dict[str, Announcement]:
        """Every live announcement, by node id (one query)."""
        rows: list[MemberRow] = self._run(lambda t: t.live(), lambda t: t.live())
        return {r.node_id: Announcement(r.node_id, r.address, r.fragments) for r in rows}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sync is not None:
            with self._lock:
                self._sync.engine.dispose()
            return
        assert self._table is not None and self._loop is not None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._table.engine.dispose(), self._loop).result(self.timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._loop.close()
