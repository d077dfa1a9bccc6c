"""The dashboard's request page shows a hedged request (issue 27): the hedge in the summary, both attempts
(the cancelled loser and the winner) and the receipt's ``hedge``. Playwright driving Debian's Chromium, as
``tests/admin/test_browser_dashboard.py`` does; skips without them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.budget_harness import ADMIN_KEY, new_project_key, store_cfg
from tests.gateway.hedging.harness import USER, Slow, hedge_live

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is absent (dev extra)")


def test_request_page_shows_the_hedge_and_both_attempts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ui.db'}"
    with hedge_live([{"alias": "ethen/fast", "after_ms": 120}], store=store_cfg(url)) as lv:
        key = new_project_key(lv, "ui", budget_usd=1.0)  # type: ignore[arg-type]
        slow, fast, _ = lv.script_chain(Slow(delay_s=3.0), Slow(delay_s=0.02), key=key)
        body = {"model": "ethen/fast", "messages": USER, "max_tokens": 20}
        r = lv.post(body, key, **{"x-request-id": "ui-hedge"})
        assert r.status_code == 200, r.text
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        deadline = time.monotonic() + 10
        while httpx.get(f"{lv.gateway.url}/api/admin/v1/requests/ui-hedge", headers=admin).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with sync_api.sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page: Any = b.new_context(viewport={"width": 1400, "height": 900}).new_page()
                page.set_default_timeout(15_000)
                page.goto(f"{lv.gateway.url}/ui")
                page.fill("#admin-key", ADMIN_KEY)
                page.click("button[type=submit]")
                page.click("#req-rows tr >> text=ui-hedge")
                page.wait_for_selector("#d-title >> text=Request ui-hedge")
                summary = page.inner_text("#d-summary")
                chain = page.locator("#d-chain li").all_text_contents()
                assert f"hedge fired after 120 ms, won by {chain[1]}, cancelled {chain[0]}" in summary
                attempts = page.locator("#d-attempts tr").all_inner_texts()
                assert len(attempts) == 2 and "cancelled" in attempts[0] and "ok" in attempts[1]
                assert slow[3:] in attempts[0] and fast[3:] in attempts[1]
                assert '"hedge"' in page.inner_text("#d-receipt")
            finally:
                b.close()
