"""Hedged requests (issue 27) through the real gateway over HTTP, against a scripted upstream on 127.0.0.1
that records which connections the gateway closed before the answer ended."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.gateway.hedging.harness import CLIENT_KEY, USER, HedgeLive, Slow, hedge_live

FAST = [{"alias": "ethen/fast", "after_ms": 150}]


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "ethen/fast", "messages": USER, "max_tokens": 50, **kw}


def stream_events(lv: HedgeLive, b: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", json={**b, "stream": True},
                      headers={"authorization": f"Bearer {lv_key()}", **headers}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def lv_key() -> str:
    return CLIENT_KEY


def test_buffered_hedge_fires_after_the_delay_and_the_faster_wins_and_the_loser_is_closed() -> None:
    with hedge_live(FAST) as lv:
        slow, fast, _ = lv.script_chain(Slow(delay_s=4.0), Slow(delay_s=0.05))
        t0 = time.monotonic()
        r = lv.post(body())
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "Hello from upstream"
        routing = r.json()["ethen"]["routing"]
        assert routing["served_model"] == fast.removeprefix("up-")
        hedge = routing["hedge"]
        assert hedge["fired"] is True and hedge["after_ms"] == 150
        assert hedge["winner"] == routing["chain"][1]
        assert hedge["cancelled"] == [routing["chain"][0]]
        outcomes = [(a["candidate"], a["outcome"]) for a in routing["attempts"]]
        assert outcomes == [(routing["chain"][0], "cancelled"), (routing["chain"][1], "ok")]
        assert elapsed < 2.0  # not the slow one's 4 s
        # sweep27: the receipt said fallback_used ("the primary failed") though nothing failed
        assert "hedge_won" in routing["reason_codes"] and "fallback_used" not in routing["reason_codes"]
        assert routing["primary_model"] == slow.removeprefix("up-")
        assert lv.up.calls == [slow, fast]
        assert lv.up.wait_closed(slow)  # the loser's upstream connection was closed by the gateway
        assert lv.metric("fired") == 1 and lv.metric("won") == 1 and lv.metric("lost") == 0
        # the cancelled loser is no provider failure: nothing recorded for it in the telemetry store
        p, m = routing["chain"][0].split("/", 1)
        assert lv.gw.store.records(p, m) == ()


def test_stream_hedge_fires_and_the_first_content_token_wins_and_the_loser_is_closed() -> None:
    with hedge_live(FAST) as lv:
        slow, fast, _ = lv.script_chain(Slow(delay_s=4.0), Slow(delay_s=0.05, pieces=("Fast", " one")))
        t0 = time.monotonic()
        events = stream_events(lv, body())
        assert time.monotonic() - t0 < 2.0
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices"))
        assert text == "Fast one"
        routing = events[-1]["ethen"]["routing"]
        assert routing["hedge"]["fired"] is True and routing["hedge"]["winner"] == routing["chain"][1]
        assert routing["hedge"]["cancelled"] == [routing["chain"][0]]
        assert [a["outcome"] for a in routing["attempts"]] == ["cancelled", "ok"]
        assert "hedge_won" in routing["reason_codes"] and "fallback_used" not in routing["reason_codes"]
        assert lv.up.wait_closed(slow)
        assert fast not in lv.up.closed


def test_the_first_attempt_answering_before_the_delay_sends_no_hedge() -> None:
    with hedge_live(FAST) as lv:
        first, _, _ = lv.script_chain(Slow(delay_s=0.01), Slow())
        r = lv.post(body())
        hedge = r.json()["ethen"]["routing"]["hedge"]
        assert hedge == {"fired": False, "after_ms": 150, "winner": r.json()["ethen"]["routing"]["chain"][0],
                         "cancelled": [], "reasons": ["after_ms"]}
        time.sleep(0.3)
        assert lv.up.calls == [first] and lv.metric("fired") == 0


def test_primary_wins_the_race_and_the_hedge_is_cancelled() -> None:
    with hedge_live(FAST) as lv:
        first, second, _ = lv.script_chain(Slow(delay_s=0.4), Slow(delay_s=4.0))
        r = lv.post(body())
        routing = r.json()["ethen"]["routing"]
        assert routing["served_model"] == first.removeprefix("up-")
        assert routing["hedge"]["fired"] and routing["hedge"]["cancelled"] == [routing["chain"][1]]
        assert lv.up.wait_closed(second)
        assert lv.metric("lost") == 1 and lv.metric("won") == 0


def test_no_hedge_fires_after_a_4xx_and_the_other_attempt_is_cancelled() -> None:
    # max_extra 2: the hedge (2nd) answers 400 -> the request ends with it; the 3rd is never sent
    with hedge_live([{"alias": "ethen/fast", "after_ms": 100, "max_extra": 2}]) as lv:
        slow, bad, third = lv.script_chain(Slow(delay_s=4.0), Slow(status=400), Slow())
        r = lv.post(body())
        assert r.status_code == 400, r.text
        time.sleep(0.4)  # longer than a second delay
        assert lv.up.calls == [slow, bad]
        assert third not in lv.up.calls
        assert lv.up.wait_closed(slow)


def test_a_4xx_before_the_delay_ends_the_request_without_a_hedge() -> None:
    with hedge_live(FAST) as lv:
        bad, _, _ = lv.script_chain(Slow(status=400), Slow())
        assert lv.post(body()).status_code == 400
        time.sleep(0.3)
        assert lv.up.calls == [bad] and lv.metric("fired") == 0


@pytest.mark.parametrize("max_extra", [1, 2])
def test_max_extra_is_respected(max_extra: int) -> None:
    with hedge_live([{"alias": "ethen/fast", "after_ms": 100, "max_extra": max_extra}]) as lv:
        a, b, c = lv.script_chain(Slow(delay_s=0.9), Slow(delay_s=0.9), Slow(delay_s=0.01))
        r = lv.post(body())
        routing = r.json()["ethen"]["routing"]
        if max_extra == 1:
            assert lv.up.calls == [a, b] and routing["served_model"] == a.removeprefix("up-")
            assert lv.metric("fired") == 1
        else:  # the 2nd hedge goes 100 ms after the first one, to the third candidate, which answers at once
            assert lv.up.calls == [a, b, c] and routing["served_model"] == c.removeprefix("up-")
            assert lv.metric("fired") == 2 and lv.metric("won") == 1 and lv.metric("lost") == 1
            assert sorted(routing["hedge"]["cancelled"]) == sorted(routing["chain"][:2])


@pytest.mark.parametrize("value", ["off", "OFF", "Off"])
def test_client_opt_out_header_sends_no_hedge(value: str) -> None:
    with hedge_live(FAST) as lv:
        slow, _, _ = lv.script_chain(Slow(delay_s=0.5), Slow())
        r = lv.post(body(), **{"x-ethen-hedge": value})
        hedge = r.json()["ethen"]["routing"]["hedge"]
        assert hedge["fired"] is False and "opt_out" in hedge["reasons"]
        assert lv.up.calls == [slow]
        assert lv.metric("skipped_opt_out") == 1 and lv.metric("fired") == 0


def test_a_retryable_failure_before_the_delay_falls_back_and_the_fallback_may_be_hedged() -> None:
    with hedge_live(FAST) as lv:
        bad, slow, fast = lv.script_chain(Slow(status=500), Slow(delay_s=4.0), Slow(delay_s=0.01))
        r = lv.post(body())
        routing = r.json()["ethen"]["routing"]
        assert [a["outcome"] for a in routing["attempts"]] == ["error", "cancelled", "ok"]
        assert lv.up.calls == [bad, slow, fast]
        assert routing["hedge"]["fired"] and routing["served_model"] == fast.removeprefix("up-")
        assert "fallback_used" in routing["reason_codes"]  # the primary did fail
        assert "hedge_won" not in routing["reason_codes"]
        assert lv.up.wait_closed(slow)


def test_an_alias_without_a_rule_has_no_hedge_key_and_no_hedge() -> None:
    with hedge_live(FAST) as lv:
        chain = lv.chain("ethen/cheap")
        lv.up.behaviors[chain[0]] = Slow(delay_s=0.4)
        r = lv.post(body(model="ethen/cheap"))
        assert "hedge" not in r.json()["ethen"]["routing"]
        assert lv.up.calls == [chain[0]]


DOCUMENTED_HEDGE_OUTCOMES = ("fired", "won", "lost", "failed", "skipped_budget", "skipped_no_next_candidate",
                             "skipped_opt_out", "skipped_min_samples")  # docs/gateway.md, Hedged requests


def test_every_documented_hedge_outcome_is_exposed_at_zero_from_the_start() -> None:
    """sweep27: the series appeared only once each outcome first happened (and the docs named the skip
    label ``skipped_no_candidate`` while the code counted ``skipped_no_next_candidate``)."""
    with hedge_live(FAST) as lv:
        text = httpx.get(f"{lv.base_url}/metrics").text
        for outcome in DOCUMENTED_HEDGE_OUTCOMES:
            assert f'ethen_gateway_hedges_total{{outcome="{outcome}"}} 0.0' in text, outcome


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_endpoint_exposes_the_hedges_counter_and_a_won_hedge_is_no_fallback(stream: bool) -> None:
    with hedge_live(FAST) as lv:
        _, fast, _ = lv.script_chain(Slow(delay_s=2.0), Slow(delay_s=0.01))
        if stream:
            assert stream_events(lv, body())[-1]["ethen"]["routing"]["hedge"]["fired"] is True
        else:
            assert lv.post(body()).status_code == 200
        text = httpx.get(f"{lv.base_url}/metrics").text
        assert 'ethen_gateway_hedges_total{outcome="fired"} 1.0' in text
        assert 'ethen_gateway_hedges_total{outcome="won"} 1.0' in text
        # sweep27: the hedge that won was also counted as a fallback (ethen_gateway_fallbacks_total and the
        # telemetry record's fallback flag); nothing failed, so there was no fallback
        assert "ethen_gateway_fallbacks_total{" not in text
        provider = {"up-hx": "alpha", "up-hy": "beta", "up-hz": "gamma"}[fast]
        model = fast.removeprefix("up-")
        deadline = time.monotonic() + 5  # a stream's attempt is recorded when the relay ends it
        while not lv.gw.store.records(provider, model) and time.monotonic() < deadline:
            time.sleep(0.02)
        (rec,) = lv.gw.store.records(provider, model)
        assert rec.success and rec.fallback is False


def test_after_percentile_waits_for_min_samples_then_hedges_at_that_percentile_of_recent_ttft() -> None:
    rule = [{"alias": "ethen/fast", "after_percentile": 90, "min_samples": 5}]
    with hedge_live(rule) as lv:
        first, second, _ = lv.script_chain(Slow(delay_s=0.02), Slow(delay_s=0.02))
        r = lv.post(body())  # no sample yet: no delay, no hedge
        hedge = r.json()["ethen"]["routing"]["hedge"]
        # the four keys are always there (sweep27: after_ms was left out when no delay applied)
        assert {"fired", "after_ms", "winner", "cancelled"} <= hedge.keys()
        assert hedge["fired"] is False and hedge["after_ms"] is None and "min_samples" in hedge["reasons"]
        assert hedge["winner"] == r.json()["ethen"]["routing"]["chain"][0] and hedge["cancelled"] == []
        assert lv.metric("skipped_min_samples") == 1
        for _ in range(5):
            assert lv.post(body()).status_code == 200
        p, m = r.json()["ethen"]["routing"]["chain"][0].split("/", 1)
        samples = lv.gw.hedger.ttft_samples(p, m)
        assert len(samples) == 6
        expected = sorted(samples)[-(-90 * 6 // 100) - 1]  # nearest rank
        lv.up.behaviors[first] = Slow(delay_s=3.0)
        r = lv.post(body())
        hedge = r.json()["ethen"]["routing"]["hedge"]
        assert hedge["fired"] is True and hedge["after_ms"] == round(expected, 3)
        assert r.json()["ethen"]["routing"]["served_model"] == second.removeprefix("up-")
        assert lv.up.wait_closed(first)
        # the cancelled loser left a censored sample (the time it ran, >= the delay), not a failure
        assert len(lv.gw.hedger.ttft_samples(p, m)) == 7 and max(lv.gw.hedger.ttft_samples(p, m)) >= expected
        assert all(rec.success for rec in lv.gw.store.records(p, m))


def test_the_responses_endpoint_is_hedged_too() -> None:
    with hedge_live(FAST) as lv:
        slow, fast, _ = lv.script_chain(Slow(delay_s=4.0), Slow(delay_s=0.02))
        req = {"model": "ethen/fast", "input": "hello", "max_output_tokens": 50}
        r = httpx.post(f"{lv.base_url}/responses", json=req, headers={"authorization": f"Bearer {lv_key()}"},
                       timeout=30)
        assert r.status_code == 200, r.text
        hedge = r.json()["ethen"]["routing"]["hedge"]
        assert hedge["fired"] is True and hedge["winner"] == r.json()["ethen"]["routing"]["chain"][1]
        assert lv.up.calls == [slow, fast] and lv.up.wait_closed(slow)
