"""Shadow calls and budgets (issue 27): the rule's project pays (its ledger shows the shadow calls, key id
``shadow``), the client's budget and rate limits never see them; a shadow its project cannot afford, or whose
project does not exist, is skipped and counted. Store-backed gateway (SQLite file) over real HTTP."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from ethen.store import Store
from ethen.store import schema as s
from tests.gateway.budget_harness import db_url, with_store
from tests.gateway.shadow.harness import SMALL, USER, ShadowLive, rule, shadow_live
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, imported for pytest (SQLite; Postgres with ETHEN_TEST_PG_URL)
BODY = {"model": "ethen/fast", "messages": USER, "max_tokens": 50}


def ledger(lv: ShadowLive, project: str) -> list[dict[str, Any]]:
    async def read(st: Store) -> list[dict[str, Any]]:
        lc = s.ledger.c
        pid = (await st.get_project(project)).id
        q = select(lc.request_id, lc.key_id, lc.provider, lc.model, lc.cost_nano, lc.completion_tokens)
        async with st.engine.connect() as conn:
            return [dict(r._mapping) for r in await conn.execute(q.where(lc.project_id == pid))]

    return with_store(lv.db, read)


def held(lv: ShadowLive, project: str) -> int:
    pid = with_store(lv.db, lambda st: st.get_project(project)).id
    return int(lv.gw.accounts.admission.held_nano(pid)[1])


def test_the_shadow_project_pays_and_the_clients_budget_and_rate_limit_never_see_it(tmp_path: Path,
                                                                                    db_url: str) -> None:
    with shadow_live(tmp_path, [rule()], db=db_url) as lv:  # SQLite, and Postgres with ETHEN_TEST_PG_URL
        key = lv.project("client", budget_usd=1.0, budget_window="day", rpm=2)
        rids = []
        for _ in range(2):  # rpm = 2: a shadow counted against the client would refuse the second
            r = lv.post(BODY, key)
            assert r.status_code == 200, r.text
            rids.append(r.headers["x-request-id"])
        assert len(lv.wait_pairs(2)) == 2
        lv.wait_idle()
        assert lv.post(BODY, key).status_code == 429  # the limit is live: the client's own third request
        client = ledger(lv, "client")
        assert sorted(x["request_id"] for x in client) == sorted(rids)
        assert {x["provider"] for x in client} == {"alpha"}
        shadow = ledger(lv, "shadow-evals")
        assert sorted(x["request_id"] for x in shadow) == sorted(rids)
        got = {(x["key_id"], x["provider"], x["model"]) for x in shadow}
        assert got == {("shadow", "beta", "beta-tools")}
        pairs = {p["request_id"]: p for p in lv.shadows()["pairs"]}
        for x in shadow:  # charged at the shadow's usage: what the pair records
            assert x["cost_nano"] == pairs[x["request_id"]]["candidate_cost_nano"] > 0
        for x in client:
            assert x["cost_nano"] == pairs[x["request_id"]]["primary_cost_nano"]
        assert held(lv, "shadow-evals") == 0 and held(lv, "client") == 0  # every hold settled or released


def test_a_shadow_its_project_cannot_afford_is_skipped(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()], shadow_budget=0.0) as lv:
        assert lv.post(BODY).status_code == 200
        assert lv.wait_metric("skipped_budget", 1) == 1
        lv.wait_idle()
        assert lv.metric("sent") == 0 and lv.shadows()["pairs"] == []
        assert ledger(lv, "shadow-evals") == []
        assert not [c for c in lv.script.calls if c["body"]["model"] == "up-beta-tools"]


def test_a_failed_shadow_is_not_billed_and_its_hold_is_released(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()], {"up-beta-tools": Behavior(fail_status=503)}) as lv:
        assert lv.post(BODY).status_code == 200
        assert len(lv.wait_pairs(1)) == 1
        lv.wait_idle()
        assert ledger(lv, "shadow-evals") == [] and held(lv, "shadow-evals") == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's exit(3)
def test_a_missing_project_is_a_config_error_at_start(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Issue 42 item 7: found at start (naming the key and the value), not per request."""
    rules = [rule(), rule(SMALL, project="nobody")]
    with caplog.at_level(logging.ERROR, logger="ethen.gateway.shadow"), \
            pytest.raises(RuntimeError, match="did not start"), shadow_live(tmp_path, rules):
        pass
    errors = [r.getMessage() for r in caplog.records if r.name == "ethen.gateway.shadow"]
    assert len(errors) == 1 and errors[0].startswith("shadows[1].project = 'nobody': no such project"), errors
    assert "ethen projects create nobody" in errors[0]


def test_a_project_removed_after_start_skips_the_shadow(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()]) as lv:
        # the store has no way to delete a project: the running rule is pointed at one the store lacks
        lv.gw.shadows.by_alias["ethen/fast"] = (dataclasses.replace(lv.gw.shadows.rules[0], project="gone"),)
        assert lv.post(BODY).status_code == 200
        assert lv.wait_metric("skipped_project", 1) == 1
        assert lv.metric("sent") == 0


def test_a_shadow_is_charged_its_real_usage_above_the_routing_estimate(tmp_path: Path, db_url: str) -> None:
    """Issue 42 item 5: the shadow's upstream reports far more prompt tokens than the bytes/3 estimate (a
    provider-side template); the ledger charges what the pair records, never a cap at a smaller hold."""
    behaviors = {"up-beta-tools": Behavior(prompt_tokens=900, pieces=("a",) * 10)}
    with shadow_live(tmp_path, [rule()], behaviors, db=db_url) as lv:
        for _ in range(3):
            assert lv.post({**BODY, "max_tokens": 10}).status_code == 200
        pairs = {p["request_id"]: p for p in lv.wait_pairs(3)}
        lv.wait_idle()
        shadow = ledger(lv, "shadow-evals")
        assert len(shadow) == 3
        for x in shadow:
            assert (x["completion_tokens"], x["cost_nano"]) == (10, (900 * 20 + 10 * 40) * 1000), x
            assert x["cost_nano"] == pairs[x["request_id"]]["candidate_cost_nano"]
        assert held(lv, "shadow-evals") == 0
