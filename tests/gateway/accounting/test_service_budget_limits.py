"""Budget limits an upstream or an allow-list cannot get around (issue 10 items 1 and 4), through real HTTP
with a project in the store: over-reported usage settles the reservation (and never overspends under 50
concurrent requests), the reservation covers the model's max output when ``max_tokens`` is unset, and an
exhausted project is a 402 even when a free model exists outside its allow-list."""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from ethen.gateway.accounting.accounts import PROMPT_FACTOR, PROMPT_SLACK_TOKENS, credible_usage, max_cost_usd
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import (
    Candidate,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
    parse_requirements,
)
from ethen.store import Store
from tests.gateway.budget_harness import db_url, held_reserved, live_store, new_project_key, with_store
from tests.gateway.service_harness import CLIENT_KEY, ROUTES
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, imported from budget_harness
MSG = [{"role": "user", "content": "hi"}]
CAND = Candidate("p", "m", ModelInfo(context_window=100_000, max_output_tokens=8_000), Prices(2.0, 10.0))


def _post(lv: Any, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{lv.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


# --- the credibility rule ------------------------------------------------------------------------------


def test_credible_usage_is_bounded_by_what_the_request_allowed() -> None:
    req = parse_requirements({"model": "m", "messages": MSG, "max_tokens": 7})
    prompt_cap = PROMPT_FACTOR * req.input_tokens + PROMPT_SLACK_TOKENS
    assert credible_usage(CAND, Usage(req.input_tokens, 7), req)
    assert not credible_usage(CAND, Usage(req.input_tokens, 8), req)  # over max_tokens
    assert not credible_usage(CAND, Usage(11, 1000), req)  # the upstream
    assert credible_usage(CAND, Usage(prompt_cap, 7), req)
    assert not credible_usage(CAND, Usage(prompt_cap + 1, 7), req)  # far above the prompt estimate
    assert not credible_usage(CAND, Usage(-1, 7), req) and not credible_usage(CAND, Usage(5, -1), req)
    # max_completion_tokens counts like max_tokens (the larger of both); n choices multiply it
    both = parse_requirements({"model": "m", "messages": MSG, "max_tokens": 7, "max_completion_tokens": 9})
    assert credible_usage(CAND, Usage(5, 9), both) and not credible_usage(CAND, Usage(5, 10), both)
    three = parse_requirements({"model": "m", "messages": MSG, "max_tokens": 7, "n": 3})
    assert credible_usage(CAND, Usage(5, 21), three) and not credible_usage(CAND, Usage(5, 22), three)
    # unset: up to the model's max output
    unset = parse_requirements({"model": "m", "messages": MSG})
    assert credible_usage(CAND, Usage(5, 8_000), unset) and not credible_usage(CAND, Usage(5, 8_001), unset)
    # without requirements only the window rule applies (twice the context window in total)
    assert credible_usage(CAND, Usage(100_000, 100_000)) and not credible_usage(CAND, Usage(100_000, 100_001))


def test_max_cost_is_the_estimate_with_max_tokens_and_the_model_max_output_without() -> None:
    ctx = RoutingContext(
        (CAND,), ProjectPolicy(), TelemetrySnapshot(), (), datetime(2026, 1, 1, tzinfo=UTC), "r"
    )
    body = {"model": "m", "messages": MSG, "max_tokens": 7}
    d = decide(body, ctx)
    assert max_cost_usd(CAND, d.requirements) == d.chain[0].estimated_cost_usd
    unset = decide({"model": "m", "messages": MSG}, ctx)
    in_tok = unset.requirements.input_tokens
    assert max_cost_usd(CAND, unset.requirements) == pytest.approx((in_tok * 2.0 + 8_000 * 10.0) / 1e6)
    assert max_cost_usd(CAND, unset.requirements) > unset.chain[0].estimated_cost_usd  # 4,096 default output
    assert max_cost_usd(CAND, parse_requirements({**body, "n": 2})) == pytest.approx(
        (in_tok * 2.0 + 14 * 10.0) / 1e6
    )


# --- over-reported usage, through real HTTP -------------------------------------------------------------

#: alpha-large at $1,200 per million output tokens: the upstream's 1,000 tokens would bill $1.20 per request
PRICEY = [
    {**r, "prices": {"input_per_mtok": 3.0, "output_per_mtok": 1200.0}} if r["model"] == "alpha-large" else r
    for r in ROUTES
]


def test_over_reported_usage_never_overspends(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's run: an upstream reports 1,000 completion tokens for ``max_tokens: 7``; 50 concurrent
    requests (10 of them streamed) on a $1.00 budget settled $60.00. Now each settles its reservation."""
    caplog.set_level(logging.WARNING, logger="ethen.accounts")
    body = {"model": "alpha-large", "messages": MSG, "max_tokens": 7}
    liar = Behavior(pieces=("x",) * 1000)  # usage.completion_tokens = 1,000 (buffered and streamed)
    with live_store(db_url, {"up-alpha-large": liar}, routes=PRICEY) as lv:
        key = new_project_key(lv, "liar", budget_usd=1.0, budget_window="day")
        explain = httpx.post(
            f"{lv.base_url}/routing/explain", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"}
        ).json()
        reservation = explain["chain"][0]["estimated_cost_usd"]
        assert 0 < reservation < 1.0 / 50  # all 50 fit the budget

        async def fire() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=50)) as c:
                return list(
                    await asyncio.gather(
                        *(
                            c.post(
                                f"{lv.base_url}/chat/completions",
                                json={
                                    **body,
                                    **(
                                        {"stream": True, "stream_options": {"include_usage": True}}
                                        if i % 5 == 0
                                        else {}
                                    ),
                                },
                                headers={"authorization": f"Bearer {key}"},
                            )
                            for i in range(50)
                        )
                    )
                )

        responses = asyncio.run(fire())
        assert [r.status_code for r in responses] == [200] * 50
        assert all(r.json()["usage"]["completion_tokens"] == 1000 for r in responses[1:5])  # passed on as is
        metrics = httpx.get(f"{lv.base_url}/metrics").text

        async def check(st: Store) -> tuple[float, list[Any]]:
            return (await st.spend(await st.get_project("liar"))).settled_usd, await st.usage(project="liar")

        settled, rows = with_store(db_url, check)
    print(
        f"over-reported usage: 50 requests settled ${settled:.4f} on $1.00 (reservation ${reservation})"
    )
    assert settled <= 1.0 + reservation
    assert settled == pytest.approx(50 * reservation, rel=1e-6)  # each settled exactly its reservation
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (50, 0, 0)
    ]  # flagged estimates
    assert re.search(r'ethen_gateway_usage_not_credible_total\{provider="alpha"\} 50\.0', metrics), metrics
    warnings = [r.getMessage() for r in caplog.records if "not credible" in r.getMessage()]
    assert len(warnings) == 50 and "1000 completion tokens" in warnings[0] and "at most 7" in warnings[0]


def test_credible_usage_is_billed_as_reported_topped_up_or_capped_by_the_budget(db_url: str) -> None:
    """Within the bounds the upstream's usage is billed as reported. A credible report priced above the
    reservation (prompt tokens above the bytes/3 estimate, e.g. a provider-side preamble) tops the hold up
    from the budget and settles what it really cost (issue 42: it was capped at the reservation); only when
    the budget cannot cover the difference is the reservation settled (counted, never overspent)."""
    body = {"model": "alpha-large", "messages": MSG, "max_tokens": 7}
    with live_store(db_url) as lv:
        req = httpx.post(
            f"{lv.base_url}/routing/explain", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"}
        ).json()
        est_in, reservation = (
            req["requirements"]["estimated_input_tokens"],
            req["chain"][0]["estimated_cost_usd"],
        )
        lv.script.behaviors["up-alpha-large"] = Behavior(pieces=("x",) * 7, prompt_tokens=est_in - 2)
        key = new_project_key(lv, "honest", budget_usd=1.0)
        assert _post(lv, key, body).status_code == 200
        lv.script.behaviors["up-alpha-large"] = Behavior(pieces=("x",) * 7, prompt_tokens=est_in * 3)
        key2 = new_project_key(lv, "preamble", budget_usd=1.0)
        assert _post(lv, key2, body).status_code == 200
        real = (est_in * 3 * 3.0 + 7 * 15.0) / 1e6
        tight = reservation + (real - reservation) / 2  # admits the reservation, not the real cost
        key3 = new_project_key(lv, "tight", budget_usd=tight)
        assert _post(lv, key3, body).status_code == 200
        honest = with_store(db_url, lambda st: st.usage(project="honest"))
        topped = with_store(db_url, lambda st: st.usage(project="preamble"))
        capped = with_store(db_url, lambda st: st.usage(project="tight"))
        metrics = httpx.get(f"{lv.base_url}/metrics").text
        assert held_reserved(lv, "preamble") == 0 and held_reserved(lv, "tight") == 0
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in honest] == [(1, est_in - 2, 7)]
    assert honest[0].cost_usd == pytest.approx(((est_in - 2) * 3.0 + 7 * 15.0) / 1e6, rel=1e-6)
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in topped] == [(1, est_in * 3, 7)]
    assert real > reservation and topped[0].cost_usd == pytest.approx(real, rel=1e-6)
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in capped] == [(1, est_in * 3, 7)]
    assert capped[0].cost_usd == pytest.approx(reservation, rel=1e-6) and capped[0].cost_usd <= tight
    assert "ethen_gateway_usage_not_credible_total{" not in metrics  # all were credible
    assert 'ethen_gateway_settled_capped_total{provider="alpha"} 1.0' in metrics


def test_reservation_covers_the_model_max_output_when_max_tokens_is_unset(db_url: str) -> None:
    """alpha-large: 16,000 max output tokens at $15/Mtok. Without ``max_tokens`` an upstream may credibly
    bill all of them, so the request reserves that; a budget between the 4,096-token routing estimate and it
    is a 402 (it was admitted, then billable beyond its reservation); with ``max_tokens`` it is served."""
    with live_store(db_url) as lv:
        explain = httpx.post(
            f"{lv.base_url}/routing/explain",
            json={"model": "alpha-large", "messages": MSG},
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
        ).json()
        est = explain["chain"][0]["estimated_cost_usd"]
        most = (explain["requirements"]["estimated_input_tokens"] * 3.0 + 16_000 * 15.0) / 1e6
        assert est < most
        key = new_project_key(lv, "unset", budget_usd=(est + most) / 2, budget_window="day")
        r = _post(lv, key, {"model": "alpha-large", "messages": MSG})
        assert r.status_code == 402 and r.json()["error"]["code"] == "budget_exceeded", r.text
        assert "max_tokens" in r.json()["error"]["message"]
        assert (
            _post(lv, key, {"model": "alpha-large", "messages": MSG, "max_tokens": 4096}).status_code == 200
        )


# --- 402 vs 422 for an exhausted project ----------------------------------------------------------------

FREE = {
    **ROUTES[2],
    "model": "beta-free",
    "upstream_model": "up-beta-free",
    "prices": {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
}


def test_exhausted_project_gets_402_even_with_a_free_model_outside_its_allow_list(db_url: str) -> None:
    body = {"model": "ethen/auto", "messages": MSG, "max_tokens": 100}
    with live_store(db_url, routes=[*ROUTES, FREE]) as lv:
        key = new_project_key(
            lv, "pa-only", allowed_providers=["alpha"], budget_usd=0.0001, budget_window="day"
        )
        r = _post(lv, key, body)
        assert r.status_code == 402, r.text
        err = r.json()["error"]
        assert err["code"] == "budget_exceeded"
        reasons = {x["candidate"]: x["reasons"] for x in err["rejections"]}
        assert reasons["alpha/alpha-large"] == ["over_project_budget"]
        assert reasons["beta/beta-free"] == ["provider_not_allowed"]  # free, but not the project's
        assert lv.script.calls == []
        # the same request is served for a project that may use the free model, and for a config key
        both = new_project_key(lv, "both", allowed_providers=["alpha", "beta"], budget_usd=0.0001)
        served = _post(lv, both, body)
        assert (
            served.status_code == 200 and served.json()["ethen"]["routing"]["selected_model"] == "beta-free"
        )
        assert _post(lv, CLIENT_KEY, body).status_code == 200
        # a request no allowed candidate could serve even with budget stays a 422 (not a budget problem)
        r = _post(lv, key, {**body, "max_tokens": 20_000})  # above alpha-large's 16,000 max output
        assert r.status_code == 422 and r.json()["error"]["code"] == "no_smart_route_candidate", r.text
