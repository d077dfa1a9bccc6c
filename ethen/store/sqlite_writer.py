"""The one SQLite write connection of a gateway process: ledger batches on the event loop, the rest on a
thread.

Every write transaction of the process (ledger batches, budget claims, heartbeats, the request log) goes
through this one connection, so they never contend for SQLite's write lock among themselves; an
``asyncio.Lock`` keeps it used by one transaction at a time, whichever thread runs it.

Where a ledger batch runs (measured, ``/tmp``-free ``/dev/shm`` file, NORMAL: a settlement awaited 0.87 ms
through the thread, 0.33 ms inline; and under a busy event loop the thread's extra wake-ups and GIL
re-acquisitions -- one per statement -- cost up to the interpreter's switch interval, 5 ms, each):

- ``BEGIN IMMEDIATE`` and the statements run **on the event loop**, with a busy timeout of 0: they only touch
  SQLite's page cache (microseconds). If another connection holds the write lock (another process on the
  same file, the admin API's engine, the CLI), the whole batch is redone on the thread, which waits in
  SQLite's busy handler as before; the loop never sleeps on a lock.
- ``COMMIT``: with ``synchronous=NORMAL`` it is a ``write()`` into the WAL (no fsync) and runs inline; a
  committed entry then survives a crash or ``kill -9`` of the process, not a power loss. With ``FULL`` (the
  default) or ``EXTRA`` it fsyncs, so it runs on the thread and the loop goes on serving meanwhile.
- Inline, SQLite's own automatic checkpoint would run inside a ``COMMIT`` on the loop (copying the WAL into
  the database and fsyncing it), so in NORMAL mode the writer connection turns it off and runs a
  ``PASSIVE`` checkpoint on its thread every :data:`CHECKPOINT_COMMITS` commits, holding the lock (batches
  queue meanwhile; the loop does not wait). With FULL the automatic checkpoint stays, on the thread.
- Other transactions (:meth:`SqliteWriter.run`: claims, heartbeats, the request log, pruning) run on the
  thread, where a contended lock may wait.

A task cancelled while its transaction runs on the thread keeps the lock until the thread is done with the
connection (a sqlite3 connection must never be used by two threads at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from .engine import WRITE_OPTION, sqlite_thread_engine

__all__ = ["CHECKPOINT_COMMITS", "SqliteWriter"]

T = TypeVar("T")

#: NORMAL mode: inline commits between two PASSIVE checkpoints (a settlement adds ~4 WAL pages: about
#: SQLite's default of 1,000 pages).
CHECKPOINT_COMMITS = 256
_BUSY_WAIT_MS = 10_000  # the thread's busy timeout (the pool's connections use the same)

#: One statement of a batch: SQL text with ``?`` parameters and its parameter tuples (empty: skipped).
Statement = tuple[str, Sequence[tuple[Any, ...]]]


def _busy(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class SqliteWriter:
    """The writer connection of one store (module docstring). ``close`` when done."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._sync = sqlite_thread_engine(engine)
        self.synchronous: str = getattr(engine.sync_engine, "info_synchronous", "FULL")
        self.inline_commit = self.synchronous == "NORMAL"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ethen-ledger")
        self._lock = asyncio.Lock()
        self._conn: Connection | None = None
        self._raw: Any = None  # its sqlite3 connection
        self._since_checkpoint = 0
        self._checkpointing: asyncio.Task[None] | None = None
        self._closed = False
        #: batches redone on the thread because another connection held the write lock
        self.contended = 0

    # -- the connection ----------------------------------------------------------------------------------
    def _connection(self) -> tuple[Connection, Any]:
        conn = self._conn
        if conn is not None and self._raw is not None and not conn.invalidated:
            return conn, self._raw  # the usual case (SQLAlchemy's properties cost ~10 us a call)
        if conn is not None:
            conn.close()
        conn = self._conn = self._sync.connect().execution_options(**{WRITE_OPTION: True})
        raw = self._raw = conn.connection.driver_connection
        assert raw is not None
        raw.execute("PRAGMA busy_timeout=0")
        if self.inline_commit:
            raw.execute("PRAGMA wal_autocheckpoint=0")
        return conn, raw

    def close(self) -> None:
        """Close the connection, the threads and the engine (no transaction may be running)."""
        self._closed = True
        if self._checkpointing is not None:
            self._checkpointing.cancel()  # not started, or waiting for its PRAGMA (which the thread finishes)
        if self._conn is not None:
            self._thread.submit(self._conn.close).result()
            self._conn = self._raw = None
        self._thread.shutdown(wait=True)
        self._sync.dispose()

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the writer thread; if the caller is cancelled, still wait until it is done."""
        fut = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    # -- transactions --------------------------------------------------------------------------------------
    async def run(self, fn: Callable[[Connection], T]) -> T:
        """``fn`` in one write transaction, on the thread (which may wait for the lock there)."""
        async with self._lock:
            return await self._on_thread(self._run_blocking, fn)

    def _run_blocking(self, fn: Callable[[Connection], T]) -> T:
        conn, raw = self._connection()
        raw.execute(f"PRAGMA busy_timeout={_BUSY_WAIT_MS}")
        try:
            with conn.begin():
                return fn(conn)
        finally:
            if not conn.invalidated and not conn.closed:
                raw.execute("PRAGMA busy_timeout=0")

    async def batch(self, statements: Sequence[Statement]) -> None:
        """The statements in one transaction, durable (as ``synchronous`` makes it) when this returns."""
        async with self._lock:
            conn, raw = self._connection()
            try:
                self._inline(raw, statements)
            except sqlite3.Error as exc:
                if not _busy(exc):
                    self._abort(conn, raw, exc)
                    raise
                # another connection holds a lock this needs: roll back, redo it all where waiting is fine
                self._abort(conn, raw, exc)
                self.contended += 1
                await self._on_thread(self._batch_blocking, statements)
                return
            if not self.inline_commit:
                try:
                    await self._on_thread(raw.execute, "COMMIT")
                except BaseException as exc:
                    self._abort(conn, raw, exc)
                    raise
        if self.inline_commit:
            self._count_commit()

    def _inline(self, raw: Any, statements: Sequence[Statement]) -> None:
        """On the loop, busy timeout 0: ``BEGIN IMMEDIATE``, the statements, and ``COMMIT`` if inline."""
        raw.execute("BEGIN IMMEDIATE")
        for sql, params in statements:
            if params:
                raw.executemany(sql, params)
        if self.inline_commit:
            raw.execute("COMMIT")

    def _batch_blocking(self, statements: Sequence[Statement]) -> None:
        conn, raw = self._connection()
        raw.execute(f"PRAGMA busy_timeout={_BUSY_WAIT_MS}")
        try:
            raw.execute("BEGIN IMMEDIATE")
            for sql, params in statements:
                if params:
                    raw.executemany(sql, params)
            raw.execute("COMMIT")
        except BaseException as exc:
            self._abort(conn, raw, exc)
            raise
        finally:  # the loop's inline statements must never wait on a lock, whatever happened here
            if not conn.invalidated:
                raw.execute("PRAGMA busy_timeout=0")

    @staticmethod
    def _abort(conn: Connection, raw: Any, exc: BaseException) -> None:
        try:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        keep = isinstance(exc, sqlite3.IntegrityError) or (isinstance(exc, sqlite3.Error) and _busy(exc))
        if not keep:
            conn.invalidate()  # a fresh connection for the next batch (e.g. after a disk I/O error)

    # -- checkpoints (NORMAL mode) -------------------------------------------------------------------------
    def _count_commit(self) -> None:
        self._since_checkpoint += 1
        if self._since_checkpoint < CHECKPOINT_COMMITS or self._checkpointing is not None:
            return
        self._since_checkpoint = 0
        self._checkpointing = asyncio.get_running_loop().create_task(self._checkpoint())

    async def _checkpoint(self) -> None:
        """A PASSIVE checkpoint on the thread, holding the lock: with no commit of this process between its
        start and its end it copies every frame back, so the next write starts the WAL over (a checkpoint
        racing new commits never catches up, and the WAL would grow without bound)."""
        try:
            async with self._lock:
                if self._closed:
                    return
                _conn, raw = self._connection()
                with contextlib.suppress(sqlite3.Error):
                    await self._on_thread(lambda: raw.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall())
        finally:
            self._checkpointing = None
