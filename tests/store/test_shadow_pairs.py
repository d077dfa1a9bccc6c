"""The ``shadow_pairs`` table (``ethen.store.shadows``, migration ``0009_shadow_pairs``) on SQLite and
PostgreSQL: a pair's every field round-trips, listings are newest first with filters and a keyset cursor,
inserts through the store's own writer or a caller's write function."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from ethen.store import Store
from ethen.store.shadows import PAIR_COLUMNS, ShadowQuery, insert_pair, list_pairs

T = TypeVar("T")


def run(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        st = await Store.open(url)
        try:
            return await fn(st)
        finally:
            await st.aclose()

    return asyncio.run(main())


def pair(i: int, candidate: str = "beta/b", alias: str = "ethen/fast", **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": f"req-{i}", "alias": alias, "primary_candidate": "alpha/a", "candidate": candidate,
        "at": datetime(2026, 12, 5, 6, 0, i, tzinfo=UTC), "stream": i % 2 == 1,
        "primary_latency_ms": 10.5, "primary_ttft_ms": 3.25, "candidate_latency_ms": 20.0 + i,
        "candidate_ttft_ms": 20.0 + i, "primary_prompt_tokens": 11, "primary_completion_tokens": 3,
        "candidate_prompt_tokens": 12, "candidate_completion_tokens": 4, "primary_cost_nano": 41_000,
        "candidate_cost_nano": 2**40, "primary_status": "ok", "candidate_status": "ok", "exact": True,
        "similarity": 0.75, "tool_calls_equal": None, "schema_valid": False, "primary_schema_valid": True,
    }
    row.update(kw)
    return row


def test_pairs_round_trip_newest_first_with_filters(store_url: str) -> None:
    async def fn(st: Store) -> None:
        ids = [await insert_pair(st, pair(i, "beta/b" if i < 3 else "gamma/c")) for i in range(5)]
        ids.append(await insert_pair(st, pair(9, alias="ethen/coding", candidate_status="upstream_timeout",
                                              exact=None, similarity=None, schema_valid=None)))
        assert ids == sorted(ids)
        rows = await list_pairs(st, ShadowQuery())
        assert [r["id"] for r in rows] == ids[::-1]
        first = next(r for r in rows if r["request_id"] == "req-1")
        want = pair(1)
        for k in PAIR_COLUMNS:
            assert first[k] == (want[k].isoformat() if k == "at" else want[k]), k
        b = await list_pairs(st, ShadowQuery(alias="ethen/fast", candidate="beta/b", limit=2))
        assert [r["request_id"] for r in b] == ["req-2", "req-1"]
        nxt = await list_pairs(st, ShadowQuery(alias="ethen/fast", candidate="beta/b", before_id=b[-1]["id"]))
        assert [r["request_id"] for r in nxt] == ["req-0"]
        failed = await list_pairs(st, ShadowQuery(alias="ethen/coding"))
        assert [(r["candidate_status"], r["exact"], r["similarity"]) for r in failed] == [
            ("upstream_timeout", None, None)]

    run(store_url, fn)


def test_insert_through_a_write_function(store_url: str) -> None:
    async def fn(st: Store) -> None:
        calls: list[str] = []

        async def write(tx: Any, what: str) -> Any:
            calls.append(what)
            async with st.writer.begin() as conn:
                return await conn.run_sync(tx)

        pid = await insert_pair(st, pair(1), write)
        assert calls == ["write shadow pair"] and pid > 0
        assert [r["id"] for r in await list_pairs(st, ShadowQuery())] == [pid]

    run(store_url, fn)
