"""Exact costs (issue 26) through a live gateway with a store and a budget: an Anthropic usage with 90k of its
100k input tokens read from the prompt cache settles what genai-prices' own calculation says (cache reads at
0.1x input), not prompt x input price + completion x output price; the receipt and the request log show the
breakdown; the budget that the naive figure would exhaust still admits the next request. Unit checks of
:func:`ethen.gateway.accounting.pricing.cost_of`: cache writes, OpenAI cached tokens, the fallback to route
prices."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from genai_prices import Usage as PriceUsage
from genai_prices import calc_price

from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, ModelInfo, Prices
from tests.gateway.budget_harness import admin, db_url, live_store, new_project_key
from tests.gateway.service_harness import CLIENT_KEY, ROUTES
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, imported from budget_harness

SONNET = {"model": "sonnet", "provider": "gamma", "upstream_model": "claude-sonnet-4-5",
          "info": {**ROUTES[3]["info"], "context_window": 400_000},
          "prices": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}  # fmt: skip
PROMPT, CACHED, OUT = 100_000, 90_000, 3  # the scripted upstream answers 3 pieces: 3 output tokens


def _oracle(**usage: int) -> float:
    return float(calc_price(PriceUsage(**usage), "claude-sonnet-4-5", provider_id="anthropic").total_price)


def _post(lv: Any, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{lv.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


def test_cached_anthropic_usage_settles_genai_prices_figure(db_url: str) -> None:
    exact = _oracle(input_tokens=PROMPT, cache_read_tokens=CACHED, output_tokens=OUT)
    naive = (PROMPT * 3.0 + OUT * 15.0) / 1e6
    assert exact < naive / 4  # what the test tells apart: 0.057 vs 0.300 USD
    behaviors = {"claude-sonnet-4-5": Behavior(prompt_tokens=PROMPT, cache_read_tokens=CACHED)}
    with live_store(db_url, behaviors, routes=[*ROUTES, SONNET]) as lv:
        body = {
            "model": "sonnet",
            "max_tokens": OUT,
            "messages": [{"role": "user", "content": "ab " * 100_000}],
        }
        explain = httpx.post(
            f"{lv.base_url}/routing/explain",
            json=body,
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
            timeout=30,
        ).json()
        est_tokens = explain["requirements"]["estimated_input_tokens"]
        # the report is credible for this request (ethen.gateway.accounting.hold)
        assert 4 * est_tokens + 1024 >= PROMPT
        reserve = explain["chain"][0]["estimated_cost_usd"]
        assert reserve >= naive * 0.9  # the reservation stays the naive upper bound
        budget = reserve + exact + (reserve - exact) / 2
        assert (
            min(naive, reserve) + reserve > budget
        )  # settling the naive figure would refuse the 2nd request
        key = new_project_key(lv, "cached", budget_usd=budget, budget_window="day")
        r = _post(lv, key, body)
        assert r.status_code == 200, r.text
        cost = r.json()["ethen"]["routing"]["cost"]
        assert cost["source"] == "genai-prices" and cost["priced_model"] == "claude-sonnet-4-5"
        assert (cost["input_tokens"], cost["cache_read_tokens"], cost["output_tokens"]) == (
            PROMPT,
            CACHED,
            OUT,
        )
        assert cost["total_usd"] == pytest.approx(exact) and cost["input_usd"] + cost["output_usd"] == (
            pytest.approx(exact)
        )
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}
        with admin(lv) as a:
            settled = a.get("/projects/cached").json()["window"]["settled_usd"]
            assert settled == pytest.approx(exact, abs=1e-8) and settled < naive / 4
        # the second request fits only because the first settled its exact cost (streamed this time)
        with httpx.stream(
            "POST",
            f"{lv.base_url}/chat/completions",
            json={**body, "stream": True},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        ) as s:
            assert s.status_code == 200, s.read()
            frames = [
                json.loads(line[6:])
                for line in s.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        assert frames[-1]["ethen"]["routing"]["cost"]["total_usd"] == pytest.approx(exact)
        rid = r.headers["x-request-id"]
        with admin(lv) as a:
            assert a.get("/projects/cached").json()["window"]["settled_usd"] == pytest.approx(
                2 * exact, abs=1e-8
            )
            row = _logged(a, rid)
            assert row["cost_usd"] == pytest.approx(exact, abs=1e-8)
            assert row["receipt"]["cost"]["cache_read_tokens"] == CACHED
            assert row["receipt"]["cost"]["source"] == "genai-prices"


def _logged(a: httpx.Client, rid: str) -> dict[str, Any]:
    """The request log's row (written off the request path: polled for up to 10 s)."""
    deadline = time.monotonic() + 10
    while (r := a.get(f"/requests/{rid}")).status_code == 404 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    row: dict[str, Any] = r.json()
    return row


def _cand(provider: str, model: str, refs: tuple[str, ...] | None) -> Candidate:
    info = ModelInfo(
        context_window=200_000,
        max_output_tokens=8_000,
        supports_tools=True,
        supports_vision=True,
        quality=0.5,
        latency_ms=500.0,
        ttft_ms=200.0,
    )
    return Candidate(provider, model, info, Prices(3.0, 15.0), price_ref=(refs, model) if refs else None)


def test_cost_of_cache_writes_openai_cached_tokens_and_fallback() -> None:
    sonnet = _cand("gamma", "claude-sonnet-4-5", ("gamma", "anthropic"))
    u = Usage(10_000, 100, cache_write_tokens=8_000)
    c = cost_of(sonnet, u)
    assert c.source == "genai-prices" and c.provider == "anthropic"
    assert c.total_usd == pytest.approx(
        _oracle(input_tokens=10_000, cache_write_tokens=8_000, output_tokens=100)
    )
    assert c.total_usd > (10_000 * 3.0 + 100 * 15.0) / 1e6  # writes cost 1.25x input
    gpt = _cand("openai", "gpt-4o", ("openai",))
    u2 = Usage.from_openai({"prompt_tokens": 1_000_000, "completion_tokens": 0,
                            "prompt_tokens_details": {"cached_tokens": 500_000}})  # fmt: skip
    assert u2 is not None and u2.cache_read_tokens == 500_000
    oracle = float(
        calc_price(
            PriceUsage(input_tokens=1_000_000, cache_read_tokens=500_000), "gpt-4o", provider_id="openai"
        ).total_price
    )
    assert cost_of(gpt, u2).total_usd == pytest.approx(oracle)
    for unknown in (_cand("local", "my-llama", ("local",)), _cand("gamma", "claude-sonnet-4-5", None)):
        c2 = cost_of(unknown, Usage(1_000, 10, cache_read_tokens=900))
        assert c2.source == "route prices" and c2.total_usd == pytest.approx((1_000 * 3.0 + 10 * 15.0) / 1e6)
