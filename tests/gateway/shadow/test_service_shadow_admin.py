"""``GET /api/admin/v1/shadows`` and ``POST /api/admin/v1/shadows/promote`` (issue 27) over real HTTP:
summary and pairs, bad queries as OpenAI-style errors, promotion refused (409) and accepted (a canary that the
next requests are routed to)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway.shadow.harness import PRIMARY, SMALL, TOOLS, USER, rule, shadow_live
from tests.gateway.upstream import Behavior

BODY = {"model": "ethen/fast", "messages": USER, "max_tokens": 50}


def test_summary_and_pairs_newest_first_with_filters(tmp_path: Path) -> None:
    behaviors = {"up-beta-small": Behavior(fail_status=500, fail_times=1)}
    with shadow_live(tmp_path, [rule(), rule(SMALL, min_samples=2, min_success_rate=0.9)], behaviors) as lv:
        rids = [lv.post(BODY).headers["x-request-id"] for _ in range(3)]
        pairs = lv.wait_pairs(6)
        assert len(pairs) == 6 and [p["id"] for p in pairs] == sorted((p["id"] for p in pairs), reverse=True)
        out = lv.shadows()
        by = {d["candidate"]: d for d in out["data"]}
        assert set(by) == {TOOLS, SMALL}
        tools = by[TOOLS]
        assert tools["project"] == "shadow-evals" and tools["percent"] == 100 and tools["canary"] is None
        st = tools["summary"]
        assert st["n"] == 3 and st["success_rate"] == 1.0 and st["exact_rate"] == 1.0
        assert st["mean_similarity"] == 1.0 and st["cost_ratio"] == pytest.approx(20.0, rel=0.05)
        assert st["latency_ratio"] is not None and st["latency_ratio"] > 0
        assert tools["promotable"] is False
        assert tools["promotion"] == "n = 3 < min_samples = 20"  # the default min_samples
        small = by[SMALL]["summary"]
        assert small["n"] == 3 and small["success_rate"] == pytest.approx(2 / 3)
        assert by[SMALL]["promotable"] is False and "min_success_rate" in by[SMALL]["promotion"]
        only = lv.shadows(candidate=SMALL, limit=2)
        assert [d["candidate"] for d in only["data"]] == [SMALL]
        assert len(only["pairs"]) == 2 and {p["candidate"] for p in only["pairs"]} == {SMALL}
        assert {p["request_id"] for p in pairs} == set(rids)
        assert lv.shadows(alias="ethen/coding") == {"object": "list", "data": [], "pairs": []}


@pytest.mark.parametrize(("query", "param"), [
    ({"alias": "ethen/nope"}, "alias"), ({"candidate": "no-slash"}, "candidate"),
    ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"limit": "501"}, "limit"),
])
def test_bad_queries_are_400_naming_the_param(tmp_path: Path, query: dict[str, str], param: str) -> None:
    with shadow_live(tmp_path, [rule()]) as lv, lv.admin() as a:
        r = a.get("/shadows", params=query)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_value" and err["param"] == param
        assert err["type"] == "invalid_request_error"


def test_admin_key_required(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()]) as lv:
        r = httpx.get(f"{lv.gateway.url}/api/admin/v1/shadows", headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] is not None
        r = httpx.post(f"{lv.gateway.url}/api/admin/v1/shadows/promote", json={"alias": "ethen/fast",
                                                                               "candidate": TOOLS})
        assert r.status_code == 401


def test_promote_refused_then_accepted_and_requests_route_to_the_canary(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule(min_samples=2)]) as lv, lv.admin() as a:
        assert lv.post(BODY).status_code == 200
        lv.wait_pairs(1)
        r = a.post("/shadows/promote", json={"alias": "ethen/fast", "candidate": TOOLS})
        assert r.status_code == 409
        err = r.json()["error"]
        assert err["code"] == "promotion_refused" and "n = 1 < min_samples = 2" in err["message"]
        assert lv.gw.canaries == ()
        assert lv.post(BODY).status_code == 200
        lv.wait_pairs(2)
        r = a.post("/shadows/promote", json={"alias": "ethen/fast", "candidate": TOOLS, "percent": 100})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["promoted"] is True and out["persisted"] is False and out["replaced"] is None
        assert out["canary"] == {"alias": "ethen/fast", "candidate": TOOLS, "percent": 100,
                                 "min_success_rate": 0.95, "min_samples": 2}
        assert out["summary"]["n"] == 2
        r = lv.post(BODY)  # percent = 100: every request goes to the canary first
        routing = r.json()["ethen"]["routing"]
        assert routing["selected_provider"] == "beta" and routing["selected_model"] == "beta-tools"
        assert routing["canary"]["promoted"] is True and routing["canary"]["candidate"] == TOOLS
        assert lv.shadows()["data"][0]["canary"] == 100
        r = a.post("/shadows/promote", json={"alias": "ethen/fast", "candidate": TOOLS, "percent": 0.0})
        assert r.status_code == 200 and r.json()["replaced"] == {"percent": 100}
        routing = lv.post(BODY).json()["ethen"]["routing"]
        assert routing["selected_provider"] == "alpha" and routing["canary"]["promoted"] is False
        assert len(lv.gw.canaries) == 1


def test_promote_refuses_a_low_success_rate(tmp_path: Path) -> None:
    behaviors = {"up-beta-tools": Behavior(fail_status=500)}
    with shadow_live(tmp_path, [rule(min_samples=1)], behaviors) as lv, lv.admin() as a:
        assert lv.post(BODY).status_code == 200
        lv.wait_pairs(1)
        r = a.post("/shadows/promote", json={"alias": "ethen/fast", "candidate": TOOLS})
        assert r.status_code == 409
        assert "success_rate = 0.0000 < min_success_rate = 0.95" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"candidate": TOOLS}, 400, "missing_required_parameter", "alias"),
    ({"alias": "ethen/fast"}, 400, "missing_required_parameter", "candidate"),
    ({"alias": "ethen/fast", "candidate": TOOLS, "percent": 7}, 400, "invalid_value", "percent"),
    ({"alias": "ethen/fast", "candidate": TOOLS, "percent": "5"}, 400, "invalid_type", "percent"),
    ({"alias": "ethen/fast", "candidate": TOOLS, "percent": 5.5}, 400, "invalid_type", "percent"),
    ({"alias": "ethen/fast", "candidate": TOOLS, "percent": True}, 400, "invalid_type", "percent"),
    ({"alias": "ethen/fast", "candidate": TOOLS, "extra": 1}, 400, "invalid_value", "extra"),
    ({"alias": 3, "candidate": TOOLS}, 400, "invalid_type", "alias"),
    ({"alias": "ethen/fast", "candidate": PRIMARY}, 404, "not_found", None),
])
def test_bad_promote_bodies(tmp_path: Path, body: dict[str, object], status: int, code: str,
                            param: str | None) -> None:
    with shadow_live(tmp_path, [rule()]) as lv, lv.admin() as a:
        r = a.post("/shadows/promote", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["param"] == param
        r = a.post("/shadows/promote", content=b"[1")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_store_gateway_without_shadow_rules_lists_none_and_refuses_promotion(tmp_path: Path) -> None:
    """sweep27: with a [store] but no [[shadows]] the paths were a bare 404 for the path (``GET
    /api/admin/v1/shadows: not found``); now an empty listing, and the promotion's own 404."""
    with shadow_live(tmp_path, []) as lv, lv.admin() as a:
        r = a.get("/shadows", params={"alias": "ethen/fast"})
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "list", "data": [], "pairs": []}
        assert a.get("/shadows", params={"limit": "0"}).json()["error"]["param"] == "limit"
        r = a.post("/shadows/promote", json={"alias": "ethen/fast", "candidate": TOOLS})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert "no [[shadows]] rule" in r.json()["error"]["message"]
        assert httpx.get(f"{lv.gateway.url}/api/admin/v1/shadows").status_code == 401
