"""Reads of the request log for the dashboard's provider and canary pages (issue 14).

Narrow queries over :data:`ethen.store.requests.request_log` and its attempts table, each bounded by a time
window (an index on the time) and by a row cap (newest first):

- :func:`attempts_between`: every attempt (time, candidate, provider, outcome, latency) of the window's newest
  rows, which the gateway buckets into success rate and latency percentiles per candidate and per provider.
  They are read from the attempts table the log writer fills in the same transaction as the rows
  (:data:`ethen.store.requests.request_attempts`: one row per attempt, ``at`` as epoch seconds, indexed):
  five plain columns, no JSON. Measured with 10k logged rows (``bench/dashboard_pages.py``): before, the
  database unnested each row's JSON list (``json_each`` / ``json_array_elements``) and the page's data took
  ~190 ms on a quiet VM (decoding the lists in Python ~2.5x that); see the README for the figures now. The
  percentiles are computed in Python from those tuples: SQLite has no percentile function, and a
  window-function rank (``row_number() OVER``) was ~5x slower than the JSON unnesting itself.
- :func:`newest_costs`: the newest rows' time, project, served candidate and cost (five columns, never the
  attempts or the receipt) for the Spend tab's charts: one narrow query instead of four pages of full rows.
- :func:`canary_counts`: per canary target the receipts report (``receipt.canary.candidate``), the requests
  that evaluated it and how many were hits, counted in SQL (``GROUP BY``; a JSON path SQLAlchemy compiles for
  SQLite and Postgres alike) over the newest rows whose ``canary_hit`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, case, func, select

from ._common import EngineBase, utc
from .engine import boundary
from .requests import request_log
from .values import aware

__all__ = ["AttemptRow", "attempts_between", "canary_counts", "newest_costs"]


#: one row per attempt in a window of ``at_s`` (the ``ix_request_attempts_at_s`` index): plain columns, read
#: on the driver's own connection (SQLAlchemy's row objects for 10k rows cost more than SQLite's read)
_ATTEMPTS = {
    "sqlite": "SELECT at_s, candidate, provider, outcome = 'ok', latency_ms FROM request_attempts "
              "WHERE at_s >= ? AND at_s < ? AND outcome <> 'client_error'",
    "postgresql": "SELECT at_s, candidate, provider, outcome = 'ok', latency_ms FROM request_attempts "
                  "WHERE at_s >= $1 AND at_s < $2 AND outcome <> 'client_error'",
}

#: one attempt: (epoch s, candidate id, provider, succeeded (1/0 or a bool), latency ms or None)
AttemptRow = tuple[float, str, str, int, float | None]


async def attempts_between(
    store: EngineBase, since: datetime, until: datetime, limit: int
) -> tuple[Sequence[AttemptRow], int, bool]:
    """Every attempt of the newest ``limit`` rows with ``since <= at < until`` (read from
    :data:`~ethen.store.requests.request_attempts`: narrow columns, no JSON, no row objects), how many rows
    that was, and whether the cap cut older rows off (then the attempts are those at or after the
    ``limit``-th newest row's time)."""
    c = request_log.c
    lo, hi = aware(since, "since"), aware(until, "until")
    window = select(c.id).where(c.at >= lo, c.at < hi).limit(limit + 1).subquery()
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            n = int(await conn.scalar(select(func.count()).select_from(window)) or 0)
            lo_s = lo.timestamp()
            if n > limit:  # the newest ``limit`` rows only: from the limit-th newest row's time on
                cut = await conn.scalar(select(c.at).where(c.at >= lo, c.at < hi).order_by(c.at.desc())
                                        .offset(limit - 1).limit(1))
                lo_s = max(lo_s, (utc(cut) or lo).timestamp())
            sql = _ATTEMPTS[conn.dialect.name]
            driver: Any = (await conn.get_raw_connection()).driver_connection
            if conn.dialect.name == "postgresql":  # asyncpg: records unpack like tuples
                rows = await driver.fetch(sql, lo_s, hi.timestamp())
            else:  # aiosqlite
                async with driver.execute(sql, (lo_s, hi.timestamp())) as cur:
                    rows = await cur.fetchall()
    return rows, min(n, limit), n > limit


async def canary_counts(
    store: EngineBase, since: datetime, until: datetime, limit: int
) -> dict[str, tuple[int, int]]:
    """Reported canary candidate -> (requests that evaluated it, hits) over the newest ``limit`` rows with
    ``since <= at < until`` that evaluated a canary."""
    c = request_log.c
    rows = (select(c.receipt[("canary", "candidate")].as_string().label("cand"), c.canary_hit)
            .where(c.at >= aware(since, "since"), c.at < aware(until, "until"), c.canary_hit.is_not(None))
            .order_by(c.at.desc()).limit(limit).subquery())
    hits = func.sum(case((rows.c.canary_hit.is_(True), 1), else_=0).cast(Integer))
    stmt = select(rows.c.cand, func.count(), hits).group_by(rows.c.cand)
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            found = (await conn.execute(stmt)).all()
    return {str(k): (int(n), int(h or 0)) for k, n, h in found if k is not None}


async def newest_costs(
    store: EngineBase, limit: int
) -> list[tuple[datetime, str | None, str | None, str | None, int | None]]:
    """``(at, project, selected provider, selected model, cost nano-USD)`` of the newest ``limit`` rows."""
    c = request_log.c
    stmt = (select(c.at, c.project, c.selected_provider, c.selected_model, c.cost_nano)
            .order_by(c.id.desc()).limit(limit))
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
    return [(utc(at) or at, project, provider, model, cost) for at, project, provider, model, cost in rows]
