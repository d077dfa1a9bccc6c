"""The request log's table and queries (issue 14): one row per finished gateway request.

Rows are written in batches by the gateway's log writer (:mod:`ethen.gateway.observation.requestlog`), off the
request
path; this module only knows the table. A row (:data:`COLUMNS`) holds the request's outcome: when it arrived,
its request id, project, key id (never the key), endpoint, requested model, the selected and primary
candidate, the attempts, whether a fallback served it, the canary hit, tokens (of the prompt's, those read
from and written to the provider's prompt cache: migration ``0010``), cost and what the cache reads saved
(nano-USD; shown as ``cost_usd`` / ``saved_usd``), TTFT, total
latency, the HTTP status, the outcome and error code, and the full ``ethen.routing`` receipt (JSON).

Choices where the issue is silent:
- Order and pagination: newest first by the log's own id (insertion order; the writer inserts in arrival
  order, so it follows time within one gateway). The cursor is the last id of a page (keyset:
  ``id < cursor``), so paging is stable while new rows arrive.
- ``status`` filters on an HTTP status (``"402"``) or an outcome: ``ok``, ``error`` (any other outcome),
  ``stream_error`` (a stream that broke after its first chunk), ``client_closed``. ``model`` matches the
  requested model (an alias or a concrete id) or the served model.
- ``get`` by request id returns the newest row with that id (a client may reuse ``x-request-id``).
- Retention: :func:`prune_requests` deletes rows older than a cut-off and all but the newest ``max_rows``.
- The ids are 64-bit on Postgres (``BIGSERIAL``): pruning never resets them.
- Attempts (issue 14, the dashboard's Candidates page): each row's attempts are also stored one per row in
  :data:`request_attempts` (log id, attempt index, ``at`` as epoch seconds, candidate, provider, model,
  outcome, status, latency), written in the same transaction as the log rows, so the page reads narrow
  columns instead of unnesting 10k JSON lists (``ethen.store.requeststats``). Migration
  ``0007_request_attempts`` backfills them from the rows already logged (in SQL: one statement). Attempts
  without a candidate id are not stored there (the page skipped them before, too). Pruning deletes a row's
  attempts with it.
- Inserts (issue 11: the log's writes cost the gateway's CPU): a batch is encoded once per row in the writer
  (:func:`encode_row`: the JSON columns serialized with ``json.dumps``, as SQLAlchemy's JSON type stored
  them, so reads return the same data) and written without SQLAlchemy's per-row work. SQLite: two
  ``executemany`` of SQL compiled once from the schema on the DBAPI connection of the transaction, the log
  ids assigned as ``max(id) + 1...`` (the write lock is held since ``BEGIN IMMEDIATE``: SQLite would pick
  the same ids). Postgres: one statement (``unnest`` of one array per column, ids taken from the table's
  sequence in order, both tables written by data-modifying CTEs).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    delete,
    func,
    or_,
    select,
    text,
)
from sqlalchemy.dialects import sqlite

from ._common import EngineBase, utc
from .engine import boundary
from .errors import StoreInvalidError
from .values import aware

__all__ = [
    "ATTEMPT_COLUMNS",
    "COLUMNS",
    "OUTCOMES",
    "EncodedRow",
    "RequestQuery",
    "Write",
    "count_requests",
    "create_request_attempts",
    "create_request_log",
    "encode_row",
    "get_request",
    "insert_requests",
    "list_requests",
    "parse_status",
    "prune_requests",
    "public_row",
    "request_attempts",
    "request_log",
    "row_matches",
    "storable",
]

OUTCOMES = ("ok", "error", "stream_error", "client_closed")

_metadata = MetaData()
_ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only

request_log = Table(
    "request_log",
    _metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("endpoint", String(20), nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("project", String(100), nullable=True),
    Column("key_id", String(120), nullable=True),
    Column("requested_model", String(200), nullable=True),
    Column("selected_provider", String(100), nullable=True),
    Column("selected_model", String(200), nullable=True),
    Column("primary_provider", String(100), nullable=True),
    Column("primary_model", String(200), nullable=True),
    Column("fallback_used", Boolean, nullable=False),
    Column("canary_hit", Boolean, nullable=True),
    Column("prompt_tokens", BigInteger, nullable=True),
    Column("completion_tokens", BigInteger, nullable=True),
    Column("cost_nano", BigInteger, nullable=True),
    # 0010 (issue 45): of prompt_tokens, read from / written to the provider's prompt cache, and what the
    # reads saved (nano-USD; ``ethen.gateway.accounting.pricing``); NULL on rows logged before
    Column("cache_read_tokens", BigInteger, nullable=True),
    Column("cache_write_tokens", BigInteger, nullable=True),
    Column("saved_nano", BigInteger, nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("latency_ms", Float, nullable=False),
    Column("overhead_ms", Float, nullable=True),
    Column("status", Integer, nullable=False),
    Column("outcome", String(20), nullable=False),
    Column("error_code", String(100), nullable=True),
    Column("attempts", JSON, nullable=False),
    Column("receipt", JSON, nullable=True),
    Index("ix_request_log_request_id", "request_id"),
    Index("ix_request_log_at", "at"),
    Index("ix_request_log_project", "project", "id"),
)

#: the columns of a row, as inserted (``id`` is assigned by the database)
COLUMNS = tuple(c.name for c in request_log.columns if c.name != "id")
assert COLUMNS[1] == "at" and COLUMNS[-2:] == ("attempts", "receipt"), COLUMNS  # encode_row's layout

#: One row per attempt of a logged request (``log_id``: its ``request_log.id``; ``seq``: its index in the
#: row's attempts; ``at_s``: the row's ``at`` as epoch seconds, a plain float the page buckets directly).
request_attempts = Table(
    "request_attempts",
    _metadata,
    Column("log_id", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("at_s", Float, nullable=False),
    Column("candidate", String, nullable=False),
    Column("provider", String, nullable=False),
    Column("model", String, nullable=False),
    Column("outcome", String, nullable=False),
    Column("status", Integer, nullable=True),
    Column("latency_ms", Float, nullable=True),
    Index("ix_request_attempts_at_s", "at_s"),
)

#: the columns of an attempt row, in the order of :attr:`EncodedRow.attempts` (after ``log_id``)
ATTEMPT_COLUMNS = tuple(c.name for c in request_attempts.columns)


def create_request_log(conn: Connection) -> None:
    """The migration that creates the table (``ethen.store.migrations``)."""
    _metadata.create_all(conn, tables=[request_log])


#: the backfill of ``0007``: every attempt with a candidate id of the rows already logged (the same
#: extraction the Candidates page made with ``json_each`` / ``json_array_elements`` before the table)
_BACKFILL = {
    "sqlite": """
INSERT INTO request_attempts (log_id, seq, at_s, candidate, provider, model, outcome, status, latency_ms)
SELECT r.id, j.key, CAST(strftime('%s', r.at) AS INTEGER) + CAST(substr(r.at, 20) AS REAL),
       json_extract(j.value, '$.candidate'),
       coalesce(nullif(json_extract(j.value, '$.provider'), ''),
                CASE WHEN instr(json_extract(j.value, '$.candidate'), '/') > 0
                     THEN substr(json_extract(j.value, '$.candidate'), 1,
                                 instr(json_extract(j.value, '$.candidate'), '/') - 1)
                     ELSE json_extract(j.value, '$.candidate') END),
       coalesce(json_extract(j.value, '$.model'), ''),
       coalesce(json_extract(j.value, '$.outcome'), ''),
       CASE WHEN json_type(j.value, '$.status') = 'integer' THEN json_extract(j.value, '$.status') END,
       CASE WHEN json_type(j.value, '$.latency_ms') IN ('integer', 'real')
            THEN json_extract(j.value, '$.latency_ms') END
FROM request_log AS r, json_each(r.attempts) AS j
WHERE j.type = 'object' AND json_type(j.value, '$.candidate') = 'text'
  AND json_extract(j.value, '$.candidate') != ''""",
    "postgresql": """
INSERT INTO request_attempts (log_id, seq, at_s, candidate, provider, model, outcome, status, latency_ms)
SELECT r.id, j.n - 1, extract(epoch FROM r.at)::float8, j.value ->> 'candidate',
       coalesce(nullif(j.value ->> 'provider', ''), split_part(j.value ->> 'candidate', '/', 1)),
       coalesce(j.value ->> 'model', ''),
       coalesce(j.value ->> 'outcome', ''),
       CASE WHEN json_typeof(j.value -> 'status') = 'number'
            AND (j.value ->> 'status') ~ '^-?[0-9]{1,9}$' THEN (j.value ->> 'status')::int END,
       CASE WHEN json_typeof(j.value -> 'latency_ms') = 'number' THEN (j.value ->> 'latency_ms')::float8 END
FROM request_log AS r,
     json_array_elements(CASE WHEN json_typeof(r.attempts) = 'array' THEN r.attempts ELSE '[]' END)
       WITH ORDINALITY AS j(value, n)
WHERE json_typeof(j.value) = 'object' AND json_typeof(j.value -> 'candidate') = 'string'
  AND j.value ->> 'candidate' != ''""",
}


def create_request_attempts(conn: Connection) -> None:
    """Migration ``0007_request_attempts``: the attempts table, backfilled from the rows already logged."""
    _metadata.create_all(conn, tables=[request_attempts])
    conn.execute(text(_BACKFILL[conn.dialect.name]))


@dataclass(frozen=True, slots=True)
class RequestQuery:
    """Filters of a listing. ``status``: an HTTP status or an outcome (see :func:`parse_status`);
    ``before_id``: the cursor (rows with a smaller id)."""

    project: str | None = None
    model: str | None = None
    status: int | str | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 50
    before_id: int | None = None
    after_id: int | None = None  # rows with a larger id (``ethen logs --follow``)


def parse_status(value: str) -> int | str:
    """``"402"`` -> 402; an outcome name stays a string; anything else raises ``ValueError``."""
    if value.isdigit() and 100 <= int(value) <= 599:
        return int(value)
    if value in OUTCOMES:
        return value
    raise ValueError(f"status = {value!r}: an HTTP status (100-599) or one of {', '.join(OUTCOMES)}")


def _public(m: Mapping[str, Any], receipt: bool) -> dict[str, Any]:
    out = {k: m[k] for k in ("id", *COLUMNS) if k != "receipt" or receipt}
    at = utc(out["at"])
    out["at"] = at.isoformat() if at is not None else None
    nano = out.pop("cost_nano")
    out["cost_usd"] = nano / 1e9 if nano is not None else None
    saved = out.pop("saved_nano")
    out["saved_usd"] = saved / 1e9 if saved is not None else None
    return out


def row_matches(row: Mapping[str, Any], q: RequestQuery) -> bool:
    """Whether a row (as inserted: ``at`` a datetime) passes ``q``'s filters (the in-memory ring's query;
    the same rules as :func:`list_requests`)."""
    if q.before_id is not None and row["id"] >= q.before_id:
        return False
    if q.after_id is not None and row["id"] <= q.after_id:
        return False
    if q.project is not None and row["project"] != q.project:
        return False
    if q.model is not None and q.model not in (row["requested_model"], row["selected_model"]):
        return False
    if isinstance(q.status, int) and row["status"] != q.status:
        return False
    if q.status == "error" and row["outcome"] == "ok":
        return False
    if isinstance(q.status, str) and q.status != "error" and row["outcome"] != q.status:
        return False
    if q.since is not None and row["at"] < aware(q.since, "since"):
        return False
    return not (q.until is not None and row["at"] >= aware(q.until, "until"))


def public_row(row: Mapping[str, Any], *, receipt: bool = True) -> dict[str, Any]:
    """A stored row as the admin API shows it (``at`` ISO-8601, ``cost_usd``)."""
    return _public(row, receipt)


#: Runs a function of a connection in one write transaction and returns its result: the gateway passes its
#: ledger writer's (``ethen.store.admission.Admission.write``), so on SQLite the log's inserts share the one
#: writer connection with settlements instead of contending for the write lock (a contended ``BEGIN
#: IMMEDIATE`` sleeps in SQLite's busy handler: measured, it raised the store-backed gateway's p50).
Write = Callable[[Callable[[Connection], Any], str], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class EncodedRow:
    """A row ready for the database: ``values`` in :data:`COLUMNS` order with the JSON columns as text,
    ``attempts`` one tuple per stored attempt in :data:`ATTEMPT_COLUMNS` order without ``log_id``."""

    values: tuple[Any, ...]
    attempts: tuple[tuple[Any, ...], ...]


#: ``json.dumps``'s text (what SQLAlchemy's JSON type stored: the engines configure no ``json_serializer``),
#: without its cycle check (a row holds no cycles; one would fail the row with a RecursionError)
_dumps = json.JSONEncoder(check_circular=False).encode
_PLAIN = COLUMNS[:-2]
#: the columns a row may leave out (NULL): the ones added after the table (``0010``)
_OPTIONAL = frozenset({"cache_read_tokens", "cache_write_tokens", "saved_nano"})


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


#: the characters no text column holds: NUL (Postgres ``text``; ``\u0000`` in its JSON) and the surrogates
#: (a lone one, e.g. ``"\ud800"`` in a JSON body, is not UTF-8: neither SQLite's driver nor asyncpg takes it)
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_REPLACEMENT = "\ufffd"
#: (index, longest text) of each plain text column (``VARCHAR(n)``: Postgres refuses a longer text)
_TEXTS = tuple((i, int(t.length or 2**31)) for i, t in enumerate(request_log.c[c].type for c in _PLAIN)
               if isinstance(t, String))


def storable(s: str) -> str:
    """``s`` with every character a text column cannot hold (NUL, a surrogate) replaced by U+FFFD."""
    if "\x00" in s or not s.isascii():
        return _UNSTORABLE.sub(_REPLACEMENT, s)
    return s


def _storable_json(v: Any) -> Any:
    """``v`` (a JSON value) with :func:`storable` strings, keys included."""
    if isinstance(v, str):
        return storable(v)
    if isinstance(v, Mapping):
        return {storable(k) if isinstance(k, str) else k: _storable_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_storable_json(x) for x in v]
    return v


def _json_text(v: Any) -> str:
    """``v``'s JSON text (ASCII: ``json.dumps`` escapes the rest), re-encoded from a :func:`storable` copy
    when it holds ``\\u0000`` or a ``\\ud800``-``\\udfff`` escape (a surrogate: a lone one, or a pair of an
    astral character, which the copy keeps as it is)."""
    t = _dumps(v)
    if "\\u0000" in t or "\\ud" in t:
        t = _dumps(_storable_json(v))
    return t


def _plain(row: Mapping[str, Any]) -> list[Any]:
    """The plain columns' values: text made :func:`storable` and cut to its column's length."""
    out = [row[c] if c not in _OPTIONAL else row.get(c) for c in _PLAIN]
    for i, n in _TEXTS:
        v = out[i]
        if isinstance(v, str):
            out[i] = storable(v if len(v) <= n else v[:n])
    return out


def encode_row(row: Mapping[str, Any]) -> EncodedRow:
    """A row (as :func:`ethen.gateway.observation.requestlog.to_row` builds it) encoded for
    :func:`insert_requests`:
    done once per row, in the writer (raises ``TypeError`` / ``ValueError`` for a value JSON cannot hold).
    Text a column cannot hold (:func:`storable`) is stored with U+FFFD in its place, and a plain column's text
    cut to the column's length, so one client's odd input (``"model": "m\\u0000"``) never fails the batch."""
    attempts = row["attempts"]
    values = (*_plain(row), _json_text(attempts), _json_text(row["receipt"]))
    at = utc(row["at"])
    at_s = at.timestamp() if at is not None else 0.0
    out = []
    for seq, a in enumerate(attempts):
        if not isinstance(a, Mapping):
            continue
        cand = a.get("candidate")
        if not isinstance(cand, str) or not cand:
            continue
        status = a.get("status")
        provider = str(a.get("provider") or cand.partition("/")[0])  # as the page read it before
        out.append((seq, at_s, storable(cand), storable(provider), storable(str(a.get("model") or "")),
                    storable(str(a.get("outcome") or "")),
                    status if isinstance(status, int) and not isinstance(status, bool)
                    and abs(status) < 2**31 else None,
                    _number(a.get("latency_ms"))))
    return EncodedRow(values, tuple(out))


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


async def list_requests(store: EngineBase, q: RequestQuery, *, receipt: bool = False) -> list[dict[str, Any]]:
    """Rows passing ``q``, newest first, at most ``q.limit`` (with ``receipt``: each row's receipt too)."""
    c = request_log.c
    conds: list[Any] = []
    if q.before_id is not None:
        conds.append(c.id < q.before_id)
    if q.after_id is not None:
        conds.append(c.id > q.after_id)
    if q.project is not None:
        conds.append(c.project == q.project)
    if q.model is not None:
        conds.append(or_(c.requested_model == q.model, c.selected_model == q.model))
    if isinstance(q.status, int):
        conds.append(c.status == q.status)
    elif q.status == "error":
        conds.append(c.outcome != "ok")
    elif q.status is not None:
        conds.append(c.outcome == q.status)
    if q.since is not None:
        conds.append(c.at >= aware(q.since, "since"))
    if q.until is not None:
        conds.append(c.at < aware(q.until, "until"))
    cols = [col for col in request_log.columns if receipt or col.name != "receipt"]
    stmt = select(*cols).where(and_(True, *conds)).order_by(c.id.desc()).limit(q.limit)
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            return [_public(dict(r._mapping), receipt) for r in await conn.execute(stmt)]


async def get_request(store: EngineBase, request_id: str) -> dict[str, Any] | None:
    """The newest row of ``request_id`` with its receipt, else ``None``."""
    c = request_log.c
    stmt = select(request_log).where(c.request_id == request_id).order_by(c.id.desc()).limit(1)
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            r = (await conn.execute(stmt)).first()
    return _public(dict(r._mapping), True) if r is not None else None


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


async def count_requests(store: EngineBase) -> int:
    """How many rows the log holds."""
    with boundary("count request log"):
        async with store.engine.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(request_log)) or 0)
