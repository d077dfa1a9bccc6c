"""Hedged requests and project budgets (issue 27): both attempts' costs count exactly (the winner at its
usage, the cancelled loser at its input estimate), and no hedge fires when the budget cannot cover two
attempts. Store-backed gateway (a SQLite file, and a fresh Postgres database when ETHEN_TEST_PG_URL is
set) over real HTTP."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
from sqlalchemy import select

from ethen.store import Store
from ethen.store import schema as s
from tests.gateway.budget_harness import (
    admin,
    db_url,
    held_reserved,
    new_project_key,
    store_cfg,
    with_store,
)
from tests.gateway.hedging.harness import CLIENT_KEY, PRICES, USER, HedgeLive, Slow, hedge_live

__all__ = ["db_url"]  # the fixture (SQLite / Postgres), imported from budget_harness
MAX_TOKENS = 50
BODY: dict[str, Any] = {"model": "ethen/fast", "messages": USER, "max_tokens": MAX_TOKENS}


def ledger(url: str, rid: str) -> list[dict[str, Any]]:
    async def read(st: Store) -> list[dict[str, Any]]:
        lc = s.ledger.c
        q = select(lc.provider, lc.model, lc.prompt_tokens, lc.completion_tokens, lc.cost_nano, lc.estimated)
        async with st.engine.connect() as conn:
            rows = await conn.execute(q.where(lc.request_id == rid))
            return [dict(r._mapping) for r in rows]

    return with_store(url, read)


def spent_nano(url: str, project: str) -> int:
    async def read(st: Store) -> int:
        lc = s.ledger.c
        pid = (await st.get_project(project)).id
        async with st.engine.connect() as conn:
            rows = await conn.execute(select(lc.cost_nano).where(lc.project_id == pid))
            return sum(int(r[0]) for r in rows)

    return with_store(url, read)


def reserve_usd(lv: HedgeLive, key: str) -> tuple[float, int]:
    """(what one attempt reserves: the estimated input + max_tokens at the routes' prices, input tokens)."""
    tokens = lv.explain(BODY, key)["requirements"]["estimated_input_tokens"]
    return (tokens * PRICES["input_per_mtok"] + MAX_TOKENS * PRICES["output_per_mtok"]) / 1e6, tokens


def test_both_attempts_are_settled_exactly_and_every_hold_is_released(db_url: str) -> None:
    url = db_url
    with hedge_live([{"alias": "ethen/fast", "after_ms": 150}], store=store_cfg(url)) as lv:
        key = new_project_key(lv, "hedged", budget_usd=1.0, budget_window="day")  # type: ignore[arg-type]
        slow, fast, _ = lv.script_chain(Slow(delay_s=4.0), Slow(delay_s=0.05, prompt_tokens=9), key=key)
        _, input_tokens = reserve_usd(lv, key)
        r = lv.post(BODY, key)
        assert r.status_code == 200, r.text
        assert r.json()["ethen"]["routing"]["hedge"]["fired"] is True
        assert lv.up.wait_closed(slow)
        rows = sorted(ledger(url, r.headers["x-request-id"]), key=lambda row: row["estimated"])
        winner, loser = rows
        # the winner: its reported usage (9 prompt + 3 completion tokens) at the route's prices
        assert (winner["model"], winner["prompt_tokens"], winner["completion_tokens"]) == (fast[3:], 9, 3)
        assert winner["cost_nano"] == round((9 * 2.0 + 3 * 10.0) * 1000) and winner["estimated"] == 0
        # the cancelled loser: no usage reported -> its estimated input cost, flagged estimated
        assert loser["model"] == slow[3:] and loser["estimated"] == 1
        assert loser["completion_tokens"] == 0
        assert loser["cost_nano"] == round(input_tokens * 2.0 * 1000)
        deadline = time.monotonic() + 5
        while held_reserved(lv, "hedged") and time.monotonic() < deadline:  # type: ignore[arg-type]
            time.sleep(0.05)
        assert held_reserved(lv, "hedged") == 0  # type: ignore[arg-type]
        assert spent_nano(url, "hedged") == winner["cost_nano"] + loser["cost_nano"]
        # the request log (what the dashboard's request page shows): both attempts, the hedge on the receipt
        rid = r.headers["x-request-id"]
        with admin(lv) as a:  # type: ignore[arg-type]
            for _ in range(100):
                got = a.get(f"/requests/{rid}")
                if got.status_code == 200:
                    break
                time.sleep(0.05)
        assert got.status_code == 200, got.text
        logged = got.json()
        assert [(x["model"], x["outcome"]) for x in logged["attempts"]] == [(slow[3:], "cancelled"),
                                                                             (fast[3:], "ok")]
        assert logged["receipt"]["hedge"]["fired"] is True
        assert logged["fallback_used"] is False and "hedge_won" in logged["receipt"]["reason_codes"]
        assert logged["receipt"]["hedge"]["cancelled"] == [logged["receipt"]["chain"][0]]


def test_no_hedge_when_the_budget_cannot_cover_both_attempts(db_url: str) -> None:
    url = db_url
    with hedge_live([{"alias": "ethen/fast", "after_ms": 100}], store=store_cfg(url)) as lv:
        one, _ = reserve_usd(lv, CLIENT_KEY)  # the estimate does not depend on the key
        key = new_project_key(lv, "tight", budget_usd=one * 1.5, budget_window="day")  # type: ignore[arg-type]
        slow, fast, _ = ["up-" + c.split("/", 1)[1] for c in lv.explain(BODY, key)["receipt"]["chain"]]
        lv.up.behaviors.update({slow: Slow(delay_s=0.5), fast: Slow(delay_s=0.01)})
        r = lv.post(BODY, key)
        assert r.status_code == 200, r.text
        hedge = r.json()["ethen"]["routing"]["hedge"]
        assert hedge["fired"] is False and hedge["skipped"] == "budget" and "budget" in hedge["reasons"]
        assert lv.up.calls == [slow]  # served by the slow first attempt, no second call
        assert lv.metric("skipped_budget") == 1 and lv.metric("fired") == 0
        assert len(ledger(url, r.headers["x-request-id"])) == 1


def test_a_client_gone_mid_race_leaves_the_budget_exact(db_url: str) -> None:
    """The request path runs on when a buffered client hangs up (as without hedging): the winner settles at
    its usage, the loser at its input estimate, and no hold is left behind."""
    url = db_url
    with hedge_live([{"alias": "ethen/fast", "after_ms": 100}], store=store_cfg(url)) as lv:
        key = new_project_key(lv, "gone", budget_usd=1.0, budget_window="day")  # type: ignore[arg-type]
        first, second, _ = lv.script_chain(Slow(delay_s=1.0), Slow(delay_s=1.5), key=key)
        _, input_tokens = reserve_usd(lv, key)
        with contextlib.suppress(httpx.TimeoutException):  # the client hangs up while both attempts run
            httpx.post(f"{lv.base_url}/chat/completions", json=BODY, timeout=0.4,
                       headers={"authorization": f"Bearer {key}", "x-request-id": "gone-1"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not held_reserved(lv, "gone") and len(ledger(url, "gone-1")) == 2:  # type: ignore[arg-type]
                break
            time.sleep(0.1)
        assert held_reserved(lv, "gone") == 0  # type: ignore[arg-type]
        rows = {r["model"]: r for r in ledger(url, "gone-1")}
        assert rows[first[3:]]["cost_nano"] == round((7 * 2.0 + 3 * 10.0) * 1000)  # the winner's usage
        loser = rows[second[3:]]
        assert loser["cost_nano"] == round(input_tokens * 2.0 * 1000) and loser["estimated"] == 1
        assert lv.up.wait_closed(second)
