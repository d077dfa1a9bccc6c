"""The request log's writer and its raw inserts (issues 11 and 14), on SQLite and Postgres (skips without
ETHEN_TEST_PG_URL): each row is encoded once by the writer, so a row whose JSON cannot be written is
dropped alone (before, the whole batch of up to 500 rows failed with it), and the rows and their attempts
land through either transaction runner: the ledger writer's (``GroupCommit.transaction``: SQLite's
dedicated thread and pysqlite connection) or the store's own (aiosqlite / asyncpg)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy import func, select

from ethen.gateway.config import LogConfig
from ethen.gateway.observation.metrics import GatewayMetrics
from ethen.gateway.observation.requestlog import RequestLog, RequestRecord
from ethen.store import Store
from ethen.store.groupcommit import GroupCommit
from ethen.store.requests import RequestQuery, list_requests, request_attempts
from tests.gateway.budget_harness import db_url  # noqa: F401 (fixture)


def _record(rid: str, receipt: Any = None) -> RequestRecord:
    attempts = [{"candidate": "alpha/a-1", "outcome": "error", "latency_ms": 3.5, "upstream_status": 500},
                {"candidate": "beta/b-1", "outcome": "ok", "latency_ms": 12.25}]
    return RequestRecord(time.time(), rid, "chat", False, 200, "ok", 0.02, project="acme",
                         requested_model="ethen/auto", attempts=attempts, receipt=receipt)


@pytest.mark.parametrize("through", ["ledger writer", "store"])
def test_a_row_json_cannot_hold_is_dropped_alone(db_url: str, through: str) -> None:  # noqa: F811
    async def main() -> tuple[list[dict[str, Any]], int, float, float]:
        st = await Store.open(db_url)
        gc = GroupCommit(st, "test-instance", lambda b: None, lambda b: None)
        gc.start()
        try:
            m = GatewayMetrics()
            rl = RequestLog(LogConfig(), m)
            rl.store = lambda: st
            if through == "ledger writer":
                rl.write = lambda: gc.transaction
            rl.record(_record("good-1", {"selected_provider": "beta", "note": "é"}))
            rl.record(_record("bad", {"not json": object()}))
            rl.record(_record("good-2"))
            await rl.flush()
            rows = await list_requests(st, RequestQuery(limit=10), receipt=True)
            async with st.engine.connect() as conn:
                n = int(await conn.scalar(select(func.count()).select_from(request_attempts)) or 0)
            return rows, n, m.log_write_errors._value.get(), rl.written
        finally:
            await gc.aclose()
            await st.aclose()

    rows, attempts, errors, written = asyncio.run(main())
    assert [r["request_id"] for r in rows] == ["good-2", "good-1"]
    assert rows[1]["receipt"] == {"selected_provider": "beta", "note": "é"} and rows[0]["receipt"] is None
    assert rows[0]["attempts"] == [
        {"candidate": "alpha/a-1", "outcome": "error", "latency_ms": 3.5, "upstream_status": 500,
         "provider": "alpha", "model": "a-1", "status": 500},
        {"candidate": "beta/b-1", "outcome": "ok", "latency_ms": 12.25, "provider": "beta", "model": "b-1",
         "status": 200}]
    assert attempts == 4 and errors == 0 and written == 3


def test_rows_trickling_in_share_an_insert_while_metrics_stay_prompt(tmp_path: Any) -> None:
    """Eight requests 40 ms apart (the writer handles records every 50 ms): every one is counted in the
    metrics as it is handled, but the rows go to the store in at most a few transactions (the oldest pending
    row waits up to 250 ms), not one per request (a 50 ms linger before: 7-8 inserts)."""

    async def main() -> tuple[list[int], int, list[str]]:
        st = await Store.open(f"sqlite:///{tmp_path / 'log.db'}")
        try:
            m = GatewayMetrics()
            rl = RequestLog(LogConfig(), m)
            rl.store = lambda: st
            inserts: list[int] = []

            async def write(fn: Any, what: str) -> Any:
                async with st.writer.begin() as conn:
                    out = await conn.run_sync(fn)
                if what == "write request log":  # (the start-up prune runs here too)
                    inserts.append(int(await _count(st)))
                return out

            rl.write = lambda: write
            rl.start()
            counted = []
            for i in range(8):  # bounded: eight records
                rl.record(_record(f"t-{i}"))
                await asyncio.sleep(0.04)
                counted.append(rl.written)
            await rl.aclose()
            rows = await list_requests(st, RequestQuery(limit=20))
            return inserts, counted[-1], [r["request_id"] for r in rows]
        finally:
            await st.aclose()

    inserts, handled, ids = asyncio.run(main())
    assert ids == [f"t-{i}" for i in reversed(range(8))]
    assert handled >= 6  # handled (metrics counted) while the requests still came in
    assert 1 <= len(inserts) <= 4 and inserts[-1] == 8, inserts


async def _count(st: Store) -> int:
    async with st.engine.connect() as conn:
        from ethen.store.requests import request_log

        return int(await conn.scalar(select(func.count()).select_from(request_log)) or 0)
