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
from budget_harness import db_url  # noqa: F401 (fixture)
from sqlalchemy import func, select

from ethen.gateway.config import LogConfig
from ethen.gateway.metrics import GatewayMetrics
from ethen.gateway.requestlog import RequestLog, RequestRecord
from ethen.store import Store
from ethen.store.groupcommit import GroupCommit
from ethen.store.requests import RequestQuery, list_requests, request_attempts


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
