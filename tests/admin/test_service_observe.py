"""The dashboard's Providers, Canaries and Mesh data (``/api/admin/v1/observe/*``, issue 14), against live
gateways: a store-backed one (SQLite and Postgres) over the scripted upstream with a failing candidate and a
canary, one without a store (the memory ring), and one over three real mesh worker processes. The figures
are checked against the request log's own rows (read through ``/api/admin/v1/requests``), the router's
receipts, and the mesh's worker layout."""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ethen.admin.observe_data import open_fractions, percentile
from tests.gateway.budget_harness import ADMIN_KEY, db_url, live_store, new_project_key  # noqa: F401 (fixture)
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, config_dict, live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hello"}]
HDR = {"authorization": f"Bearer {ADMIN_KEY}"}
CANARY = {"alias": "ethen/cheap", "candidate": "alpha/alpha-large", "percent": 100, "min_samples": 3,
          "min_success_rate": 0.9}
PAGES = ("/observe/providers", "/observe/canaries", "/observe/mesh", "/observe/spend")


def _chat(url: str, key: str, model: str, rid: str) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=15,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid},
                      json={"model": model, "messages": USER, "max_tokens": 5})


def _logged(base: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:  # bounded: the request log's writer lags by a batch
        rows: list[dict[str, Any]] = httpx.get(f"{base}/requests?limit=500", headers=HDR).json()["data"]
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def _check_against_log(page: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Per candidate and per provider: attempts, successes and latency percentiles equal the log's."""
    for level, key_of in (("candidates", lambda a: a["candidate"]), ("providers", lambda a: a["provider"])):
        seen = {e["key"]: e for e in page[level]}
        keys = {key_of(a) for r in rows for a in r["attempts"]}
        assert keys <= set(seen), (level, keys, set(seen))
        for key in keys:
            mine = [a for r in rows for a in r["attempts"] if key_of(a) == key]
            lat = sorted(a["latency_ms"] for a in mine if "latency_ms" in a)
            e = seen[key]
            assert e["attempts"] == len(mine) == sum(e["series"]["attempts"]), key
            assert e["successes"] == sum(a["outcome"] == "ok" for a in mine), key
            # (a request that failed on its only attempt logs that attempt without a latency)
            assert e["p50_ms"] == (lat[math.ceil(0.5 * len(lat)) - 1] if lat else None), key
            assert e["p95_ms"] == (lat[math.ceil(0.95 * len(lat)) - 1] if lat else None), key


def _check_spend(base: str, rows: list[dict[str, Any]]) -> None:
    """The Spend charts' narrow rows are the log's newest rows, field for field."""
    fields = ("at", "project", "selected_provider", "selected_model", "cost_usd")
    want = [{k: r[k] for k in fields} for r in rows]
    assert httpx.get(f"{base}/observe/spend", headers=HDR).json()["data"] == want
    assert httpx.get(f"{base}/observe/spend?limit=1", headers=HDR).json()["data"] == want[:1]
    assert any(r["cost_usd"] for r in want)


def test_providers_and_canaries_from_the_log_telemetry_and_circuits(db_url: str) -> None:  # noqa: F811
    with live_store(db_url, {"up-beta-small": Behavior(fail_status=500)}, canaries=[CANARY]) as lv:
        key = new_project_key(lv, "acme")
        base = f"{lv.gateway.url}/api/admin/v1"
        # the canary's acceptance: not met with 0 samples (the router's receipt agrees)
        canaries = httpx.get(f"{base}/observe/canaries", headers=HDR).json()["data"]
        assert canaries == [{**{k: CANARY[k] for k in ("alias", "candidate", "percent", "min_samples",
                                                       "min_success_rate")},
                             "requests": 0, "hits": 0, "samples": 0, "successes": 0, "success_rate": None,
                             "acceptance_met": False}]
        for i in range(3):  # beta-small fails: its circuit opens after three failures
            assert _chat(lv.base_url, key, "beta-small", f"fail-{i}").status_code == 502
        receipts = []
        for i in range(4):  # the canary alias: alpha-large promoted (percent 100), served
            r = _chat(lv.base_url, key, "ethen/cheap", f"canary-{i}")
            assert r.status_code == 200, r.text
            receipts.append(r.json()["ethen"]["routing"]["canary"])
        assert [c["acceptance_met"] for c in receipts] == [False, False, False, True]  # the router's view
        rows = _logged(base, 7)
        assert len(rows) == 7

        page = httpx.get(f"{base}/observe/providers?window_s=600&buckets=10", headers=HDR).json()
        assert page["rows"] == 7 and not page["truncated"] and len(page["buckets"]) == 10
        assert page["until"] - page["since"] == 600 and page["since"] <= time.time() < page["until"]
        _check_against_log(page, rows)
        cand = {e["key"]: e for e in page["candidates"]}
        small, large = cand["beta/beta-small"], cand["alpha/alpha-large"]
        assert small["attempts"] == 3 and small["successes"] == 0 and small["success_rate"] == 0.0
        assert large["attempts"] == 4 and large["success_rate"] == 1.0
        assert small["series"]["success_rate"][-1] == 0.0 and large["series"]["success_rate"][-1] == 1.0
        # the circuit the failures opened: live state and open during the last bucket
        assert small["live"]["circuit"] in ("open", "half_open")
        # (the telemetry also counts the circuit's probes, which fail too: 3 or more samples)
        assert small["live"]["samples"] >= 3 and small["live"]["successes"] == 0
        assert small["series"]["circuit_open"][-1] > 0 and large["series"]["circuit_open"] == [0.0] * 10
        assert large["live"] == {**large["live"], "circuit": "closed", "samples": 4, "successes": 4}
        # every pool candidate is listed, traffic or not
        assert {f"{r['provider']}/{r['model']}" for r in ROUTES} <= set(cand)
        assert cand["gamma/gamma-claude"]["attempts"] == 0

        canaries = httpx.get(f"{base}/observe/canaries", headers=HDR).json()["data"]
        assert len(canaries) == 1
        c = canaries[0]
        assert (c["requests"], c["hits"]) == (4, 4)
        assert (c["samples"], c["successes"], c["success_rate"], c["acceptance_met"]) == (4, 4, 1.0, True)
        assert httpx.get(f"{base}/observe/mesh", headers=HDR).json() == {"data": []}
        _check_spend(base, rows)


def test_a_wrong_key_sees_nothing_and_bad_parameters_are_400(tmp_path: Any) -> None:
    with live_store(f"sqlite:///{tmp_path / 'o.db'}", {}) as lv:
        base = f"{lv.gateway.url}/api/admin/v1"
        key = new_project_key(lv, "acme")
        for page in PAGES:
            for hdr in ({}, {"authorization": "Bearer not-the-admin-key"}, {"authorization": f"Bearer {key}"},
                        {"cookie": "ethen_session=made-up"}):
                r = httpx.get(base + page, headers=hdr)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (page, hdr)
                assert "data" not in r.json() and "candidates" not in r.json()
        for query in ("window_s=10", "window_s=abc", "buckets=0", "buckets=500", "window_s=-5"):
            r = httpx.get(f"{base}/observe/providers?{query}", headers=HDR)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", query
        r = httpx.get(f"{base}/observe/mesh?prompt_tokens=x", headers=HDR)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_tokens"


def test_without_a_store_the_pages_read_the_memory_ring() -> None:
    log = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
    with live({"up-beta-small": Behavior(fail_status=500)}, log=log, canaries=[CANARY]) as lv:
        base = f"{lv.gateway.url}/api/admin/v1"
        assert _chat(lv.base_url, CLIENT_KEY, "ethen/auto", "ring-0").status_code == 200  # beta fails first
        assert _chat(lv.base_url, CLIENT_KEY, "ethen/cheap", "ring-1").status_code == 200
        rows = _logged(base, 2)
        assert len(rows) == 2
        page = httpx.get(f"{base}/observe/providers", headers=HDR).json()
        assert page["rows"] == 2
        _check_against_log(page, rows)
        c = httpx.get(f"{base}/observe/canaries", headers=HDR).json()["data"][0]
        assert (c["requests"], c["hits"]) == (1, 1)
        _check_spend(base, rows)


def test_open_fractions_and_percentile() -> None:
    # opened at 15, closed at 25; "p" open since before the history (its first transition is a close);
    # "q" open now with no transition (opened before the bounded history); "r" opened at 38, open now
    hist = [(15.0, "a", True), (25.0, "a", False), (5.0, "p", False), (38.0, "r", True)]
    got = open_fractions(hist, ["q", "r"], start=0.0, bucket_s=10.0, buckets=4)
    assert got == {"a": [0.0, 0.5, 0.5, 0.0], "p": [0.5, 0.0, 0.0, 0.0], "q": [1.0] * 4,
                   "r": [0.0, 0.0, 0.0, 0.2]}
    assert percentile([], 50) is None and percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 21)], 95) == 19.0  # ceil(0.95 * 20) = 19: no float slip
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0


MESH_LAYOUT = {"gpu": "0-9", "mini": "0-9,10-19", "laptop": "10-19,20-29"}


@pytest.fixture(scope="module")
def mesh_workers() -> Iterator[dict[str, Any]]:
    from ethen.mesh.worker.launch import spawn_worker

    started: dict[str, Any] = {}
    try:
        for node, layers in MESH_LAYOUT.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_mesh_nodes_layers_health_and_the_route_chosen_now(mesh_workers: dict[str, Any]) -> None:
    mesh = {"id": "mesh", "kind": "mesh", "workers": {n: w.address for n, w in mesh_workers.items()},
            "health_interval_s": 0.1, "weights": {"hop": 1.0}}
    log = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
    providers = [*config_dict("http://127.0.0.1:1")["providers"], mesh]
    routes = [*ROUTES, {"model": "smollm2-135m-instruct", "provider": "mesh"}]
    with live(providers=providers, routes=routes, log=log) as lv:
        base = f"{lv.gateway.url}/api/admin/v1"
        deadline = time.monotonic() + 30
        while True:  # bounded: the orchestrator's first health polls
            view = httpx.get(f"{base}/observe/mesh", headers=HDR, timeout=10).json()["data"]
            if view and view[0]["route"] is not None and all(n["alive"] for n in view[0]["nodes"]):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.1)
        m = view[0]
        assert (m["provider"], m["loaded"], m["n_layers"], m["error"]) == ("mesh", True, 30, None)
        layers = {n["node_id"]: n["layers"] for n in m["nodes"]}
        assert layers == {"gpu": [[0, 9]], "mini": [[0, 9], [10, 19]], "laptop": [[10, 19], [20, 29]]}
        route = m["route"]
        stages = route["stages"]
        assert stages[0]["first"] == 0 and stages[-1]["last"] == 29
        assert all(a["last"] + 1 == b["first"] for a, b in itertools.pairwise(stages))
        assert route["cost"] == pytest.approx(sum(s["cost"] for s in stages))
        assert route["hops"] == len(stages) - 1 and route["weights"]["hop"] == 1.0
        for n in m["nodes"]:
            assert n["in_route"] == (n["node_id"] in route["nodes"])
            assert n["node_cost"] == pytest.approx(sum(n["cost_terms"].values()))
            assert n["latency_ms_ewma"] >= 0 and n["load"] >= 0 and n["active_sessions"] == 0
        # each stage's node term is its node's cost (the same function)
        cost = {n["node_id"]: n["node_cost"] for n in m["nodes"]}
        assert all(s["node_cost"] == pytest.approx(cost[s["node_id"]]) for s in stages)

        # a worker dies: the page shows it dead and the route chosen now avoids it
        victim = route["nodes"][0]
        mesh_workers[victim].stop()
        deadline = time.monotonic() + 30
        while True:  # bounded: the next health polls
            m = httpx.get(f"{base}/observe/mesh", headers=HDR, timeout=10).json()["data"][0]
            dead = {n["node_id"] for n in m["nodes"] if not n["alive"]}
            if victim in dead:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m["route"] is None or victim not in m["route"]["nodes"]
        if m["route"] is not None:
            assert victim in m["route"]["rejected"]["dead"]
        else:
            assert "layers" in (m["error"] or "")
