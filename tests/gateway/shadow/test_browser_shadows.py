"""The dashboard's Shadows tab (issue 27): the candidate's summary and pairs, a refused promotion (its
reason shown), an accepted one (the canary column). Playwright driving Debian's Chromium, as
``tests/admin/test_browser_dashboard.py`` does; skips without them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.shadow.harness import ADMIN_KEY, TOOLS, USER, rule, shadow_live

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BODY = {"model": "ethen/fast", "messages": USER, "max_tokens": 50}

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is absent (dev extra)")


def test_shadows_tab_summary_pairs_and_promotion(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule(min_samples=2)]) as lv:
        r = lv.post(BODY, **{"x-request-id": "ui-shadow-1"})
        assert r.status_code == 200
        lv.wait_pairs(1)
        with sync_api.sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page: Any = b.new_context(viewport={"width": 1600, "height": 900}).new_page()
                page.set_default_timeout(15_000)
                page.goto(f"{lv.gateway.url}/ui")
                page.fill("#admin-key", ADMIN_KEY)
                page.click("button[type=submit]")
                page.click("nav button[data-tab=shadows]")
                page.wait_for_selector(f"#s-rows tr >> text={TOOLS}")
                cells = page.locator("#s-rows tr").first.locator("td").all_inner_texts()
                assert cells[:5] == ["ethen/fast", TOOLS, "100%", "1", "100%"]
                assert cells[12] == "no: n = 1 < min_samples = 2" and cells[11] == "-"
                assert "ui-shadow-1" in page.inner_text("#s-pairs")
                page.click("#s-rows button >> text=Promote")
                page.wait_for_selector("#s-error >> text=n = 1 < min_samples = 2")
                assert lv.gw.canaries == ()
                assert lv.post(BODY).status_code == 200
                lv.wait_pairs(2)
                page.click("nav button[data-tab=shadows]")  # reload the tab
                page.wait_for_selector("#s-rows td >> text=yes")
                page.select_option("#s-rows select", "20")
                page.click("#s-rows button >> text=Promote")
                page.wait_for_selector("#s-result >> text=is a canary of ethen/fast at 20%")
                page.wait_for_selector("#s-rows td >> text=20%")
                assert [(c.candidate, c.percent) for c in lv.gw.canaries] == [(TOOLS, 20)]
            finally:
                b.close()
