"""Fallback execution, streaming rules and telemetry feedback, against scripted upstreams over real HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def explain(lv: Live, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{lv.base_url}/routing/explain", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lv: Live, body: dict[str, object]) -> list[tuple[str | None, str]]:
    """(event name, data) of every SSE event of a streamed call, read raw."""
    out: list[tuple[str | None, str]] = []
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", json=body, headers=AUTH, timeout=15) as r:
        assert r.status_code == 200
        event: str | None = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, line[6:]))
                event = None
    return out


def test_primary_500_falls_back_to_next_candidate() -> None:
    with live({"up-beta-small": Behavior(fail_status=500)}) as lv:
        r = lv.client().chat.completions.create(model="ethen/auto", messages=USER)
        routing = r.model_extra["ethen"]["routing"]
        assert routing["primary_model"] == "beta-small"  # the decision's primary failed ...
        next_provider, next_model = routing["chain"][1].split("/", 1)  # ... and the next one answered:
        assert (routing["selected_provider"], routing["selected_model"]) == (next_provider, next_model)
        assert routing["served_model"] == next_model and routing["reason_codes"][-1] == "fallback_used"
        first, second = routing["attempts"]
        assert first["candidate"] == "beta/beta-small" and first["outcome"] == "error"
        assert first["error_class"] == "server_error" and first["upstream_status"] == 500
        assert second["outcome"] == "ok"
        assert lv.script.models_called() == ["up-beta-small", "up-" + routing["served_model"]]
        recs = lv.store.records("beta", "beta-small")
        assert len(recs) == 1 and not recs[0].success and recs[0].error_class == "server_error"
        served = routing["chain"][1].split("/", 1)
        ok = lv.store.records(*served)
        assert ok[0].success and ok[0].fallback and ok[0].prompt_tokens == 11 and ok[0].cost_usd > 0


def test_429_falls_back_and_streaming_falls_back_before_first_byte() -> None:
    with live({"up-beta-small": Behavior(fail_status=429)}) as lv:
        chunks = list(lv.client().chat.completions.create(model="ethen/auto", messages=USER, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from upstream"
        attempts = chunks[-1].model_extra["ethen"]["routing"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["error", "ok"]
        assert attempts[0]["error_class"] == "rate_limited"


def test_timeout_falls_back() -> None:
    timeouts = {"connect_s": 1.0, "first_byte_s": 0.3, "total_s": 2.0}
    with live({"up-beta-small": Behavior(latency_s=1.5)}, timeouts=timeouts) as lv:
        r = lv.client().chat.completions.create(model="ethen/auto", messages=USER)
        attempts = r.model_extra["ethen"]["routing"]["attempts"]
        assert attempts[0]["error_class"] == "timeout" and attempts[0]["code"] == "upstream_timeout"
        assert 250 <= attempts[0]["latency_ms"] < 1400
        assert attempts[1]["outcome"] == "ok"


def test_stream_first_byte_timeout_falls_back() -> None:
    timeouts = {"connect_s": 1.0, "first_byte_s": 0.3, "total_s": 2.0}
    with live({"up-beta-small": Behavior(ttft_s=1.5)}, timeouts=timeouts) as lv:
        chunks = list(lv.client().chat.completions.create(model="ethen/auto", messages=USER, stream=True))
        attempts = chunks[-1].model_extra["ethen"]["routing"]["attempts"]
        assert [a.get("error_class") for a in attempts] == ["timeout", None]


def test_connection_refused_falls_back() -> None:
    with live() as lv:
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        from ethen.gateway.providers.openai_compat import OpenAICompatProvider

        dead = OpenAICompatProvider("beta", "http://127.0.0.1:9/v1")
        gw.providers["dead"] = dead  # closed with the others at shutdown
        for cid, target in list(gw.executor.targets.items()):
            if target.candidate.provider == "beta":
                gw.executor.targets[cid] = type(target)(target.candidate, dead, target.upstream_model)
        r = lv.client().chat.completions.create(model="ethen/auto", messages=USER)
        attempts = r.model_extra["ethen"]["routing"]["attempts"]
        assert attempts[0]["error_class"] == "connect_error"
        assert attempts[-1]["outcome"] == "ok" and not attempts[-1]["candidate"].startswith("beta/")


def test_three_failures_exclude_the_provider_from_later_decisions() -> None:
    # no probe, no trial during the test (circuits: test_service_circuit.py)
    no_recovery = {"probe": False, "cooldown_s": 300, "max_cooldown_s": 300}
    with live({"up-beta-small": Behavior(fail_status=503)}, circuit=no_recovery) as lv:
        c = lv.client()
        for _ in range(3):  # concrete model: its pool is that one route, so each request is one failure
            with pytest.raises(openai.APIStatusError) as ei:
                c.chat.completions.create(model="beta-small", messages=USER)
            assert ei.value.status_code == 502 and ei.value.code == "upstream_server_error"
        d = explain(lv, {"model": "ethen/auto", "messages": USER})
        rejected = {rj["candidate"]: rj["reasons"] for rj in d["rejected"]}  # type: ignore[union-attr]
        assert "provider_failing" in rejected["beta/beta-small"]
        assert "provider_failing" in rejected["beta/beta-tools"]
        calls = len(lv.script.calls)
        r = c.chat.completions.create(model="ethen/auto", messages=USER)
        assert r.model_extra["ethen"]["routing"]["selected_provider"] != "beta"
        assert len(r.model_extra["ethen"]["routing"]["attempts"]) == 1
        assert all(not m.startswith("up-beta") for m in lv.script.models_called()[calls:])
        with pytest.raises(openai.InternalServerError) as ei2:  # an outage, not the client's fault (issue 10)
            c.chat.completions.create(model="beta-small", messages=USER)
        assert ei2.value.status_code == 503 and ei2.value.code == "no_healthy_candidate"


def test_mid_stream_cut_ends_with_an_error_event_not_a_clean_end() -> None:
    with live({"up-beta-small": Behavior(cut_after=1)}) as lv:
        events = sse_events(lv, {"model": "ethen/auto", "messages": USER, "stream": True})
        assert events[-1][0] == "error"
        err = json.loads(events[-1][1])
        assert err["error"]["code"] == "upstream_stream_interrupted"
        assert err["ethen"]["routing"]["attempts"][-1]["error_class"] == "stream_cut"
        assert all(data != "[DONE]" for _, data in events)
        contents = [json.loads(d)["choices"][0]["delta"].get("content") for _, d in events[:-1]]
        assert contents == ["", "Hello"]  # the first byte was sent, so no fallback happened
        assert lv.script.models_called() == ["up-beta-small"]
        rec = lv.store.records("beta", "beta-small")[-1]
        assert not rec.success and rec.stream and rec.stream_completed is False
        # the official SDK surfaces it as an error carrying our code
        with pytest.raises(openai.APIError) as ei:
            for _ in lv.client().chat.completions.create(model="ethen/auto", messages=USER, stream=True):
                pass
        assert ei.value.code == "upstream_stream_interrupted"


def test_tools_request_never_lands_on_a_non_tools_model_even_when_all_tool_models_fail() -> None:
    failing = {m: Behavior(fail_status=500) for m in ("up-alpha-large", "up-beta-tools", "up-gamma-claude")}
    with live(failing) as lv:
        with pytest.raises(openai.APIStatusError) as ei:
            lv.client().chat.completions.create(model="ethen/auto", messages=USER, tools=TOOLS)
        assert ei.value.status_code == 502 and ei.value.code == "all_candidates_failed"
        body = ei.value.body
        assert isinstance(body, dict)
        tried = [a["candidate"] for a in body["attempts"]]
        assert sorted(tried) == ["alpha/alpha-large", "beta/beta-tools", "gamma/gamma-claude"]
        assert "up-beta-small" not in lv.script.models_called()
        assert "beta/beta-small" in ei.value.message or "failed" in ei.value.message


def test_request_caused_4xx_is_not_retried_elsewhere() -> None:
    with live({"up-beta-small": Behavior(fail_status=400)}) as lv:
        with pytest.raises(openai.BadRequestError) as ei:
            lv.client().chat.completions.create(model="ethen/auto", messages=USER)
        assert ei.value.code == "upstream_bad_request"
        assert "scripted failure 400" in ei.value.message
        assert lv.script.models_called() == ["up-beta-small"]
        assert lv.store.records("beta", "beta-small") == ()  # not evidence against the provider


def test_upstream_401_is_operator_side_and_falls_back() -> None:
    with live({"up-beta-small": Behavior(fail_status=401)}) as lv:
        r = lv.client().chat.completions.create(model="ethen/auto", messages=USER)
        assert r.model_extra["ethen"]["routing"]["attempts"][0]["error_class"] == "rejected"


def test_canary_acceptance_is_computed_from_live_telemetry() -> None:
    canary = {
        "alias": "ethen/auto",
        "candidate": "alpha/alpha-large",
        "percent": 100,
        "min_success_rate": 0.5,
        "min_samples": 2,
    }
    with live(canaries=[canary]) as lv:
        c = lv.client()
        seen = []
        for _ in range(3):
            r = c.chat.completions.create(model="ethen/auto", messages=USER)
            routing = r.model_extra["ethen"]["routing"]
            assert routing["selected_model"] == "alpha-large" and "canary_promoted" in routing["reason_codes"]
            seen.append(routing["canary"]["acceptance_met"])
        assert seen == [False, False, True]


def _keys(value: object) -> list[str]:
    if isinstance(value, dict):
        return [k for k, v in value.items() for k in (k, *_keys(v))]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_http_receipt_holds_no_telemetry_internals() -> None:
    """The receipt the shell sends (core receipt + attempts + canary block), after a fallback and a canary
    promotion with telemetry behind it: no key names a telemetry statistic or a credential."""
    canary = {"alias": "ethen/auto", "candidate": "alpha/alpha-large", "percent": 100,
              "min_success_rate": 0.5, "min_samples": 2}
    with live({"up-alpha-large": Behavior(fail_status=500, fail_times=1)}, canaries=[canary]) as lv:
        c = lv.client()
        answers = [c.chat.completions.create(model="ethen/auto", messages=USER) for _ in range(3)]
        receipts = [a.model_extra["ethen"]["routing"] for a in answers]
        assert "fallback_used" in receipts[0]["reason_codes"] and len(receipts[0]["attempts"]) == 2
        assert receipts[-1]["canary"]["acceptance_met"] is True
        keys = {k for routing in receipts for k in _keys(routing)}
        for fragment in ("samples", "success", "mean", "api_key", "credential", "endpoint", "base_url",
                         "project", "request_id"):
            assert not [k for k in keys if fragment in k], (fragment, keys)
        # each attempt's own latency is there (issue 4: candidate, outcome, error class, latency)
        assert all("latency_ms" in a for a in receipts[0]["attempts"])


def test_telemetry_records_stream_completion_and_ttft() -> None:
    with live({"up-beta-small": Behavior(ttft_s=0.05)}) as lv:
        list(lv.client().chat.completions.create(model="ethen/auto", messages=USER, stream=True))
        rec = lv.store.records("beta", "beta-small")[-1]
        assert rec.success and rec.stream and rec.stream_completed is True
        assert rec.ttft_ms is not None and rec.ttft_ms >= 45
        assert rec.completion_tokens == 3 and rec.latency_ms >= rec.ttft_ms
