"""The ``/ui`` dashboard (issue 14), tested at the HTTP level: Chromium is not installed on this machine
(``/usr/bin/chromium`` absent), so no browser test; the page, its script, and every admin API call the script
makes are checked against a live store-backed gateway after real traffic."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from budget_harness import ADMIN_KEY, live_store, new_project_key
from upstream import Behavior

USER = [{"role": "user", "content": "hello"}]


def test_dashboard_page_and_every_api_it_reads(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'ui.db'}", {"up-beta-small": Behavior(fail_status=500)}) as lv:
        key = new_project_key(lv, "acme", budget_usd=2.0)
        for i, model in enumerate(("ethen/auto", "beta-small", "beta-small", "beta-small")):
            r = httpx.post(f"{lv.base_url}/chat/completions", timeout=15,
                           headers={"authorization": f"Bearer {key}", "x-request-id": f"ui-{i}"},
                           json={"model": model, "messages": USER, "max_tokens": 5})
            # a fallback answers the alias; beta-small alone fails until its circuit opens (then 503)
            assert r.status_code == (200 if i == 0 else 502 if i < 3 else 503), r.text

        page = httpx.get(f"{lv.gateway.url}/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="admin-key"' in page.text and 'type="password"' in page.text
        assert '<script src="/ui/app.js"></script>' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        js = httpx.get(f"{lv.gateway.url}/ui/app.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert "sessionStorage" in js.text and "innerHTML" not in js.text

        # every admin API path the script calls
        called = set(re.findall(r'api\("(/[a-z]+)', js.text))
        assert called == {"/health", "/requests", "/projects", "/usage"}
        base = f"{lv.gateway.url}/api/admin/v1"
        hdr = {"authorization": f"Bearer {ADMIN_KEY}"}
        paths = ("/health", "/requests?limit=50", "/requests/ui-0", "/projects", "/projects/acme", "/usage")
        for path in paths:
            assert httpx.get(base + path.split("?")[0]).status_code == 401, path  # no key: nothing
            assert httpx.get(base + path, headers={"authorization": f"Bearer {key}"}).status_code == 401

        deadline = time.monotonic() + 10
        while True:  # bounded: the request log's writer lags by a batch
            rows: list[dict[str, Any]] = httpx.get(f"{base}/requests", headers=hdr).json()["data"]
            if len(rows) == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # the fields the table and the request view read
        for field in ("at", "request_id", "status", "outcome", "error_code", "project", "requested_model",
                      "selected_provider", "selected_model", "fallback_used", "attempts", "latency_ms",
                      "prompt_tokens", "completion_tokens", "cost_usd"):
            assert all(field in r for r in rows), field
        one = httpx.get(f"{base}/requests/ui-0", headers=hdr).json()
        rc = one["receipt"]
        assert rc["chain"][0] == "beta/beta-small" and isinstance(rc["rejected"], list)
        assert [a["outcome"] for a in one["attempts"]] == ["error", "ok"]
        health = httpx.get(f"{base}/health", headers=hdr).json()
        assert {"circuit": "beta/beta-small", "reason": "candidate_failing"}.items() <= next(
            c for c in health["circuits"] if c["circuit"] == "beta/beta-small").items()
        assert health["nodes"] == [] and "beta" in health["providers"]
        assert health["request_log"] == {"queued": 0, "store": True}
        projects = httpx.get(f"{base}/projects", headers=hdr).json()["data"]
        assert [p["name"] for p in projects] == ["acme"]
        window = httpx.get(f"{base}/projects/acme", headers=hdr).json()["window"]
        assert window["remaining_usd"] <= 2.0
        usage = httpx.get(f"{base}/usage", headers=hdr).json()["data"]
        assert usage and all({"project", "key_id", "model", "requests", "cost_usd"} <= set(u) for u in usage)
