"""Issue 10, items 3, 5 and 6 over real HTTP (gateway and scripted upstream on 127.0.0.1, the openai SDK):

* an outage is a 503 ``no_healthy_candidate`` with ``Retry-After`` and the rejection reasons; a request no
  configured model can serve stays a 422;
* an upstream down for 10 s then back is routed to again within 15 s (the default circuit: probes through
  the half-open circuit), while requests that have a healthy alternative never go to it during the outage;
* a client naming the failing model exactly gets one live trial after the cool-down (probes off);
* failed attempts, fallbacks and circuit transitions are logged at WARNING with the request id, the
  candidate and the reason, never a secret (the upstream here echoes the credential it received).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import openai
import pytest

from tests.gateway.service_harness import CLIENT_KEY, PROVIDER_KEY, live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
NO_RECOVERY = {"probe": False, "cooldown_s": 300, "max_cooldown_s": 300}


def routing(resp: Any) -> dict[str, Any]:
    return resp.model_extra["ethen"]["routing"]  # type: ignore[no-any-return]


def rid(value: str) -> dict[str, str]:
    return {"x-request-id": value}


def no_secret(records: list[logging.LogRecord]) -> None:
    for rec in records:
        text = rec.getMessage()
        assert PROVIDER_KEY not in text and CLIENT_KEY not in text and "SECRET" not in text


def test_outage_is_503_with_retry_after_and_reasons_not_a_client_error() -> None:
    with live({"up-beta-small": Behavior(fail_status=503)}, circuit=NO_RECOVERY) as lv:
        c = lv.client()
        for _ in range(3):
            with pytest.raises(openai.APIStatusError):
                c.chat.completions.create(model="beta-small", messages=USER)
        with pytest.raises(openai.InternalServerError) as ei:
            c.chat.completions.create(model="beta-small", messages=USER)
        err = ei.value
        assert err.status_code == 503 and err.code == "no_healthy_candidate"
        retry_after = int(err.response.headers["retry-after"])
        assert 290 <= retry_after <= 300  # the circuit's cool-down (300 s here) is what is left to wait
        body = err.response.json()["error"]
        assert body["retry_after_s"] == retry_after and body["type"] == "api_error"
        assert body["rejections"] == [
            {"candidate": "beta/beta-small", "reasons": ["provider_failing", "candidate_failing"]}
        ]
        # a request no configured model can serve is still the client's: 422, no Retry-After
        with pytest.raises(openai.UnprocessableEntityError) as ei2:
            c.chat.completions.create(model="beta-small", messages=USER, tools=TOOLS)  # type: ignore[arg-type]
        assert ei2.value.code == "no_smart_route_candidate"
        assert "retry-after" not in ei2.value.response.headers


def test_upstream_down_10_s_then_back_is_routed_to_again_within_15_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    down = Behavior(fail_status=503, echo_credentials=True)
    with live({"up-alpha-large": down}) as lv:  # default [circuit]: 2 s cool-down doubling to 10 s, probes
        c = lv.client()
        first = c.chat.completions.create(model="ethen/best", messages=USER)
        assert routing(first)["chain"][0] == "alpha/alpha-large" and len(routing(first)["chain"]) > 1
        served: list[str] = []
        t_down = time.monotonic()
        while time.monotonic() - t_down < 10.0:  # the outage: clients are served by the alternatives
            r = c.chat.completions.create(model="ethen/best", messages=USER)
            served.append(routing(r)["served_provider"])
            time.sleep(0.1)
        live_calls = [x for x in lv.script.calls if x["body"]["model"] == "up-alpha-large"]
        probes = [x for x in live_calls if x["body"].get("max_tokens") == 1]
        # requests with an alternative never went to the failing provider beyond the gate's 3 samples
        assert len(live_calls) - len(probes) == 3  # `first` + 2 in the loop: the third tripped the gate
        assert "alpha" not in served and 1 <= len(probes) <= 4
        assert all(p["body"]["messages"] == [{"role": "user", "content": "ping"}] for p in probes)

        down.fail_status = None  # the upstream is back
        t_back = time.monotonic()
        back_after: float | None = None
        while time.monotonic() - t_back < 15.0:
            r = c.chat.completions.create(model="ethen/best", messages=USER)
            if routing(r)["served_provider"] == "alpha":
                back_after = time.monotonic() - t_back
                assert [a["outcome"] for a in routing(r)["attempts"]] == ["ok"]
                break
            time.sleep(0.1)
        assert back_after is not None and back_after <= 15.0

    messages = [r.getMessage() for r in caplog.records]
    no_secret(caplog.records)
    fails = [m for m in messages if "attempt 1 on alpha/alpha-large failed: upstream_server_error" in m]
    assert len(fails) == 3 and all("upstream status 503); falling back to beta/" in m for m in fails)
    assert len([m for m in messages if "served by fallback" in m]) == 3
    assert any(m.startswith("circuit open: alpha excluded from routing (provider_failing") for m in messages)
    assert any(m.startswith("circuit closed: alpha is routed to again (a trial succeeded)") for m in messages)
    trial_fails = [m for m in messages if "trial failed (request probe-" in m]
    assert trial_fails and len(trial_fails) <= 2 * len(probes)  # once per failed probe and circuit key
    assert len([m for m in messages if m.startswith("circuit open: alpha ")]) == 1  # not once per request


def test_exact_model_gets_one_live_trial_after_the_cool_down() -> None:
    down = Behavior(fail_status=503)
    circuit = {"probe": False, "cooldown_s": 1.0, "max_cooldown_s": 8.0}
    with live({"up-beta-small": down}, circuit=circuit) as lv:
        c = lv.client()
        for _ in range(3):
            with pytest.raises(openai.APIStatusError):
                c.chat.completions.create(model="beta-small", messages=USER)
        with pytest.raises(openai.InternalServerError) as ei:
            c.chat.completions.create(model="beta-small", messages=USER)
        assert ei.value.code == "no_healthy_candidate" and ei.value.response.headers["retry-after"] == "1"
        time.sleep(1.1)
        # half-open, upstream still down: the trial goes through and fails; the cool-down doubles
        with pytest.raises(openai.APIStatusError) as ei:
            c.chat.completions.create(model="beta-small", messages=USER)
        assert ei.value.status_code == 502 and ei.value.code == "upstream_server_error"
        with pytest.raises(openai.InternalServerError) as ei:
            c.chat.completions.create(model="beta-small", messages=USER)
        assert ei.value.response.headers["retry-after"] == "2"
        calls = len(lv.script.calls)
        down.fail_status = None
        time.sleep(2.1)
        r = c.chat.completions.create(model="beta-small", messages=USER)
        assert routing(r)["served_provider"] == "beta"
        assert "circuit_half_open_trial" in routing(r)["reason_codes"]
        assert len(lv.script.calls) == calls + 1  # one trial request, no probe
        # the trial's success lifted the gate: the next request is an ordinary one
        r = c.chat.completions.create(model="beta-small", messages=USER)
        assert "circuit_half_open_trial" not in routing(r)["reason_codes"]


def test_streamed_trial_closes_the_circuit() -> None:
    down = Behavior(fail_status=503)
    with live({"up-beta-small": down}, circuit={"probe": False, "cooldown_s": 0.5}) as lv:
        c = lv.client()
        for _ in range(3):
            with pytest.raises(openai.APIStatusError):
                c.chat.completions.create(model="beta-small", messages=USER)
        down.fail_status = None
        time.sleep(0.6)
        chunks = list(c.chat.completions.create(model="beta-small", messages=USER, stream=True))
        terminal = chunks[-1].model_extra["ethen"]["routing"]  # type: ignore[index]
        assert "circuit_half_open_trial" in terminal["reason_codes"]
        r = c.chat.completions.create(model="beta-small", messages=USER)
        assert "circuit_half_open_trial" not in routing(r)["reason_codes"]


def test_failed_attempts_are_logged_once_each_with_what_happened_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    leaky = {"echo_credentials": True}
    behaviors = {
        "up-beta-small": Behavior(fail_status=500, **leaky),  # type: ignore[arg-type]
        "up-gamma-claude": Behavior(fail_status=400, **leaky),  # type: ignore[arg-type]
    }
    with live(behaviors, circuit=NO_RECOVERY) as lv:
        c = lv.client()
        with pytest.raises(openai.APIStatusError):  # one candidate: nothing to fall back to
            c.chat.completions.create(model="beta-small", messages=USER, extra_headers=rid("rid-1"))
        with pytest.raises(openai.BadRequestError):  # the request caused it: not retried elsewhere
            c.chat.completions.create(model="gamma-claude", messages=USER, extra_headers=rid("rid-2"))
        with pytest.raises(openai.APIStatusError):  # streamed, before the first chunk
            list(c.chat.completions.create(
                model="beta-small", messages=USER, stream=True, extra_headers=rid("rid-3")
            ))  # fmt: skip
    execute = [r for r in caplog.records if r.name == "ethen.gateway.api.execute"]
    assert all(r.levelno == logging.WARNING for r in execute)
    lines = {r.getMessage().split(":")[0]: r.getMessage() for r in execute}
    assert lines["request rid-1"] == (
        "request rid-1: attempt 1 on beta/beta-small failed: upstream_server_error (server_error, upstream "
        "status 500); no candidate left"
    )
    assert lines["request rid-2"].startswith("request rid-2: attempt 1 on gamma/gamma-claude failed: ")
    assert lines["request rid-2"].endswith("not retried (the request caused it)")
    assert "attempt 1 on beta/beta-small failed: upstream_server_error" in lines["request rid-3"]
    assert len(execute) == 3
    no_secret(caplog.records)  # the upstream's messages echo the credential: they are never logged


def test_requests_refused_during_an_outage_do_not_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """The circuit logs its opening once; each 503 no_healthy_candidate after it writes no line of its own."""
    caplog.set_level(logging.WARNING)
    with live({"up-beta-small": Behavior(fail_status=503)}, circuit=NO_RECOVERY) as lv:
        c = lv.client()
        for _ in range(3):
            with pytest.raises(openai.APIStatusError):
                c.chat.completions.create(model="beta-small", messages=USER)
        before = len(caplog.records)
        for i in range(20):
            with pytest.raises(openai.InternalServerError) as ei:
                c.chat.completions.create(model="beta-small", messages=USER, extra_headers=rid(f"flood-{i}"))
            assert ei.value.code == "no_healthy_candidate"
    flood = [r.getMessage() for r in caplog.records[before:] if "flood-" in r.getMessage()]
    assert flood == []


@pytest.mark.parametrize("model", ["ethen/best", "alpha-large"])  # with a healthy alternative; sole provider
def test_a_probe_stuck_on_a_hanging_upstream_does_not_keep_a_recovered_primary_out(model: str) -> None:
    """Issue 23 item 3: the primary fails (its circuit opens, traffic goes to the fallback), then hangs
    (the probe sent then gets no answer), then recovers. Before, the stuck probe held the circuit's trial
    slot for the provider's whole read timeout (60 s here, ``total_s`` 300 s by default): with a fallback no
    live request takes a trial, so the primary stayed out until its failures left the 300 s window. Now a
    probe is bounded (3 s): the recovered primary is served again within 15 s, with or without an
    alternative."""
    down = Behavior(fail_status=503)
    timeouts = {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 300.0}
    with live({"up-alpha-large": down}, timeouts=timeouts) as lv:  # default [circuit]: probes on
        c = lv.client(timeout=90)
        for _ in range(3):  # the gate trips: alpha's circuit opens
            try:
                r = c.chat.completions.create(model=model, messages=USER)
                assert routing(r)["served_provider"] != "alpha"
            except openai.APIStatusError as exc:
                assert model == "alpha-large", exc
        down.fail_status, down.latency_s = None, 120.0  # alpha now hangs
        deadline = time.monotonic() + 10.0

        def probes() -> int:
            return len([x for x in lv.script.calls
                        if x["body"]["model"] == "up-alpha-large" and x["body"].get("max_tokens") == 1])

        hung = probes()
        while probes() == hung:  # bounded: the deadline
            assert time.monotonic() < deadline, "no probe reached the hanging upstream"
            time.sleep(0.05)
        time.sleep(0.5)
        down.latency_s = 0.0  # alpha is back; the probe sent while it hung is still waiting
        t_back = time.monotonic()
        back_after: float | None = None
        while time.monotonic() - t_back < 15.0:  # bounded
            try:
                r = c.chat.completions.create(model=model, messages=USER)
            except openai.APIStatusError as exc:  # sole provider: 503 until its circuit lets a trial through
                assert model == "alpha-large" and exc.status_code == 503, exc
            else:
                if routing(r)["served_provider"] == "alpha":
                    back_after = time.monotonic() - t_back
                    break
            time.sleep(0.2)
        assert back_after is not None and back_after <= 15.0, back_after
