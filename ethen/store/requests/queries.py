"""Reading the request log: listings with filters (:class:`RequestQuery`), one request by id, the count, and
a row as the admin API shows it.

Choices where the issue is silent:
- Order and pagination: newest first by the log's own id (insertion order; the writer inserts in arrival
  order, so it follows time within one gateway). The cursor is the last id of a page (keyset:
  ``id < cursor``), so paging is stable while new rows arrive.
- ``status`` filters on an HTTP status (``"402"``) or an outcome: ``ok``, ``error`` (any other outcome),
  ``stream_error`` (a stream that broke after its first chunk), ``client_closed``. ``model`` matches the
  requested model (an alias or a concrete id) or the served model.
- ``get`` by request id returns the newest row with that id (a client may reuse ``x-request-id``).
- :func:`row_matches` applies the same filters to a row in memory (the memory ring's query).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select

from ethen.store._common import EngineBase, utc
from ethen.store.engine import boundary
from ethen.store.values import aware

from .table import COLUMNS, request_log

__all__ = [
    "OUTCOMES",
    "RequestQuery",
    "count_requests",
    "get_request",
    "list_requests",
    "parse_status",
    "public_row",
    "row_matches",
]

OUTCOMES = ("ok", "error", "stream_error", "client_closed")


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


async def count_requests(store: EngineBase) -> int:
    """How many rows the log holds."""
    with boundary("count request log"):
        async with store.engine.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(request_log)) or 0)
