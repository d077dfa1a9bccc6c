"""The request log (issue 14): every finished request recorded off the request path, read through the admin
API and ``ethen logs``; retention; the memory ring without a store; OTel spans; the new metric families.
Real HTTP (scripted upstream + live gateway), real SQLite (and Postgres when ETHEN_TEST_PG_URL is set)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ethen.gateway.config import LogConfig
from ethen.gateway.observation.metrics import GatewayMetrics
from ethen.gateway.observation.requestlog import RequestLog, RequestRecord
from ethen.gateway.observation.tracing import Tracing
from ethen.store import Store
from ethen.store.keys import parse_key
from ethen.store.requests import count_requests, insert_requests
from tests.gateway.budget_harness import ADMIN_KEY, admin, db_url, live_store, new_project_key, with_store
from tests.gateway.service_harness import CLIENT_KEY, PROVIDER_KEY, Live, live
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, re-exported for pytest

USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
ADMIN_SHA = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()


def _post(lv: Live, body: dict[str, Any], rid: str, key: str = CLIENT_KEY) -> httpx.Response:
    return httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=15,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid})


def _stream(lv: Live, body: dict[str, Any], rid: str, key: str = CLIENT_KEY) -> str:
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", json={**body, "stream": True}, timeout=15,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid}) as r:
        assert r.status_code == 200
        return r.read().decode()


def _wait(fn: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:  # bounded: the deadline
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _listing(a: httpx.Client, **params: Any) -> dict[str, Any]:
    r = a.get("/requests", params=params)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _traffic(lv: Live, key: str, broke_key: str) -> dict[str, str]:
    """One of each outcome; returns request id -> what it is."""
    rids = {"ok-1": "success", "fb-1": "fallback", "refused-402": "budget", "refused-422": "no candidate",
            "stream-1": "stream", "unauth-1": "401"}
    r = _post(lv, {"model": "beta-small", "messages": USER, "max_tokens": 5}, "ok-1", key)
    assert r.status_code == 200
    lv.script.behaviors["up-beta-small"] = Behavior(fail_status=500)
    r = _post(lv, {"model": "ethen/auto", "messages": USER, "max_tokens": 5}, "fb-1", key)
    assert r.status_code == 200 and "fallback_used" in r.json()["ethen"]["routing"]["reason_codes"]
    lv.script.behaviors.pop("up-beta-small")
    r = _post(lv, {"model": "alpha-large", "messages": USER}, "refused-402", broke_key)
    assert r.status_code == 402, r.text
    r = _post(lv, {"model": "beta-small", "messages": USER, "tools": TOOLS}, "refused-422", key)
    assert r.status_code == 422, r.text
    body = {"model": "alpha-large", "messages": USER, "max_tokens": 5}
    assert "[DONE]" in _stream(lv, body, "stream-1", key)
    assert _post(lv, {"model": "beta-small", "messages": USER}, "unauth-1", "ethen-wrong").status_code == 401
    return rids


def test_request_log_records_every_outcome_and_serves_it(db_url: str) -> None:
    with live_store(db_url) as lv:
        key = new_project_key(lv, "acme")
        broke = new_project_key(lv, "broke", budget_usd=1e-9)
        rids = _traffic(lv, key, broke)
        with admin(lv) as a:
            rows = _wait(lambda: (d := _listing(a)["data"]) and len(d) >= len(rids) and d, "all rows")
            by = {r["request_id"]: r for r in rows}
            assert set(by) == set(rids)
            assert rows[0]["request_id"] == "unauth-1"  # newest first

            ok = by["ok-1"]
            assert ok["project"] == "acme" and ok["key_id"] and ok["key_id"] in key and ok["key_id"] != key
            assert (ok["status"], ok["outcome"], ok["endpoint"], ok["stream"]) == (200, "ok", "chat", False)
            assert (ok["selected_provider"], ok["selected_model"]) == ("beta", "beta-small")
            assert ok["prompt_tokens"] == 11 and ok["completion_tokens"] == 3
            assert ok["cost_usd"] == pytest.approx((11 * 0.05 + 3 * 0.1) / 1e6)
            assert ok["latency_ms"] > 0 and ok["fallback_used"] is False and "receipt" not in ok
            assert ok["attempts"] == [{"candidate": "beta/beta-small", "outcome": "ok", "provider": "beta",
                                       "model": "beta-small", "status": 200,
                                       "latency_ms": ok["attempts"][0]["latency_ms"]}]

            fb = by["fb-1"]
            assert fb["fallback_used"] is True and fb["requested_model"] == "ethen/auto"
            assert (fb["primary_provider"], fb["primary_model"]) == ("beta", "beta-small")
            assert fb["selected_model"] != "beta-small"
            assert [(x["model"], x["outcome"], x["status"]) for x in fb["attempts"]] == [
                ("beta-small", "error", 500), (fb["selected_model"], "ok", 200)]

            assert (by["refused-402"]["status"], by["refused-402"]["error_code"]) == (402, "budget_exceeded")
            assert by["refused-402"]["project"] == "broke" and by["refused-402"]["attempts"] == []
            assert (by["refused-422"]["status"], by["refused-422"]["error_code"]) == (
                422, "no_smart_route_candidate")
            assert by["unauth-1"]["status"] == 401 and by["unauth-1"]["project"] is None

            st = by["stream-1"]
            assert (st["stream"], st["status"], st["outcome"], st["selected_model"]) == (
                True, 200, "ok", "alpha-large")
            assert st["ttft_ms"] is not None and 0 < st["ttft_ms"] <= st["latency_ms"]

            # the full receipt, as the client got it
            r = a.get("/requests/fb-1")
            assert r.status_code == 200
            receipt = r.json()["receipt"]
            assert receipt["primary_model"] == "beta-small" and "fallback_used" in receipt["reason_codes"]
            assert [x["outcome"] for x in receipt["attempts"]] == ["error", "ok"]
            assert a.get("/requests/stream-1").json()["receipt"]["overhead_ms"] >= 0
            assert a.get("/requests/no-such").status_code == 404

            # filters
            assert {r["request_id"] for r in _listing(a, project="acme")["data"]} == {
                "ok-1", "fb-1", "refused-422", "stream-1"}
            assert [r["request_id"] for r in _listing(a, status="402")["data"]] == ["refused-402"]
            assert {r["request_id"] for r in _listing(a, status="error")["data"]} == {
                "refused-402", "refused-422", "unauth-1"}
            assert {r["request_id"] for r in _listing(a, model="ethen/auto")["data"]} == {"fb-1"}
            assert {r["request_id"] for r in _listing(a, model="alpha-large")["data"]} == {
                "stream-1", "refused-402"}
            future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
            assert _listing(a, since=future)["data"] == []
            assert len(_listing(a, until=future)["data"]) == len(rids)
            for bad in ({"status": "teapot"}, {"limit": "0"}, {"limit": "501"}, {"cursor": "x"},
                        {"since": "yesterday"}):
                r = a.get("/requests", params=bad)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", (bad, r.text)

            # keyset pagination: pages of 2 walk every row once, newest first
            seen: list[str] = []
            params: dict[str, Any] = {"limit": 2}
            for _ in range(10):  # bounded
                page = _listing(a, **params)
                seen += [r["request_id"] for r in page["data"]]
                if page["next_cursor"] is None:
                    break
                params["cursor"] = page["next_cursor"]
            assert seen == [r["request_id"] for r in rows]

            # admin only
            assert a.get("/requests", headers={"authorization": f"Bearer {key}"}).status_code == 401
            assert httpx.get(f"{lv.gateway.url}/api/admin/v1/requests/ok-1").status_code == 401

            # no key in any row or receipt
            everything = json.dumps([a.get(f"/requests/{rid}").json() for rid in rids])
        parsed = parse_key(key)  # (the secret may hold "_": rsplit once gave a 1-character "secret")
        assert parsed is not None
        for secret in (key, broke, CLIENT_KEY, PROVIDER_KEY, ADMIN_KEY, parsed.secret):
            assert secret not in everything

        # ethen logs --json reads the same store
        out = subprocess.run([sys.executable, "-m", "ethen", "logs", "--json", "--db", db_url],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert [x["request_id"] for x in lines] == [r["request_id"] for r in reversed(rows)]  # oldest first
        assert lines[1]["receipt"]["primary_model"] == "beta-small"
        out = subprocess.run([sys.executable, "-m", "ethen", "logs", "--db", db_url, "--project", "broke"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "refused-402" in out.stdout and "ok-1" not in out.stdout, out


def _old_rows(n: int, at: datetime, prefix: str) -> list[dict[str, Any]]:
    return [{"request_id": f"{prefix}-{i}", "at": at, "endpoint": "chat", "stream": False, "project": None,
             "key_id": None, "requested_model": "beta-small", "selected_provider": None,
             "selected_model": None,
             "primary_provider": None, "primary_model": None, "fallback_used": False, "canary_hit": None,
             "prompt_tokens": None, "completion_tokens": None, "cost_nano": None, "ttft_ms": None,
             "latency_ms": 1.0, "overhead_ms": None, "status": 200, "outcome": "ok", "error_code": None,
             "attempts": [], "receipt": None} for i in range(n)]


def test_retention_and_max_rows_prune_at_start(db_url: str) -> None:
    now = datetime.now(UTC)

    async def seed(st: Store) -> int:
        await insert_requests(st, _old_rows(4, now - timedelta(days=40), "old"))
        await insert_requests(st, _old_rows(6, now - timedelta(days=2), "recent"))
        return await count_requests(st)

    assert with_store(db_url, seed) == 10
    with live_store(db_url, log={"retention_days": 30, "max_rows": 5}) as lv:
        _wait(lambda: with_store(db_url, count_requests) == 5, "the start-up prune")
        with admin(lv) as a:
            ids = [r["request_id"] for r in _listing(a)["data"]]
        assert ids == [f"recent-{i}" for i in (5, 4, 3, 2, 1)]  # the 40-day-old ones and the oldest recent


def test_memory_ring_without_a_store() -> None:
    with live(log={"memory_rows": 3, "admin_key_sha256": ADMIN_SHA}) as lv:
        for i in range(5):
            assert _post(lv, {"model": "beta-small", "messages": USER}, f"ring-{i}").status_code == 200
        hdr = {"authorization": f"Bearer {ADMIN_KEY}"}
        url = f"{lv.gateway.url}/api/admin/v1/requests"
        # the writer is asynchronous: wait for the last request's row, not only for a full ring
        def listing() -> list[dict[str, Any]]:
            return httpx.get(url, headers=hdr).json()["data"]  # type: ignore[no-any-return]

        rows = _wait(lambda: (d := listing()) and d[0]["request_id"] == "ring-4" and d, "the last row")
        assert [r["request_id"] for r in rows] == ["ring-4", "ring-3", "ring-2"]
        assert rows[0]["key_id"] == "config:test" and rows[0]["project"] is None
        one = httpx.get(f"{url}/ring-3", headers=hdr).json()
        assert one["receipt"]["selected_model"] == "beta-small"
        assert httpx.get(f"{url}/ring-0", headers=hdr).status_code == 404  # rolled out of the ring
        page = httpx.get(url, headers=hdr, params={"limit": 2}).json()
        nxt = httpx.get(url, headers=hdr, params={"limit": 2, "cursor": page["next_cursor"]}).json()
        assert [r["request_id"] for r in page["data"] + nxt["data"]] == ["ring-4", "ring-3", "ring-2"]
        assert httpx.get(url, headers={"authorization": f"Bearer {CLIENT_KEY}"}).status_code == 401


def test_no_admin_key_no_request_routes() -> None:
    with live() as lv:
        r = httpx.get(f"{lv.gateway.url}/api/admin/v1/requests")
        assert r.status_code == 404


def test_full_queue_drops_and_counts_without_blocking() -> None:
    m = GatewayMetrics()
    rl = RequestLog(LogConfig(queue_size=2), m)
    for i in range(5):  # no writer running: the queue fills
        rl.record(RequestRecord(time.time(), f"r{i}", "chat", False, 200, "ok", 0.001))
    assert m.log_dropped._value.get() == 3
    asyncio.run(rl.flush())
    assert [r["request_id"] for r in rl.ring] == ["r0", "r1"]


def test_otel_spans_follow_the_genai_conventions() -> None:
    with live({"up-beta-small": Behavior(fail_status=500)}) as lv:
        exporter = InMemorySpanExporter()
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        gw.requestlog.tracing = Tracing(exporter, batch=False)
        r = _post(lv, {"model": "ethen/auto", "messages": USER, "max_tokens": 5}, "traced-1")
        assert r.status_code == 200
        served = r.json()["ethen"]["routing"]["selected_model"]
        spans = _wait(lambda: len(s := exporter.get_finished_spans()) >= 4 and s, "four spans")
        root = next(s for s in spans if s.parent is None)
        a = dict(root.attributes or {})
        assert root.name == "chat ethen/auto"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "ethen/auto"
        assert a["gen_ai.response.model"] == served
        assert a["gen_ai.provider.name"] == r.json()["ethen"]["routing"]["selected_provider"]
        assert a["gen_ai.usage.input_tokens"] == 11 and a["gen_ai.usage.output_tokens"] == 3
        assert a["ethen.request_id"] == "traced-1" and a["ethen.fallback_used"] is True
        assert a["ethen.routing.primary"] == "beta/beta-small" and a["ethen.cost_usd"] > 0
        children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time or 0)
        assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in children)
        assert all(s.context.trace_id == root.context.trace_id for s in children)
        assert [s.name for s in children] == ["ethen.route", "chat beta-small", f"chat {served}"]
        failed = dict(children[1].attributes or {})
        assert failed["gen_ai.provider.name"] == "beta" and failed["error.type"] == "upstream_server_error"
        assert root.start_time is not None and root.end_time is not None
        assert all(root.start_time <= (s.start_time or 0) <= (s.end_time or 0) <= root.end_time + 10**6
                   for s in children)


def test_otel_request_span_joins_the_callers_w3c_trace() -> None:
    """A ``traceparent`` header makes the request span a child of the caller's span, in the caller's trace
    (``tracestate`` kept); a malformed one starts a new trace; a request without one is a root."""
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with live() as lv:
        exporter = InMemorySpanExporter()
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        gw.requestlog.tracing = Tracing(exporter, batch=False)
        body = {"model": "beta-small", "messages": USER, "max_tokens": 5}
        headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": "tp-1",
                   "traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "vendor=abc"}
        assert httpx.post(f"{lv.base_url}/chat/completions", json=body, headers=headers).status_code == 200
        headers.update({"x-request-id": "tp-2", "traceparent": "00-zz-not-a-trace-01"})
        assert httpx.post(f"{lv.base_url}/chat/completions", json=body, headers=headers).status_code == 200
        spans = _wait(lambda: len(s := exporter.get_finished_spans()) >= 6 and s, "six spans")
        servers = {dict(s.attributes or {})["ethen.request_id"]: s
                   for s in spans if s.kind == SpanKind.SERVER}
        joined, fresh = servers["tp-1"], servers["tp-2"]
        assert joined.context.trace_id == int(trace_id, 16)
        assert joined.parent is not None and joined.parent.span_id == int(span_id, 16)
        assert joined.parent.is_remote and joined.context.trace_state.get("vendor") == "abc"
        assert fresh.parent is None and fresh.context.trace_id != int(trace_id, 16)
        route = next(s for s in spans if s.name == "ethen.route" and s.context.trace_id == int(trace_id, 16))
        assert route.parent is not None and route.parent.span_id == joined.context.span_id


def test_otel_off_by_default() -> None:
    with live() as lv:
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        assert gw.requestlog.tracing is None


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_new_metric_families_after_traffic(tmp_path: Path) -> None:
    canary = {"alias": "ethen/auto", "candidate": "alpha/alpha-large", "percent": 100}
    with live_store(f"sqlite:///{tmp_path / 'm.db'}", canaries=[canary]) as lv:
        key = new_project_key(lv, "acme", budget_usd=5.0)
        r = _post(lv, {"model": "beta-small", "messages": USER, "max_tokens": 5}, "m1", key)
        assert r.status_code == 200
        lv.script.behaviors["up-alpha-large"] = Behavior(fail_status=500)
        for i in range(3):  # the canary target fails: fallbacks, then its circuit opens
            r = _post(lv, {"model": "ethen/auto", "messages": USER, "max_tokens": 5}, f"m-fb-{i}", key)
            assert r.status_code == 200, r.text
        url = f"{lv.base_url}/metrics"

        def scraped() -> str | None:  # the log's task accounts records in order, a batch per linger: all
            text = httpx.get(url).text  # four are in once the last fallback is (the first alone is a race)
            served = _metric(text, "ethen_gateway_fallback_served_total", provider="beta", model="beta-small")
            return text if served == 3 else None

        text = _wait(scraped, "the three fallbacks' metric")
        beta = {"project": "acme", "provider": "beta", "model": "beta-small"}  # m1 and the 3 fallbacks
        assert _metric(text, "ethen_gateway_tokens_total", **beta, direction="input") == 4 * 11
        assert _metric(text, "ethen_gateway_tokens_total", **beta, direction="output") == 4 * 3
        assert _metric(text, "ethen_gateway_cost_usd_total", project="acme", provider="beta",
                       model="beta-small") == pytest.approx(4 * (11 * 0.05 + 3 * 0.1) / 1e6)
        assert _metric(text, "ethen_gateway_attempts_total", provider="alpha", model="alpha-large",
                       outcome="error") == 3
        assert _metric(text, "ethen_gateway_canary_requests_total", candidate="alpha/alpha-large") is not None
        left = _metric(text, "ethen_gateway_budget_remaining_usd", project="acme")
        assert left is not None and 0 < left <= 5.0
        assert _metric(text, "ethen_gateway_circuit_state", circuit="alpha") == 1.0
        assert "ethen_gateway_request_log_dropped_total 0.0" in text


def test_the_log_writes_through_the_ledger_writer(db_url: str) -> None:
    """With a store, the request log's inserts run as transactions of the ledger writer
    (``Admission.write``): on SQLite a second writer connection contended with settlements for the write lock
    and slept in SQLite's busy handler (bench/gateway_scale.py: p99 overhead 67 -> 14 ms at 100 rps)."""
    with live_store(db_url) as lv:
        acc = lv.gateway.server.config.app.state.gateway.accounts
        real = acc.admission.write
        seen: list[str] = []

        async def spy(fn: Callable[..., Any], what: str) -> Any:
            seen.append(what)
            return await real(fn, what)

        acc.admission.write = spy
        body = {"model": "beta-small", "messages": [{"role": "user", "content": "hi"}]}
        for i in range(3):
            headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": f"w-{i}"}
            r = httpx.post(f"{lv.base_url}/chat/completions", timeout=10, headers=headers, json=body)
            assert r.status_code == 200, r.text
        _wait(lambda: "write request log" in seen, "a log batch through the writer")
        want = {f"w-{i}" for i in range(3)}
        with admin(lv) as a:
            _wait(lambda: want <= {r["request_id"] for r in _listing(a)["data"]}, "rows")
