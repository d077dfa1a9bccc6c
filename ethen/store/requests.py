"""The request log's table and queries (issue 14): one row per finished gateway request.

Rows are written in batches by the gateway's log writer (:mod:`ethen.gateway.requestlog`), off the request
path; this module only knows the table. A row (:data:`COLUMNS`) holds the request's outcome: when it arrived,
its request id, project, key id (never the key), endpoint, requested model, the selected and primary
candidate, the attempts, whether a fallback served it, the canary hit, tokens, cost (nano-USD), TTFT, total
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
"""

from __future__ import annotations

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
)

from ._common import EngineBase, utc
from .engine import boundary
from .values import aware

__all__ = [
    "COLUMNS",
    "OUTCOMES",
    "RequestQuery",
    "Write",
    "count_requests",
    "create_request_log",
    "get_request",
    "insert_requests",
    "list_requests",
    "parse_status",
    "prune_requests",
    "public_row",
    "request_log",
    "row_matches",
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


def create_request_log(conn: Connection) -> None:
    """The migration that creates the table (``ethen.store.migrations``)."""
    _metadata.create_all(conn, tables=[request_log])


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


def _insert(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    conn.execute(request_log.insert(), [dict(r) for r in rows])


async def insert_requests(
    store: EngineBase, rows: Sequence[Mapping[str, Any]], write: Write | None = None
) -> None:
    """Insert a batch of rows (one transaction; through ``write`` when given)."""
    if not rows:
        return
    if write is not None:
        await write(lambda conn: _insert(conn, rows), "write request log")
        return
    with boundary("write request log"):
        async with store.writer.begin() as conn:
            await conn.run_sync(_insert, rows)


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
    c = request_log.c
    n = conn.execute(delete(request_log).where(c.at < before)).rowcount or 0
    if max_rows is not None:
        cut = conn.scalar(select(c.id).order_by(c.id.desc()).offset(max_rows).limit(1))
        if cut is not None:
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
