"""Reads of the request log for the dashboard's provider and canary pages (issue 14).

Two narrow queries over :data:`ethen.store.requests.request_log`, both bounded by a time window (the ``at``
index) and, for the attempts, by a row cap (newest first):

- :func:`attempts_between`: every attempt (time, candidate, provider, outcome, latency) of the window's newest
  rows, which the gateway buckets into success rate and latency percentiles per candidate and per provider.
  Attempts are a JSON list per row: the database unnests them (``json_each`` on SQLite,
  ``json_array_elements`` on Postgres: one statement per dialect) and hands back plain numbers and strings,
  so Python decodes no JSON and builds no row objects (measured: decoding the lists in Python took ~4x the
  query). The percentiles are computed in Python from those tuples: SQLite has no percentile function, and a
  window-function rank (``row_number() OVER``) was ~5x slower than the unnesting itself.
- :func:`newest_costs`: the newest rows' time, project, served candidate and cost (five columns, never the
  attempts or the receipt) for the Spend tab's charts: one narrow query instead of four pages of full rows.
- :func:`canary_counts`: per canary target the receipts report (``receipt.canary.candidate``), the requests
  that evaluated it and how many were hits, counted in SQL (``GROUP BY``; a JSON path SQLAlchemy compiles for
  SQLite and Postgres alike) over the newest rows whose ``canary_hit`` is set.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Integer, bindparam, case, func, select, text

from ._common import EngineBase, utc
from .engine import boundary
from .requests import request_log
from .values import aware

__all__ = ["AttemptRow", "attempts_between", "canary_counts", "newest_costs"]


#: one row per attempt of the newest ``:cap`` rows in the window: (epoch s, candidate, provider, ok, latency)
_NEWEST = ("WITH r AS (SELECT at, attempts FROM request_log WHERE at >= :since AND at < :until "
           "ORDER BY at DESC LIMIT :cap)")
_ATTEMPTS = {
    "sqlite": _NEWEST + """
SELECT (julianday(r.at) - 2440587.5) * 86400.0, json_extract(j.value, '$.candidate'),
       json_extract(j.value, '$.provider'), json_extract(j.value, '$.outcome') = 'ok',
       json_extract(j.value, '$.latency_ms')
FROM r, json_each(r.attempts) AS j""",
    "postgresql": _NEWEST + """
SELECT extract(epoch FROM r.at)::float8, j.value ->> 'candidate', j.value ->> 'provider',
       (j.value ->> 'outcome') = 'ok', (j.value ->> 'latency_ms')::float8
FROM r, json_array_elements(r.attempts) AS j(value)""",
}

#: one attempt: (epoch s, candidate id, provider, succeeded, latency ms or None)
AttemptRow = tuple[float, str, str, bool, float | None]


async def attempts_between(
    store: EngineBase, since: datetime, until: datetime, limit: int
) -> tuple[list[AttemptRow], int, bool]:
    """Every attempt of the newest ``limit`` rows with ``since <= at < until`` (the JSON list unnested by the
    database: no row object, no JSON decoding in Python), how many rows that was, and whether the cap cut
    older rows off."""
    c = request_log.c
    lo, hi = aware(since, "since"), aware(until, "until")
    window = select(c.id).where(c.at >= lo, c.at < hi).limit(limit + 1).subquery()
    at = bindparam("since", lo, type_=c.at.type), bindparam("until", hi, type_=c.at.type)
    with boundary("read request log"):
        async with store.engine.connect() as conn:
            stmt = text(_ATTEMPTS[conn.dialect.name]).bindparams(*at, cap=limit)
            rows = (await conn.execute(stmt)).all()
            n = int(await conn.scalar(select(func.count()).select_from(window)) or 0)
    out: list[AttemptRow] = [
        (float(t), str(cand), str(prov or cand.partition("/")[0]), bool(ok),
         float(lat) if lat is not None else None)
        for t, cand, prov, ok, lat in rows if cand
    ]
    return out, min(n, limit), n > limit


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
