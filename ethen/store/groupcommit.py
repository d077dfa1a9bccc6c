"""Group commit of ledger settlements: one writer task commits everything queued in one transaction.

Each settlement is a ledger row, its share of the project's day total and (when it was admitted against a
budget grant) a decrement of this instance's grant; a batch is one transaction of a few statements whatever
its size (the day totals and grant decrements are summed per project first). Callers await their batch's
commit, so an entry is durable before they go on (before the answer leaves). A batch that fails fails every
one of its callers with the store's error (:class:`~ethen.store.errors.StoreError`), and nothing of it lands.

Where the time went, and what the writer does about it (measured with ``bench/store_admission.py`` and a
profile of the writer thread; a one-entry batch on SQLite ``NORMAL``, whose commit itself is ~0.17 ms):

- **SQLite**: aiosqlite hops to its thread and back for every statement, and SQLAlchemy Core's
  per-statement execution (events, compiled-cache lookup, parameter processing, result set-up) cost ~0.6 ms
  per batch, more than the commit; the batch goes to the DBAPI connection directly: ``BEGIN IMMEDIATE``,
  three ``executemany`` of SQL compiled once from the schema with prepared parameter tuples (the ``at``
  column through SQLAlchemy's own bind processor, so rows are stored exactly as before), ``COMMIT``. It runs
  on the process's one write connection (:mod:`ethen.store.sqlite_writer`: statements on the event loop,
  an fsyncing ``COMMIT`` on its thread), which this process's other write transactions (claims,
  heartbeats, the request log) share through :meth:`GroupCommit.transaction`, so they never contend for
  SQLite's write lock.
- **Postgres**: a batch is one statement (``_PG_BATCH``: data-modifying CTEs, arrays of the batch's rows;
  ``_PG_ONE``, scalar parameters, for a batch of one) sent in autocommit on a connection the writer keeps
  checked out: one round trip per batch. Checking a
  pooled connection out per batch added the pool's pre-ping (a second round trip); the kept connection is
  handed back to the pool after ``_PG_IDLE_S`` without a batch (the next checkout pings it), and dropped
  after an error other than a deadlock (a deadlock victim is rolled back whole and retried).
  With ``[store] postgres_synchronous_commit = "off"`` that connection (only it: grants, claims and admin
  writes keep the server's setting) commits without waiting for the WAL flush: the settlement is visible to
  every instance at once and survives a crash or ``kill -9`` of the gateway (it is in the server's WAL
  buffers), but a crash of the Postgres server itself loses the last <= 3 x ``wal_writer_delay`` (600 ms by
  default) of settlements, as SQLite's ``NORMAL`` loses the last ones on a power loss. Measured on this VM
  (one-entry batch, serial): 0.91 ms with ``on``, 0.46 ms with ``off``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, bindparam, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from . import schema as s
from .engine import boundary
from .errors import StoreError, StoreUnavailableError
from .sqlite_writer import SqliteWriter
from .store import Store

__all__ = ["MAX_BATCH", "Entry", "GroupCommit"]

T = TypeVar("T")

#: Most settlements committed in one transaction.
MAX_BATCH = 512
#: Seconds without a batch after which the writer gives its Postgres connection back to the pool.
_PG_IDLE_S = 2.0

#: The ledger columns a settlement writes, in the order of the raw statements' parameters.
LEDGER_COLUMNS = (
    "request_id",
    "project_id",
    "key_id",
    "provider",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "cost_nano",
    "estimated",
    "at",
    "cache_read_tokens",
    "cache_write_tokens",
    "saved_nano",
)


@dataclass(slots=True)
class Entry:
    """One queued settlement: the ledger row, the grant it was admitted against (``None``: no grant) and the
    amount held for it (nano-USD), and the future its caller awaits."""

    row: dict[str, Any]
    grant_project: int | None
    held_nano: int
    future: asyncio.Future[None]


def _day(row: dict[str, Any]) -> str:
    """The ``daily_spend`` day (``YYYY-MM-DD``, UTC) a ledger row counts in."""
    day: str = row["at"].date().isoformat()
    return day


def _sums(batch: list[Entry]) -> tuple[dict[tuple[int, str], int], dict[int, int]]:
    """Per (project, UTC day) settled totals and per-project grant decrements of a batch."""
    days: dict[tuple[int, str], int] = {}
    spent: dict[int, int] = {}
    for e in batch:
        key = (e.row["project_id"], _day(e.row))
        days[key] = days.get(key, 0) + e.row["cost_nano"]
        if e.grant_project is not None:
            spent[e.grant_project] = spent.get(e.grant_project, 0) + e.row["cost_nano"]
    return days, spent


def _sqlite_sql() -> tuple[str, str, str]:
    """The SQLite batch's three statements as SQL text with ``?`` parameters, compiled once from the schema:
    the day-total upsert (project, day, cost), the ledger insert (:data:`LEDGER_COLUMNS`) and the grant
    decrement (cost, instance, project)."""
    d = sqlite.dialect(paramstyle="qmark")
    day = sqlite_insert(s.daily_spend)
    day = day.on_conflict_do_update(
        index_elements=["project_id", "day"],
        set_={"settled_nano": s.daily_spend.c.settled_nano + day.excluded.settled_nano},
    )
    bg = s.budget_grants.c
    grant = (
        update(s.budget_grants)
        .where(bg.instance_id == bindparam("iid"), bg.project_id == bindparam("pid"))
        .values(amount_nano=bg.amount_nano - bindparam("cost"))
        .compile(dialect=d)
    )
    assert grant.positiontup == ["cost", "iid", "pid"], grant.positiontup
    return (
        str(day.compile(dialect=d, column_keys=["project_id", "day", "settled_nano"])),
        str(s.ledger.insert().compile(dialect=d, column_keys=list(LEDGER_COLUMNS))),
        str(grant),
    )


_SQLITE_DAY, _SQLITE_LEDGER, _SQLITE_GRANT = _sqlite_sql()
_at_processor = s.ledger.c.at.type.dialect_impl(sqlite.dialect()).bind_processor(sqlite.dialect())
_SQLITE_AT: Callable[[Any], Any] = _at_processor if _at_processor is not None else (lambda v: v)


def sqlite_params(
    instance_id: str, batch: list[Entry]
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The parameter tuples of a SQLite batch: day totals, ledger rows, grant decrements (non-zero only)."""
    days, spent = _sums(batch)
    at = _SQLITE_AT
    rows = []
    for e in batch:
        r = e.row
        rows.append((
            r["request_id"], r["project_id"], r["key_id"], r["provider"], r["model"], r["prompt_tokens"],
            r["completion_tokens"], r["cost_nano"], r["estimated"], at(r["at"]), r["cache_read_tokens"],
            r["cache_write_tokens"], r["saved_nano"],
        ))
    day_params = [(pid, day, cost) for (pid, day), cost in days.items()]
    grants = [(cost, instance_id, pid) for pid, cost in spent.items() if cost]
    return day_params, rows, grants


#: Postgres: the whole batch as one statement (data-modifying CTEs run exactly once), sent in autocommit:
#: one round trip and one commit instead of five round trips (measured: ~4 ms vs ~9.5 ms on a loaded VM).
_PG_BATCH = """
WITH l AS (
  INSERT INTO ledger (request_id, project_id, key_id, provider, model, prompt_tokens, completion_tokens,
                      cost_nano, estimated, at, cache_read_tokens, cache_write_tokens, saved_nano)
  SELECT * FROM unnest($1::varchar[], $2::int[], $3::varchar[], $4::varchar[], $5::varchar[], $6::bigint[],
                       $7::bigint[], $8::bigint[], $9::int[], $10::timestamptz[], $11::bigint[],
                       $12::bigint[], $13::bigint[])
), d AS (
  INSERT INTO daily_spend (project_id, day, settled_nano)
  SELECT * FROM unnest($14::int[], $15::varchar[], $16::bigint[])
  ON CONFLICT (project_id, day) DO UPDATE SET settled_nano = daily_spend.settled_nano + EXCLUDED.settled_nano
)
UPDATE budget_grants AS b SET amount_nano = b.amount_nano - x.cost
FROM unnest($17::int[], $18::bigint[]) AS x(pid, cost)
WHERE b.instance_id = $19 AND b.project_id = x.pid
"""


#: Postgres, a batch of one entry (every batch at low rates, where its latency is the whole added wait): the
#: same three writes with scalar parameters. Measured on an idle server with 10 ms between batches (the
#: server's backend asleep between them, as at 100 req/s): 0.67 ms against 0.80 ms for ``_PG_BATCH``'s array
#: decoding and ``unnest`` (``SELECT 1``: 0.38 ms). ``$16`` is the grant's project (NULL: no grant, no row).
_PG_ONE = """
WITH l AS (
  INSERT INTO ledger (request_id, project_id, key_id, provider, model, prompt_tokens, completion_tokens,
                      cost_nano, estimated, at, cache_read_tokens, cache_write_tokens, saved_nano)
  VALUES ($1::varchar, $2::int, $3::varchar, $4::varchar, $5::varchar, $6::bigint, $7::bigint, $8::bigint,
          $9::int, $10::timestamptz, $11::bigint, $12::bigint, $13::bigint)
), d AS (
  INSERT INTO daily_spend (project_id, day, settled_nano) VALUES ($2::int, $14::varchar, $8::bigint)
  ON CONFLICT (project_id, day) DO UPDATE SET settled_nano = daily_spend.settled_nano + EXCLUDED.settled_nano
)
UPDATE budget_grants SET amount_nano = amount_nano - $8::bigint
WHERE instance_id = $15::varchar AND project_id = $16::int
"""


def _pg_statement(instance_id: str, batch: list[Entry]) -> tuple[str, list[Any]]:
    """The Postgres statement of a batch and its arguments (:data:`_PG_ONE` for one entry, else
    :data:`_PG_BATCH`)."""
    if len(batch) == 1:
        e = batch[0]
        return _PG_ONE, [*(e.row[c] for c in LEDGER_COLUMNS), _day(e.row), instance_id, e.grant_project]
    return _PG_BATCH, _pg_args(instance_id, batch)


def _pg_args(instance_id: str, batch: list[Entry]) -> list[Any]:
    args: list[Any] = [[e.row[c] for e in batch] for c in LEDGER_COLUMNS]
    days, spent = _sums(batch)
    args += [[k[0] for k in days], [k[1] for k in days], list(days.values())]
    args += [list(spent), list(spent.values()), instance_id]
    return args


class GroupCommit:
    """The writer. ``applied(batch)`` runs after a batch committed, ``failed(batch)`` after it did not (then
    every caller of the batch gets the store error)."""

    def __init__(
        self,
        store: Store,
        instance_id: str,
        applied: Callable[[list[Entry]], None],
        failed: Callable[[list[Entry]], None],
    ) -> None:
        self.store = store
        self.instance_id = instance_id
        self._applied = applied
        self._failed = failed
        self._pending: list[Entry] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._sqlite: SqliteWriter | None = None  # SQLite: the one write connection of the process
        self._pg: AsyncConnection | None = None  # Postgres: the connection kept for batches
        self._pg_raw: Any = None  # and its asyncpg connection
        self._pg_used = 0.0
        #: Committed batches and entries (``entries / batches`` is the mean batch size).
        self.batches = 0
        self.entries = 0

    def start(self) -> None:
        if self.store.dialect == "sqlite":
            self._sqlite = SqliteWriter(self.store.engine)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Commit what is queued, then stop the writer task (:meth:`transaction` still works)."""
        self._closing = True
        if self._task is not None:
            self._wake.set()
            await self._task
            self._task = None
        await self._drop_pg(invalidate=False)

    def dispose(self) -> None:
        """Close the SQLite writer connection, its threads and its engine (after :meth:`stop`)."""
        if self._sqlite is not None:
            self._sqlite.close()
            self._sqlite = None

    async def aclose(self) -> None:
        await self.stop()
        self.dispose()

    async def transaction(self, fn: Callable[[Connection], T], what: str) -> T:
        """Run ``fn`` in one write transaction. On SQLite it runs on the writer's connection (its thread), so
        this process's claims, heartbeats and ledger batches never contend for SQLite's write lock (a
        contended ``BEGIN IMMEDIATE`` sleeps in SQLite's busy handler, up to 100 ms at a time)."""
        with boundary(what):
            if self._sqlite is not None:
                return await self._sqlite.run(fn)
            async with self.store.writer.begin() as conn:
                return await conn.run_sync(fn)

    # -- the writer task -------------------------------------------------------------------------------
    def enqueue(self, row: dict[str, Any], grant_project: int | None, held_nano: int) -> asyncio.Future[None]:
        """Queue one settlement now; the future is done when its batch is committed (or has the store error).
        Raises :class:`StoreUnavailableError` at once when the writer is not running."""
        if self._task is None or self._closing:
            raise StoreUnavailableError("settle spend: the ledger writer is not running")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(Entry(row, grant_project, held_nano, fut))
        self._wake.set()
        return fut

    async def submit(self, row: dict[str, Any], grant_project: int | None, held_nano: int) -> None:
        """Queue one settlement and wait until its batch is committed (raises the store error otherwise)."""
        await self.enqueue(row, grant_project, held_nano)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                try:
                    await self._commit(batch)
                except Exception as exc:  # the writer must outlive any failure
                    if not isinstance(exc, StoreError):
                        exc = StoreUnavailableError(f"settle spend: database error ({type(exc).__name__})")
                    self._failed(batch)
                    for e in batch:
                        if not e.future.done():
                            e.future.set_exception(exc)
                    continue
                self.batches += 1
                self.entries += len(batch)
                self._applied(batch)
                for e in batch:
                    if not e.future.done():
                        e.future.set_result(None)
            if self._closing:
                return

    async def _commit(self, batch: list[Entry]) -> None:
        with boundary("settle spend"):
            if self._sqlite is not None:
                days, rows, grants = sqlite_params(self.instance_id, batch)
                await self._sqlite.batch([(_SQLITE_DAY, days), (_SQLITE_LEDGER, rows),
                                          (_SQLITE_GRANT, grants)])
                return
            sql, args = _pg_statement(self.instance_id, batch)
            for attempt in range(3):  # a deadlock victim is rolled back whole: retrying is safe
                driver = await self._pg_driver()
                try:
                    await driver.execute(sql, *args)
                    self._pg_used = time.monotonic()
                    return
                except Exception as exc:
                    if type(exc).__name__ != "DeadlockDetectedError" or attempt == 2:
                        await self._drop_pg(invalidate=True)
                        raise

    async def _pg_driver(self) -> Any:
        """The asyncpg connection of the kept pooled connection (checked out again after an idle spell)."""
        if self._pg is not None and time.monotonic() - self._pg_used > _PG_IDLE_S:
            await self._drop_pg(invalidate=False)
        if self._pg is None:
            self._pg = await self.store.engine.connect()
            self._pg_raw = (await self._pg.get_raw_connection()).driver_connection
            if self.store.postgres_synchronous_commit == "off":
                try:
                    await self._pg_raw.execute("SET synchronous_commit = off")
                except BaseException:
                    await self._drop_pg(invalidate=True)
                    raise
        assert self._pg_raw is not None
        return self._pg_raw

    async def _drop_pg(self, *, invalidate: bool) -> None:
        conn, raw, self._pg, self._pg_raw = self._pg, self._pg_raw, None, None
        if conn is None:
            return
        try:
            if not invalidate and self.store.postgres_synchronous_commit == "off":
                try:  # the pool's other users keep the server's setting
                    await raw.execute("RESET synchronous_commit")
                except Exception:
                    invalidate = True  # never back to the pool with the writer's setting
            if invalidate:
                await conn.invalidate()
            await conn.close()
        except Exception:  # a broken connection: the pool replaces it
            pass
