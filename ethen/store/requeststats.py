"""Reads of the request log for the dashboard's provider and canary pages (issue 14).

Two narrow queries over :data:`ethen.store.requests.request_log`, both bounded by a time window (the ``at``
index) and, for the attempts, by a row cap (newest first):

- :func:`attempts_between`: each row's time and attempts (provider, model, outcome, latency), which the
  gateway buckets into success rate and latency percentiles per candidate and per provider. Attempts are a
  JSON list per row, so they are read (two columns only, never the receipt) and bucketed in Python:
  SQLite has no percentile function and the JSON unnesting differs per backend.
- :func:`canary_counts`: per canary target the receipts report (``receipt.canary.candidate``), the requests
  that evaluated it and how many were hits, counted in SQL (``GROUP BY``; a JSON path SQLAlchemy compiles for
  SQLite and Postgres alike) over the rows whose ``canary_hit`` is set.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Integer, case, func, select

from ._common import EngineBase, utc
from .engine import boundary
from .requests import request_log
from .values import aware

__all__ = ["attempts_between", "canary_counts"]


async def attempts_between(
    store: EngineBase, since: datetime, until: datetime, limit: int
) -> tuple[list[tuple[datetime, list[dict[str, Any]]]], bool]:
    """``(at, attempts)`` of the newest ``limit`` rows with ``since <= at < until``, and whether the cap cut
    older rows off."""
    c = request_log.c
    lo, hi = aware(since, "since"), aware(until, "until")
    stmt = (select(c.at, c.attempts).where(c.at >= lo, c.at < hi)
            .order_by(c.at.desc()).limit(limit + 1))
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
    out = [(utc(at) or lo, list(attempts or ())) for at, attempts in rows[:limit]]
    return out, len(rows) > limit


async def canary_counts(store: EngineBase, since: datetime, until: datetime) -> dict[str, tuple[int, int]]:
    """Reported canary candidate -> (requests that evaluated it, hits) over ``since <= at < until``."""
    c = request_log.c
    cand = c.receipt[("canary", "candidate")].as_string()
    hits = func.sum(case((c.canary_hit.is_(True), 1), else_=0).cast(Integer))
    stmt = (select(cand, func.count(), hits)
            .where(c.at >= aware(since, "since"), c.at < aware(until, "until"), c.canary_hit.is_not(None))
            .group_by(cand))
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
    return {str(k): (int(n), int(h or 0)) for k, n, h in rows if k is not None}
