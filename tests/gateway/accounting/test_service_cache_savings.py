"""Seeing the prompt cache (issue 45 item 4) through a live gateway with a store, on SQLite and Postgres: a
scripted Anthropic upstream bills cache reads and writes; the request log (the admin API the dashboard's
request page reads) and ``ethen usage`` (a real process on the same database) show the tokens read and
written and what the reads saved: reads x (input price - cache-read price), genai-prices' own figures. A
database from before (``0009``, no cache columns) still opens, its rows counted as 0."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from genai_prices import Usage as PriceUsage
from genai_prices import calc_price
from sqlalchemy import text

from ethen.store import Store
from ethen.store.engine import make_engine
from ethen.store.migrations import MIGRATIONS, applied
from ethen.store.requests import RequestQuery, list_requests
from ethen.store.schema import migrations as migrations_table
from tests.gateway.budget_harness import admin, db_url, live_store, new_project_key
from tests.gateway.service_harness import ROUTES
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, imported from budget_harness

MODEL = "claude-sonnet-4-5"
SONNET = {"model": "sonnet", "provider": "gamma", "upstream_model": MODEL,
          "info": {**ROUTES[3]["info"], "context_window": 400_000},
          "prices": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}  # fmt: skip
PROMPT, READ, WRITE = 5_000, 4_000, 600
SYSTEM = "You are a coding agent. " * 250  # ~1.5k estimated tokens: the usage is credible
NEW_COLUMNS = ("cache_read_tokens", "cache_write_tokens", "saved_nano")


def _input_usd(**usage: int) -> float:
    return float(calc_price(PriceUsage(**usage), MODEL, provider_id="anthropic").input_price)


def _saving() -> float:
    """The oracle: the same usage with its reads billed as input, minus the actual input price."""
    return _input_usd(input_tokens=PROMPT, cache_write_tokens=WRITE) - _input_usd(
        input_tokens=PROMPT, cache_read_tokens=READ, cache_write_tokens=WRITE)


def _logged(a: httpx.Client, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10  # the request log is written off the request path
    while (r := a.get(f"/requests/{rid}")).status_code == 404 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    row: dict[str, Any] = r.json()
    return row


def _ethen_text(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "ethen", *args], capture_output=True, text=True, timeout=120,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _ethen(*args: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_ethen_text(*args))
    return doc


def test_request_log_and_ethen_usage_show_cache_tokens_and_savings(db_url: str) -> None:
    saving = _saving()
    assert saving > 0
    behaviors = {MODEL: Behavior(prompt_tokens=PROMPT, cache_read_tokens=READ, cache_write_tokens=WRITE,
                                 tool_call=False)}
    with live_store(db_url, behaviors, routes=[*ROUTES, SONNET]) as lv:
        key = new_project_key(lv, "agents", budget_usd=50.0)
        body = {"model": "sonnet", "max_tokens": 20, "system": SYSTEM,
                "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{lv.gateway.url}/v1/messages", json=body, timeout=30,
                       headers={"x-api-key": key, "x-request-id": "see-cache-1"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (READ, WRITE)
        r2 = httpx.post(f"{lv.base_url}/chat/completions", timeout=30,
                        headers={"authorization": f"Bearer {key}", "x-request-id": "see-cache-2"},
                        json={"model": "sonnet", "max_tokens": 20, "messages": [
                            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]})
        assert r2.status_code == 200, r2.text
        assert r2.json()["ethen"]["routing"]["cost"]["saved_usd"] == pytest.approx(saving)

        with admin(lv) as a:
            row = _logged(a, "see-cache-1")
            assert (row["prompt_tokens"], row["cache_read_tokens"], row["cache_write_tokens"]) == (
                PROMPT, READ, WRITE)
            assert row["saved_usd"] == pytest.approx(saving, abs=1e-9)
            assert row["receipt"]["cost"]["saved_usd"] == pytest.approx(saving)
            listed = a.get("/requests", params={"project": "agents"}).json()["data"]
            assert {x["request_id"]: x["cache_read_tokens"] for x in listed} == {"see-cache-1": READ,
                                                                               "see-cache-2": READ}
            api = a.get("/usage", params={"project": "agents"}).json()
        assert api["total_saved_usd"] == pytest.approx(2 * saving, abs=1e-8)

        report = _ethen("usage", "--db", db_url, "--project", "agents")
        (line,) = report["data"]
        assert (line["model"], line["requests"], line["prompt_tokens"]) == ("sonnet", 2, 2 * PROMPT)
        assert (line["cache_read_tokens"], line["cache_write_tokens"]) == (2 * READ, 2 * WRITE)
        assert line["saved_usd"] == pytest.approx(2 * saving, abs=1e-8)
        assert report["total_saved_usd"] == pytest.approx(2 * saving, abs=1e-8)
        assert report["total_cache_read_tokens"] == 2 * READ
        assert report == {k: v for k, v in api.items() if k != "object"}
        logs = _ethen_text("logs", "--db", db_url, "--project", "agents").splitlines()
        assert len(logs) == 2 and all(f"(cache {READ} read {WRITE} written, saved ${saving:.6f})" in line
                                      for line in logs), logs


def test_a_database_from_before_the_cache_columns_opens(db_url: str) -> None:
    """At ``0009`` (the columns dropped again: ``0001`` creates today's tables), with a settled ledger row
    and a logged request: ``0010`` adds the columns, the old rows count 0 / show none, new ones settle."""
    upto = [name for name, _ in MIGRATIONS].index("0009_shadow_pairs") + 1
    at = datetime.now(UTC)

    async def at_0009() -> None:
        engine = make_engine(db_url)
        try:
            async with engine.begin() as conn:
                def up(c: Any) -> None:
                    applied(c)
                    for name, fn in MIGRATIONS[:upto]:
                        fn(c)
                        c.execute(migrations_table.insert().values(name=name, applied_at=at))
                    for table in ("ledger", "request_log"):
                        for col in NEW_COLUMNS:
                            c.execute(text(f"ALTER TABLE {table} DROP COLUMN {col}"))
                    c.execute(text("INSERT INTO projects (name, budget_window, created_at) "
                                   "VALUES ('old', 'month', :at)"), {"at": at})
                    c.execute(text("INSERT INTO ledger (request_id, project_id, key_id, provider, model, "
                                   "prompt_tokens, completion_tokens, cost_nano, estimated, at) VALUES "
                                   "('old-1', 1, NULL, 'gamma', 'sonnet', 100, 5, 1000, 0, :at)"), {"at": at})
                    c.execute(text("INSERT INTO request_log (request_id, at, endpoint, stream, "
                                   "fallback_used, latency_ms, status, outcome, attempts) VALUES ('old-1', "
                                   ":at, 'chat', "
                                   ":f, :f, 1.5, 200, 'ok', '[]')"), {"at": at, "f": False})
                await conn.run_sync(up)
        finally:
            await engine.dispose()

    asyncio.run(at_0009())

    async def reopened() -> tuple[list[Any], list[dict[str, Any]], list[str]]:
        st = await Store.open(db_url)
        try:
            project = await st.get_project("old")
            await st.settle(project, reservation_id=None, request_id="new-1", key_id=None, provider="gamma",
                            model="sonnet", prompt_tokens=100, completion_tokens=5, cost_usd=1e-6,
                            cache_read_tokens=80, cache_write_tokens=10, saved_usd=2e-7)
            rows = await st.usage(project="old")
            logged = await list_requests(st, RequestQuery())
            async with st.engine.connect() as conn:
                names = await conn.run_sync(applied)
            return rows, logged, names
        finally:
            await st.aclose()

    rows, logged, names = asyncio.run(reopened())
    assert names[-1] == "0010_prompt_cache"
    (row,) = rows
    assert (row.requests, row.prompt_tokens) == (2, 200)
    assert (row.cache_read_tokens, row.cache_write_tokens) == (80, 10)
    assert row.saved_usd == pytest.approx(2e-7)
    (old,) = logged
    assert (old["request_id"], old["cache_read_tokens"], old["saved_usd"]) == ("old-1", None, None)
