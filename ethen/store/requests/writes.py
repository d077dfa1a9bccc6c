"""Writes to the request log: batch inserts (:func:`insert_requests`) and retention (:func:`prune_requests`).

- Inserts are written without SQLAlchemy's per-row work (rows come encoded: :mod:`.encode`). SQLite: two
  ``executemany`` of SQL compiled once from the schema on the DBAPI connection of the transaction, the log
  ids assigned as ``max(id) + 1...`` (the write lock is held since ``BEGIN IMMEDIATE``: SQLite would pick
  the same ids). Postgres: one statement (``unnest`` of one array per column, ids taken from the table's
  sequence in order, both tables written by data-modifying CTEs).
- Retention: :func:`prune_requests` deletes rows older than a cut-off and all but the newest ``max_rows``,
  and a row's attempts with it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Connection, DateTime, Float, Integer, String, delete, select
from sqlalchemy.dialects import sqlite

from ethen.store._common import EngineBase
from ethen.store.engine import boundary
from ethen.store.errors import StoreInvalidError
from ethen.store.values import aware

from .encode import EncodedRow, encode_row
from .table import ATTEMPT_COLUMNS, COLUMNS, request_attempts, request_log

__all__ = ["Write", "insert_requests", "prune_requests"]

#: Runs a function of a connection in one write transaction and returns its result: the gateway passes its
#: ledger writer's (``ethen.store.admission.Admission.write``), so on SQLite the log's inserts share the one
#: writer connection with settlements instead of contending for the write lock (a contended ``BEGIN
#: IMMEDIATE`` sleeps in SQLite's busy handler: measured, it raised the store-backed gateway's p50).
Write = Callable[[Callable[[Connection], Any], str], Awaitable[Any]]


def _sqlite_sql() -> tuple[str, str]:
    d = sqlite.dialect(paramstyle="qmark")
    log = request_log.insert().compile(dialect=d, column_keys=["id", *COLUMNS])
    att = request_attempts.insert().compile(dialect=d, column_keys=list(ATTEMPT_COLUMNS))
    assert log.positiontup == ["id", *COLUMNS] and att.positiontup == list(ATTEMPT_COLUMNS)
    return str(log), str(att)


_SQLITE_LOG, _SQLITE_ATTEMPTS = _sqlite_sql()
_at_bind = request_log.c.at.type.dialect_impl(sqlite.dialect()).bind_processor(sqlite.dialect())
_SQLITE_AT: Callable[[Any], Any] = _at_bind if _at_bind is not None else (lambda v: v)


def _pg_sql() -> str:
    """One statement for a batch: ids from the log's sequence (in order), both tables from column arrays."""
    # strings as TEXT arrays: the insert's own cast to VARCHAR(n) then refuses an overlong value, as before;
    # the JSON columns as their text, cast below
    kinds = ((DateTime, "TIMESTAMPTZ"), (Boolean, "BOOLEAN"), (BigInteger, "BIGINT"), (Integer, "INTEGER"),
             (Float, "FLOAT8"), (String, "TEXT"), (JSON, "TEXT"))
    types = {c.name: next(t for k, t in kinds if isinstance(c.type, k)) for c in request_log.columns}
    log_cols = ", ".join(COLUMNS)
    n = len(COLUMNS)
    arrays = ", ".join(f"${i + 2}::{types[c]}[]" for i, c in enumerate(COLUMNS))
    picks = ", ".join(f"u.{c}::json" if c in ("attempts", "receipt") else f"u.{c}" for c in COLUMNS)
    att_types = ["INTEGER", "INTEGER", "FLOAT8", "TEXT", "TEXT", "TEXT", "TEXT", "INTEGER", "FLOAT8"]
    att_names = ["n", *ATTEMPT_COLUMNS[1:]]
    att_arrays = ", ".join(f"${n + 2 + i}::{t}[]" for i, t in enumerate(att_types))
    att_cols = ", ".join(ATTEMPT_COLUMNS)
    att_picks = ", ".join(f"x.{c}" for c in ATTEMPT_COLUMNS[1:])
    return f"""
WITH ids AS MATERIALIZED (
  SELECT nextval(pg_get_serial_sequence('request_log', 'id')) AS id FROM generate_series(1, $1::int)),
o AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM ids),
r AS (INSERT INTO request_log (id, {log_cols})
      SELECT o.id, {picks} FROM unnest({arrays}) WITH ORDINALITY AS u({log_cols}, n) JOIN o USING (n)),
a AS (INSERT INTO request_attempts ({att_cols})
      SELECT o.id, {att_picks} FROM unnest({att_arrays}) AS x({", ".join(att_names)}) JOIN o USING (n))
SELECT count(*) FROM o"""


_PG_INSERT = _pg_sql()


def _pg_args(rows: Sequence[EncodedRow]) -> tuple[Any, ...]:
    cols = [list(col) for col in zip(*(r.values for r in rows), strict=True)]
    flat = [(n, *a) for n, r in enumerate(rows, 1) for a in r.attempts]
    att = [list(col) for col in zip(*flat, strict=True)] if flat else [[] for _ in range(9)]
    return (len(rows), *cols, *att)


#: exception classes (by name, anywhere in the chain) of a database refusing a value, not of a store down:
#: SQLAlchemy's and the DBAPIs' ``DataError`` / ``IntegrityError``, asyncpg's (its client-side ``DataError``
#: too: a value its codec cannot encode)
_REFUSALS = frozenset({"DataError", "IntegrityError", "IntegrityConstraintViolationError"})


def _refused_value(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or its driver) refused a value of the batch: a row of it cannot be
    stored, while the store itself works (an integer past 64 bits, text a column cannot hold...)."""
    cur: BaseException | None = exc
    for _ in range(8):  # bounded: the cause chain
        if cur is None:
            return False
        if isinstance(cur, OverflowError | UnicodeError | sqlite3.DataError | sqlite3.IntegrityError):
            return True
        if any(c.__name__ in _REFUSALS for c in type(cur).__mro__):
            return True
        nxt = getattr(cur, "orig", None)
        cur = nxt if isinstance(nxt, BaseException) else (cur.__cause__ or cur.__context__)
    return False


def _insert(conn: Connection, rows: Sequence[EncodedRow]) -> None:
    try:
        _insert_raw(conn, rows)
    except Exception as exc:
        if _refused_value(exc):
            detail = type(getattr(exc, "orig", None) or exc).__name__
            raise StoreInvalidError(f"write request log: the database refused a value of the {len(rows)} "
                                    f"row(s) ({detail})") from exc
        raise


def _insert_raw(conn: Connection, rows: Sequence[EncodedRow]) -> None:
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(_PG_INSERT, _pg_args(rows))
        return
    raw: Any = conn.connection.dbapi_connection  # pysqlite's (the ledger writer's thread) or aiosqlite's
    cur = raw.cursor()
    try:
        cur.execute("SELECT coalesce(max(id), 0) FROM request_log")
        base = int(cur.fetchone()[0])
        at = _SQLITE_AT
        cur.executemany(_SQLITE_LOG, [(base + i, v[0], at(v[1]), *v[2:])
                                      for i, v in enumerate((r.values for r in rows), 1)])
        attempts = [(base + i, *a) for i, r in enumerate(rows, 1) for a in r.attempts]
        if attempts:
            cur.executemany(_SQLITE_ATTEMPTS, attempts)
    finally:
        cur.close()


async def insert_requests(
    store: EngineBase, rows: Sequence[Mapping[str, Any] | EncodedRow], write: Write | None = None
) -> None:
    """Insert a batch of rows (one transaction; through ``write`` when given) and their attempts. Rows may
    come encoded already (:func:`encode_row`: the log writer does it per row, so one bad row is its own).
    Raises :class:`~ethen.store.StoreInvalidError` when the database refused a value of a row (nothing of
    the batch is written: the caller may retry its halves), another ``StoreError`` when the store failed."""
    if not rows:
        return
    encoded = [r if isinstance(r, EncodedRow) else encode_row(r) for r in rows]
    if write is not None:
        await write(lambda conn: _insert(conn, encoded), "write request log")
        return
    with boundary("write request log"):
        async with store.writer.begin() as conn:
            await conn.run_sync(_insert, encoded)


def _prune(conn: Connection, before: datetime, max_rows: int | None) -> int:
    c, a = request_log.c, request_attempts.c
    conn.execute(delete(request_attempts).where(a.log_id.in_(select(c.id).where(c.at < before))))
    n = conn.execute(delete(request_log).where(c.at < before)).rowcount or 0
    if max_rows is not None:
        cut = conn.scalar(select(c.id).order_by(c.id.desc()).offset(max_rows).limit(1))
        if cut is not None:
            conn.execute(delete(request_attempts).where(a.log_id <= cut))
            n += conn.execute(delete(request_log).where(c.id <= cut)).rowcount or 0
    return int(n)


async def prune_requests(
    store: EngineBase, *, before: datetime, max_rows: int | None = None, write: Write | None = None
) -> int:
    """Delete rows older than ``before`` and all but the newest ``max_rows``; return how many went."""
    cutoff = aware(before, "before")
    if write is not None:
        return int(await write(lambda conn: _prune(conn, cutoff, max_rows), "prune request log"))
    with boundary("prune request log"):
        async with store.writer.begin() as conn:
            return await conn.run_sync(_prune, cutoff, max_rows)
