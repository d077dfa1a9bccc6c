"""The request log's attempts table and its raw inserts (issues 14 and 11), on SQLite and Postgres (the
Postgres variants skip without ETHEN_TEST_PG_URL): every logged attempt is one ``request_attempts`` row
written with its log row, pruned with it, backfilled by migration ``0007`` on an upgraded database; the
Candidates page's statistics equal a brute-force computation from the log rows; the raw inserts store
exactly what SQLAlchemy's JSON columns stored."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from sqlalchemy import select, text

from ethen.admin.observe_data import bucket_attempts
from ethen.store import Store
from ethen.store.engine import make_engine
from ethen.store.migrations import MIGRATIONS, applied
from ethen.store.requests import (
    RequestQuery,
    encode_row,
    insert_requests,
    list_requests,
    prune_requests,
    request_attempts,
    request_log,
)
from ethen.store.requeststats import attempts_between
from ethen.store.schema import migrations as migrations_table

T = TypeVar("T")
CANDS = ["alpha/a-large", "beta/b-small", "beta/b-tools", "gamma/g-1"]


def _run(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        st = await Store.open(url)
        try:
            return await fn(st)
        finally:
            await st.aclose()

    return asyncio.run(main())


def _attempt(rnd: random.Random, cand: str, ok: bool) -> dict[str, Any]:
    provider, _, model = cand.partition("/")
    a: dict[str, Any] = {"candidate": cand, "provider": provider, "model": model,
                         "outcome": "ok" if ok else "error", "status": 200 if ok else rnd.choice([500, None])}
    if ok or rnd.random() < 0.7:  # an attempt that failed before it was timed has no latency
        a["latency_ms"] = rnd.choice([round(rnd.uniform(1, 900), 3), rnd.uniform(1, 900), 7])
    return a


def _rows(n: int, now: datetime, spread_s: float, seed: int, prefix: str = "r") -> list[dict[str, Any]]:
    """Log rows as the writer builds them: 0-3 attempts (some failed, some untimed), receipts or none."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.choice([0, 1, 1, 1, 2, 3])
        attempts = [_attempt(rnd, rnd.choice(CANDS), j == k - 1 and rnd.random() < 0.9) for j in range(k)]
        receipt = None if k == 0 else {"chain": CANDS, "attempts": attempts, "note": "é ✓", "x": [1.5, None]}
        out.append({
            "request_id": f"{prefix}-{i}", "at": now - timedelta(seconds=spread_s * rnd.random()),
            "endpoint": "chat", "stream": i % 2 == 0, "project": rnd.choice(["acme", None]),
            "key_id": None, "requested_model": "ethen/auto", "selected_provider": None,
            "selected_model": None, "primary_provider": None, "primary_model": None,
            "fallback_used": k > 1, "canary_hit": rnd.choice([None, True, False]),
            "prompt_tokens": rnd.choice([None, 12]), "completion_tokens": 3, "cost_nano": 1234,
            "ttft_ms": None, "latency_ms": 10.5, "overhead_ms": 0.25, "status": 200, "outcome": "ok",
            "error_code": None, "attempts": attempts, "receipt": receipt,
        })
    out.sort(key=lambda r: r["at"])  # the writer inserts in arrival order
    return out


async def _attempt_rows(st: Store) -> list[tuple[Any, ...]]:
    async with st.engine.connect() as conn:
        a = request_attempts.c
        return [tuple(r) for r in await conn.execute(select(request_attempts).order_by(a.log_id, a.seq))]


def _expected(logged: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The attempts table a list of stored rows (admin API shape, with ``id``) implies: one row per attempt
    object with a candidate id, at its index in the row's list; a latency that is not a number is none."""
    out = []
    for r in sorted(logged, key=lambda r: r["id"]):
        at_s = datetime.fromisoformat(r["at"]).timestamp()
        for seq, a in enumerate(r["attempts"]):
            if not isinstance(a, dict) or not a.get("candidate"):
                continue
            lat = a.get("latency_ms")
            lat = lat if isinstance(lat, int | float) and not isinstance(lat, bool) else None
            provider = a.get("provider") or a["candidate"].partition("/")[0]  # the page's rule
            out.append((r["id"], seq, at_s, a["candidate"], provider, a.get("model", ""), a["outcome"],
                        a.get("status"), lat))
    return out


def _close(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:2] + g[3:] == w[:2] + w[3:]
        assert g[2] == pytest.approx(w[2], abs=2e-6)  # epoch seconds (a backfill computes them in SQL)


def test_every_attempt_is_a_row_written_with_its_log_row(store_url: str) -> None:
    now = datetime.now(UTC)
    rows = _rows(60, now, 600, seed=1)
    # a candidate-less attempt and a non-object stay in the row's JSON only; a latency that is not a number
    # (``true``) is stored as none
    rows[0]["attempts"] = [{"outcome": "error"}, "junk", {
        "candidate": "alpha/a-large", "provider": "alpha", "model": "a-large", "outcome": "ok", "status": 200,
        "latency_ms": True}, {"candidate": "delta/d-1", "outcome": "error", "latency_ms": 4.5}]

    async def go(st: Store) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
        await insert_requests(st, rows[:30])  # plain rows
        await insert_requests(st, [encode_row(r) for r in rows[30:]])  # encoded by the writer
        logged = await list_requests(st, RequestQuery(limit=1000), receipt=True)
        return logged, await _attempt_rows(st)

    logged, got = _run(store_url, go)
    assert [r["request_id"] for r in reversed(logged)] == [r["request_id"] for r in rows]
    assert [r["attempts"] for r in reversed(logged)] == [r["attempts"] for r in rows]
    want = _expected(logged)
    assert len(want) == sum(len(r["attempts"]) for r in rows) - 2 and (logged[-1]["id"], 2) == want[0][:2]
    assert want[0][8] is None and want[1][3:6] == ("delta/d-1", "delta", "")  # no provider: the prefix
    _close(got, want)


def test_the_raw_inserts_store_what_sqlalchemy_stored(store_url: str) -> None:
    """Row for row, column for column (the JSON columns as their stored text), the raw inserts hold what
    ``conn.execute(request_log.insert(), rows)`` held (the insert before), so every read returns the same."""
    rows = _rows(40, datetime.now(UTC), 600, seed=2)

    async def go(st: Store) -> tuple[list[Any], list[Any]]:
        await insert_requests(st, rows)
        async with st.writer.begin() as conn:
            before = [{**r, "request_id": "old-" + r["request_id"]} for r in rows]
            await conn.execute(request_log.insert(), before)
        cols = [c for c in request_log.columns if c.name not in ("id", "request_id")]
        exprs = [text(f"CAST({c.name} AS TEXT)") if c.name in ("attempts", "receipt") else c for c in cols]
        async with st.engine.connect() as conn:
            new = (await conn.execute(select(*exprs).where(request_log.c.request_id.like("r-%"))
                                      .order_by(request_log.c.id))).all()
            old = (await conn.execute(select(*exprs).where(request_log.c.request_id.like("old-%"))
                                      .order_by(request_log.c.id))).all()
        return [tuple(r) for r in new], [tuple(r) for r in old]

    new, old = _run(store_url, go)
    assert len(new) == 40 and new == old
    assert json.loads(new[0][-2]) == rows[0]["attempts"]
    assert any(r[-1] == "null" for r in new)  # a receipt of None is JSON null, as SQLAlchemy stored it


def test_pruning_deletes_the_attempts_of_the_rows_it_deletes(store_url: str) -> None:
    now = datetime.now(UTC)
    old = _rows(20, now - timedelta(days=40), 600, seed=3, prefix="old")
    recent = _rows(30, now, 600, seed=4, prefix="new")

    async def go(st: Store) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
        await insert_requests(st, old)
        await insert_requests(st, recent)
        assert await prune_requests(st, before=now - timedelta(days=30), max_rows=25) == 25
        return await list_requests(st, RequestQuery(limit=1000), receipt=False), await _attempt_rows(st)

    logged, got = _run(store_url, go)
    assert [r["request_id"] for r in reversed(logged)] == [r["request_id"] for r in recent[5:]]
    _close(got, _expected(logged))
    assert got and all(a[0] >= min(r["id"] for r in logged) for a in got)


def _brute_force(rows: list[dict[str, Any]], start: float, bucket_s: float, buckets: int
                 ) -> dict[str, dict[str, Any]]:
    """Per candidate, straight from the log rows: attempts and successes per bucket, nearest-rank p50/p95."""
    per: dict[str, list[tuple[int, bool, Any]]] = {}
    for r in rows:
        b = math.floor((r["at"].timestamp() - start) / bucket_s)
        if not 0 <= b < buckets:
            continue
        for a in r["attempts"]:
            lat = a.get("latency_ms")
            per.setdefault(a["candidate"], []).append((b, a["outcome"] == "ok", lat))
    out = {}
    for cand, xs in per.items():
        lat = sorted(x[2] for x in xs if x[2] is not None)
        out[cand] = {"attempts": len(xs), "successes": sum(x[1] for x in xs),
                     "p50_ms": lat[math.ceil(len(lat) * 0.5) - 1] if lat else None,
                     "p95_ms": lat[math.ceil(len(lat) * 0.95) - 1] if lat else None,
                     "per_bucket": [sum(1 for x in xs if x[0] == i) for i in range(buckets)]}
    return out


@pytest.mark.parametrize("cap", [10_000, 150])
def test_candidate_stats_equal_a_brute_force_computation(store_url: str, cap: int) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    rows = _rows(400, now, 3000, seed=5)
    since, until = now - timedelta(seconds=3000), now + timedelta(seconds=1)
    bucket_s, buckets = 3001 / 24, 24

    async def go(st: Store) -> tuple[list[Any], int, bool]:
        await insert_requests(st, rows[:200])
        await insert_requests(st, [encode_row(r) for r in rows[200:]])
        return await attempts_between(st, since, until, cap)

    got, n, truncated = _run(store_url, go)
    newest = sorted(rows, key=lambda r: r["at"])[-cap:]
    assert (n, truncated) == (min(400, cap), cap < 400)
    cands, provs = bucket_attempts(got, since.timestamp(), bucket_s, buckets)
    want = _brute_force(newest, since.timestamp(), bucket_s, buckets)
    assert set(cands) == set(want)
    for cand, w in want.items():
        c = cands[cand]
        assert (c["attempts"], c["successes"], c["p50_ms"], c["p95_ms"]) == (
            w["attempts"], w["successes"], w["p50_ms"], w["p95_ms"]), cand
        assert c["series"]["attempts"] == w["per_bucket"], cand
    assert sum(p["attempts"] for p in provs.values()) == sum(w["attempts"] for w in want.values())


def test_an_upgraded_database_backfills_the_attempts(store_url: str) -> None:
    """A database at ``0006`` holding rows the old way (SQLAlchemy's insert) gets every attempt in the
    table when ``0007`` runs at the next start; rows written after it are added by the writer."""
    rows = _rows(50, datetime.now(UTC), 600, seed=6)
    rows[1]["attempts"] = [{"outcome": "error", "latency_ms": 3}, *rows[1]["attempts"],
                           {"candidate": "", "outcome": "ok"}, {"candidate": "delta/d-1", "outcome": "ok"},
                           {"candidate": "solo", "provider": "", "outcome": "ok", "status": 200}]
    old = [name for name, _ in MIGRATIONS].index("0006_dashboard_sessions") + 1

    async def at_0006() -> None:
        engine = make_engine(store_url)
        try:
            async with engine.begin() as conn:
                def up(c: Any) -> None:
                    applied(c)
                    for name, fn in MIGRATIONS[:old]:
                        fn(c)
                        c.execute(migrations_table.insert().values(name=name, applied_at=datetime.now(UTC)))
                    c.execute(request_log.insert(), rows[:40])
                await conn.run_sync(up)
        finally:
            await engine.dispose()

    asyncio.run(at_0006())

    async def go(st: Store) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
        await insert_requests(st, rows[40:])
        return await list_requests(st, RequestQuery(limit=1000), receipt=False), await _attempt_rows(st)

    logged, got = _run(store_url, go)  # Store.open applies 0007 (and what follows)
    assert len(logged) == 50
    want = _expected(logged)
    assert len(want) == sum(len(r["attempts"]) for r in rows) - 2
    _close(got, want)
