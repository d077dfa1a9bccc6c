"""Issue 42 item 4: a request routing refused keeps its decision in the request log. The 422 the client got
listed the rejected candidates and their reasons; ``GET /api/admin/v1/requests/{id}`` (and so the
dashboard's "Rejected candidates" list) shows the same rejections, with what the request needed. Real HTTP
(scripted upstream + live store-backed gateway), real SQLite (and Postgres when ETHEN_TEST_PG_URL is set)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.budget_harness import admin, db_url, live_store, new_project_key
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, Live

__all__ = ["db_url"]  # the fixture, re-exported for pytest

USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def _post(lv: Live, body: dict[str, Any], rid: str, key: str) -> httpx.Response:
    return httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=15,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid})


def _logged(a: httpx.Client, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:  # bounded: the deadline (the log's writer is asynchronous)
        r = a.get(f"/requests/{rid}")
        if r.status_code == 200:
            out: dict[str, Any] = r.json()
            return out
        assert time.monotonic() < deadline, f"request {rid} was not logged"
        time.sleep(0.05)


def test_a_refused_request_keeps_its_decision_in_the_log(db_url: str) -> None:
    with live_store(db_url) as lv:
        gamma_only = new_project_key(lv, "gamma-only", allowed_providers=["gamma"])
        broke = new_project_key(lv, "broke", budget_usd=1e-9)
        # 422: the project may use gamma only, and the client asked for a beta model
        r = _post(lv, {"model": "beta-small", "messages": USER, "max_tokens": 7}, "not-allowed", gamma_only)
        assert r.status_code == 422 and r.json()["error"]["code"] == "no_smart_route_candidate", r.text
        told = r.json()["error"]["rejections"]
        assert told == [{"candidate": "beta/beta-small", "reasons": ["provider_not_allowed"]}]
        # 422 on an alias: tools and a long context rule candidates out for different reasons
        big = [{"role": "user", "content": "x" * 700_000}]
        r = _post(lv, {"model": "ethen/auto", "messages": big, "tools": TOOLS}, "no-tools", CLIENT_KEY)
        assert r.status_code == 422, r.text
        alias_told = r.json()["error"]["rejections"]
        # 402: rejected only for the budget
        r = _post(lv, {"model": "alpha-large", "messages": USER}, "broke-1", broke)
        assert r.status_code == 402, r.text
        # 404: no such model (no candidates to reject; what the request needed is kept)
        r = _post(lv, {"model": "no-such-model", "messages": USER, "tools": TOOLS}, "unknown-1", CLIENT_KEY)
        assert r.status_code == 404, r.text

        with admin(lv) as a:
            row = _logged(a, "not-allowed")
            assert (row["status"], row["error_code"], row["project"]) == (422, "no_smart_route_candidate",
                                                                          "gamma-only")
            rc = row["receipt"]
            assert rc is not None, row
            assert rc["rejected"] == told  # what the client was told, with the reasons
            assert rc["rejected_count"] == 1 and rc["candidate_count"] == 0 and rc["chain"] == []
            assert rc["requested_model"] == "beta-small" and rc["selected_model"] is None
            assert "concrete_model" in rc["reason_codes"]
            req = rc["requirements"]
            assert req["model"] == "beta-small" and req["max_output_tokens"] == 7 and req["tools"] is False
            assert req["estimated_input_tokens"] > 0
            assert "context" in rc["hard_requirements"]

            rc = _logged(a, "no-tools")["receipt"]
            assert rc["rejected"] == alias_told and len(rc["rejected"]) == 4
            reasons = {j["candidate"]: j["reasons"] for j in rc["rejected"]}
            assert "no_tool_support" in reasons["beta/beta-small"]
            assert all("context_window_too_small" in v for v in reasons.values())
            assert rc["alias_profile"] == "ethen/auto" and rc["requirements"]["tools"] is True
            assert "tools" in rc["hard_requirements"]

            row = _logged(a, "broke-1")
            assert row["status"] == 402 and row["receipt"] is not None
            assert row["receipt"]["rejected"] == [
                {"candidate": "alpha/alpha-large", "reasons": ["over_project_budget"]}]

            row = _logged(a, "unknown-1")
            assert row["status"] == 404 and row["receipt"]["requirements"]["tools"] is True
            assert row["receipt"]["rejected"] == [] and row["receipt"]["requested_model"] == "no-such-model"

            # the listing still leaves the receipt out (the detail view has it)
            listing = a.get("/requests", params={"status": "422"}).json()["data"]
            assert {x["request_id"] for x in listing} == {"not-allowed", "no-tools"}
            assert all("receipt" not in x for x in listing)


def test_a_refused_embeddings_request_keeps_its_rejections(tmp_path: Path) -> None:
    routes = [*ROUTES, {"model": "embed-small", "provider": "alpha", "upstream_model": "up-embed-a",
                        "endpoint": "embeddings", "info": {"context_window": 8192},
                        "prices": {"input_per_mtok": 20.0}}]
    with live_store(f"sqlite:///{tmp_path / 'gw.db'}", routes=routes) as lv:
        key = new_project_key(lv, "gamma-only", allowed_providers=["gamma"])
        r = httpx.post(f"{lv.base_url}/embeddings", json={"model": "embed-small", "input": "abc"}, timeout=15,
                       headers={"authorization": f"Bearer {key}", "x-request-id": "emb-1"})
        assert r.status_code == 422, r.text
        told = r.json()["error"]["rejections"]
        assert told == [{"candidate": "alpha/embed-small", "reasons": ["provider_not_allowed"]}]
        assert "may use only the providers gamma" in r.json()["error"]["message"]
        with admin(lv) as a:
            rc = _logged(a, "emb-1")["receipt"]
        assert rc["rejected"] == told and rc["requirements"]["estimated_input_tokens"] >= 1
