"""Issue 42 item 4 in a real browser (Playwright driving Debian's Chromium, as ``test_browser_dashboard``): a
request refused with 422 ``no_smart_route_candidate`` (its project may not use the provider) shows its
rejected candidate with the reason under "Rejected candidates" and its decision as the receipt (it showed an
empty list and ``{}``). Skips without Chromium or the ``playwright`` package."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from tests.admin.test_browser_dashboard import USER, VIEWPORT, browser, pytestmark
from tests.gateway.budget_harness import ADMIN_KEY, live_store, new_project_key

__all__ = ["browser", "pytestmark"]  # the fixture and the skip, re-exported for pytest


def test_a_refused_request_shows_its_rejections(tmp_path: Path, browser: Any) -> None:
    with live_store(f"sqlite:///{tmp_path / 'b.db'}") as lv:
        url = lv.gateway.url
        key = new_project_key(lv, "gamma-only", allowed_providers=["gamma"])
        r = httpx.post(f"{lv.base_url}/chat/completions", timeout=15,
                       headers={"authorization": f"Bearer {key}", "x-request-id": "ui-refused"},
                       json={"model": "beta-small", "messages": USER})
        assert r.status_code == 422, r.text
        deadline = time.monotonic() + 10
        while True:  # bounded: the request log's writer lags by a batch
            rows = httpx.get(f"{url}/api/admin/v1/requests",
                             headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [x["request_id"] for x in rows] == ["ui-refused"]

        ctx = browser.new_context(viewport=VIEWPORT)
        ctx.set_default_timeout(15_000)
        page = ctx.new_page()
        page.goto(f"{url}/ui")
        page.fill("#admin-key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.click("#req-rows tr >> text=ui-refused")
        page.wait_for_selector("#d-title >> text=Request ui-refused")
        assert page.locator("#d-rejected li").all_text_contents() == ["beta/beta-small: provider_not_allowed"]
        receipt = json.loads(page.inner_text("#d-receipt"))
        assert receipt["requirements"]["model"] == "beta-small" and receipt["chain"] == []
        assert receipt["rejected"] == [{"candidate": "beta/beta-small", "reasons": ["provider_not_allowed"]}]
        ctx.close()
