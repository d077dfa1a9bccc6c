"""The dashboard shows the prompt cache (issue 45 item 4) in Debian's Chromium (Playwright; never
``playwright install``): a store-backed gateway, a scripted Anthropic upstream billing cache reads and
writes; the request's page says how many tokens were read and written and what the reads saved (genai-prices'
figures), and the Spend tab's usage table has the same per project, key and model. A request without a cache
read says $0 saved. Screenshots go to ``$ETHEN_TEST_ARTIFACTS/dashboard`` (else the test's tmp_path).

Skips, with the reason, without Chromium or the ``playwright`` package."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from genai_prices import Usage as PriceUsage
from genai_prices import calc_price

from tests.gateway.budget_harness import ADMIN_KEY, live_store, new_project_key
from tests.gateway.service_harness import ROUTES
from tests.gateway.upstream import Behavior

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODEL = "claude-sonnet-4-5"
SONNET = {"model": "sonnet", "provider": "gamma", "upstream_model": MODEL,
          "info": {**ROUTES[3]["info"], "context_window": 400_000},
          "prices": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}  # fmt: skip
PROMPT, READ, WRITE = 5_000, 4_000, 600
SYSTEM = "You are a coding agent. " * 250  # ~1.5k estimated tokens: the usage is credible

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install "
                                "chromium; .ci/run does it)")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is absent (dev extra)")


@pytest.fixture()
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _input_usd(**usage: int) -> float:
    return float(calc_price(PriceUsage(**usage), MODEL, provider_id="anthropic").input_price)


def test_request_page_and_usage_table_show_cache_tokens_and_savings(tmp_path: Path, browser: Any) -> None:
    saved = _input_usd(input_tokens=PROMPT, cache_write_tokens=WRITE) - _input_usd(
        input_tokens=PROMPT, cache_read_tokens=READ, cache_write_tokens=WRITE)
    shots = Path(os.environ.get("ETHEN_TEST_ARTIFACTS") or tmp_path) / "dashboard"
    shots.mkdir(parents=True, exist_ok=True)
    behaviors = {MODEL: Behavior(prompt_tokens=PROMPT, cache_read_tokens=READ, cache_write_tokens=WRITE,
                                 tool_call=False)}
    with live_store(f"sqlite:///{tmp_path / 'c.db'}", behaviors, routes=[*ROUTES, SONNET]) as lv:
        url = lv.gateway.url
        key = new_project_key(lv, "agents", budget_usd=5.0)
        for rid, model in (("ui-cached", "sonnet"), ("ui-plain", "alpha-large")):
            r = httpx.post(f"{lv.base_url}/chat/completions", timeout=15,
                           headers={"authorization": f"Bearer {key}", "x-request-id": rid},
                           json={"model": model, "max_tokens": 20, "messages": [
                               {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while True:  # bounded: the request log's writer lags by a batch
            rows = httpx.get(f"{url}/api/admin/v1/requests",
                             headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
            if len(rows) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(rows) == 2

        ctx = browser.new_context(viewport={"width": 1400, "height": 900})
        ctx.set_default_timeout(15_000)
        page = ctx.new_page()
        page.goto(f"{url}/ui")
        page.fill("#admin-key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("#req-rows tr >> text=ui-cached")

        page.click("#req-rows tr >> text=ui-cached")
        page.wait_for_selector("#d-title >> text=Request ui-cached")
        sync_api.expect(page.locator("#d-cache")).to_have_text(
            f"prompt cache: {READ} tokens read, {WRITE} written (of {PROMPT} prompt tokens) · "
            f"saved ${saved:.6f}")
        page.screenshot(path=str(shots / "prompt-cache-request.png"), full_page=True)
        page.click("#req-rows tr >> text=ui-plain")
        page.wait_for_selector("#d-title >> text=Request ui-plain")
        plain = page.inner_text("#d-cache")
        assert plain.startswith("prompt cache: 0 tokens read, 0 written") and "saved $0.000000" in plain

        page.click("nav button[data-tab=spend]")
        row = page.locator("#usage tr", has_text="sonnet")
        row.wait_for()
        cells = row.locator("td").all_inner_texts()
        assert cells[5:8] == [f"{READ}/{WRITE}", cells[6], f"{saved:.6f}"] and float(cells[6]) > 0
        page.screenshot(path=str(shots / "prompt-cache-usage.png"), full_page=True)
