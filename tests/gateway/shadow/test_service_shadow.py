"""Shadow evaluation (issue 27) over real HTTP: a live store-backed gateway (SQLite file) and the scripted
upstream on 127.0.0.1. The client's answer is unchanged, not delayed and never failed by its shadow; pairs are
recorded with agreement; hard gates and the in-flight bound skip shadows, counted."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.shadow.harness import CLIENT_KEY, PRIMARY, SMALL, TOOLS, USER, rule, shadow_live
from tests.gateway.upstream import Behavior

BODY = {"model": "ethen/fast", "messages": USER, "max_tokens": 50}


def test_slow_shadow_neither_delays_nor_changes_the_answer_and_its_pair_is_recorded(tmp_path: Path) -> None:
    behaviors = {"up-alpha-large": Behavior(pieces=("Hello", " there")),
                 "up-beta-tools": Behavior(latency_s=2.0, pieces=("hello", "  THERE"))}
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        t0 = time.perf_counter()
        r = lv.post(BODY)
        elapsed = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "Hello there"  # the primary's, untouched
        assert body["ethen"]["routing"]["selected_provider"] == "alpha"
        assert "shadow" not in json.dumps(body["ethen"]["routing"])  # the receipt does not mention it
        assert elapsed < 1.0, elapsed  # the shadow upstream sleeps 2 s
        assert lv.shadows()["pairs"] == []  # still running
        (pair,) = lv.wait_pairs(1)
        assert pair["request_id"] == r.headers["x-request-id"]
        assert pair["alias"] == "ethen/fast" and pair["primary_candidate"] == PRIMARY
        assert pair["candidate"] == TOOLS and pair["candidate_status"] == pair["primary_status"] == "ok"
        assert pair["candidate_latency_ms"] >= 2000 > pair["primary_latency_ms"]
        assert pair["candidate_ttft_ms"] == pair["candidate_latency_ms"]
        assert pair["primary_prompt_tokens"] == 11 and pair["candidate_completion_tokens"] == 2
        assert pair["primary_cost_nano"] > 0 and pair["candidate_cost_nano"] > pair["primary_cost_nano"]
        assert pair["exact"] is False and pair["similarity"] == 1.0  # same text up to case and whitespace
        assert pair["tool_calls_equal"] is None and pair["schema_valid"] is None and pair["stream"] is False
        assert lv.metric("sent") == 1 and lv.metric("ok") == 1
        shadow_calls = [c for c in lv.script.calls if c["body"]["model"] == "up-beta-tools"]
        assert len(shadow_calls) == 1 and "stream" not in shadow_calls[0]["body"]


def test_failing_shadow_does_not_fail_the_client(tmp_path: Path) -> None:
    behaviors = {"up-beta-tools": Behavior(fail_status=500)}
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        for _ in range(2):
            r = lv.post(BODY)
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == "Hello from upstream"
        pairs = lv.wait_pairs(2)
        assert [p["candidate_status"] for p in pairs] == ["upstream_server_error"] * 2  # its error code
        assert all(p["exact"] is None and p["similarity"] is None for p in pairs)
        assert lv.metric("failed") == 2 and lv.metric("ok") == 0
        summary = lv.shadows(candidate=TOOLS)["data"][0]["summary"]
        assert summary["n"] == 2 and summary["success_rate"] == 0.0 and summary["latency_ratio"] is None


def test_streamed_requests_are_shadowed_with_the_streamed_text(tmp_path: Path) -> None:
    behaviors = {"up-alpha-large": Behavior(pieces=("a", "b", "c")),
                 "up-beta-tools": Behavior(pieces=("a", "b", "d"))}
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        with httpx.stream("POST", f"{lv.base_url}/chat/completions", json={**BODY, "stream": True},
                          headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30) as r:
            assert r.status_code == 200
            text = "".join(
                (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                for line in r.iter_lines() if line.startswith("data: {"))
        assert text == "abc"
        (pair,) = lv.wait_pairs(1)
        assert pair["stream"] is True and pair["candidate_status"] == "ok"
        assert pair["exact"] is False and pair["similarity"] == pytest.approx(2 / 3)
        assert pair["primary_ttft_ms"] is not None and pair["primary_ttft_ms"] <= pair["primary_latency_ms"]
        shadow_calls = [c for c in lv.script.calls if c["body"]["model"] == "up-beta-tools"]
        assert len(shadow_calls) == 1 and not shadow_calls[0]["body"].get("stream")  # buffered


def test_a_candidate_without_tools_is_skipped_with_the_reason(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with shadow_live(tmp_path, [rule(SMALL)]) as lv, caplog.at_level(logging.INFO, "ethen.gateway.shadow"):
        r = lv.post({**BODY, "tools": tools})
        assert r.status_code == 200
        assert lv.metric("skipped_gate") == 1 and lv.metric("sent") == 0
        assert any("no_tool_support" in m for m in caplog.messages), caplog.messages
        assert lv.shadows()["data"][0]["skipped"] == {"skipped_gate:no_tool_support": 1}
        assert not [c for c in lv.script.calls if c["body"]["model"] == "up-beta-small"]
        r = lv.post(BODY)  # without tools the same candidate is shadowed
        assert r.status_code == 200
        (pair,) = lv.wait_pairs(1)
        assert pair["candidate"] == SMALL and lv.wait_metric("sent", 1) == 1


def test_max_in_flight_drops_and_counts(tmp_path: Path) -> None:
    behaviors = {"up-beta-tools": Behavior(latency_s=2.0)}
    with shadow_live(tmp_path, [rule(max_in_flight=1)], behaviors) as lv:
        for _ in range(3):
            assert lv.post(BODY).status_code == 200
        assert lv.wait_metric("sent", 1) == 1 and lv.metric("dropped_in_flight") == 2
        assert lv.shadows()["data"][0]["skipped"] == {"dropped_in_flight": 2}
        assert lv.gw.metrics.shadows_in_flight._value.get() == 1
        pairs = lv.wait_pairs(1)
        lv.wait_idle()
        assert len(pairs) == 1 and lv.gw.metrics.shadows_in_flight._value.get() == 0
        assert lv.post(BODY).status_code == 200  # room again
        assert lv.wait_metric("sent", 2) == 2


def test_agreement_of_tool_calls_and_of_a_json_schema(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    behaviors = {"up-alpha-large": Behavior(pieces=('{"n": 1}',), tool_args='{"a": 1, "b": [2]}'),
                 "up-beta-tools": Behavior(pieces=('{"n": "one"}',), tool_args='{"b": [2], "a": 1}')}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        assert lv.post({**BODY, "tools": tools}).status_code == 200
        (tool_pair,) = lv.wait_pairs(1)
        assert tool_pair["tool_calls_equal"] is True and tool_pair["exact"] is True  # JSON-equal arguments
        rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        assert lv.post({**BODY, "response_format": rf}).status_code == 200
        pairs = lv.wait_pairs(2)
        assert pairs[0]["schema_valid"] is False and pairs[0]["primary_schema_valid"] is True
        summary = lv.shadows()["data"][0]["summary"]
        assert summary["n"] == 2 and summary["tool_calls_equal_rate"] == 1.0
        assert summary["schema_valid_rate"] == 0
        assert summary["exact_rate"] == 0.5


def test_a_shadow_of_another_alias_or_the_primary_itself_is_not_sent(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule(), rule(PRIMARY), {**rule(), "alias": "ethen/coding"}]) as lv:
        assert lv.post(BODY).status_code == 200
        pairs = lv.wait_pairs(1)
        lv.wait_idle()
        assert [p["candidate"] for p in lv.shadows()["pairs"]] == [TOOLS] == [p["candidate"] for p in pairs]
        assert lv.metric("sent") == 1


def test_a_responses_request_is_shadowed_too(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()]) as lv:
        r = httpx.post(f"{lv.base_url}/responses", json={"model": "ethen/fast", "input": "hello there"},
                       headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "Hello from upstream"
        (pair,) = lv.wait_pairs(1)
        assert pair["candidate_status"] == "ok" and pair["exact"] is True  # both: "Hello from upstream"


def test_shutdown_lets_a_running_shadow_finish_and_record(tmp_path: Path) -> None:
    from ethen.store.shadows import ShadowQuery, list_pairs
    from tests.gateway.budget_harness import with_store

    behaviors = {"up-beta-tools": Behavior(latency_s=1.0)}
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        assert lv.post(BODY).status_code == 200
        assert lv.wait_metric("sent", 1) == 1
        db = lv.db
    # the gateway has shut down (its lifespan closed the runner, then the store): the pair is there
    pairs = with_store(db, lambda st: list_pairs(st, ShadowQuery()))
    assert len(pairs) == 1 and pairs[0]["candidate_status"] == "ok"
    assert lv.gw.shadows.closed and not lv.gw.shadows.tasks


def test_every_documented_shadow_outcome_is_exposed_at_zero_from_the_start(tmp_path: Path) -> None:
    """sweep27: ``ethen_gateway_shadows_total`` had no series until each outcome first happened."""
    documented = ("sent", "ok", "failed", "dropped_in_flight", "skipped_gate", "skipped_budget",
                  "skipped_project", "record_failed")  # docs/gateway.md, Shadow evaluation
    with shadow_live(tmp_path, [rule()]) as lv:
        text = httpx.get(f"{lv.base_url}/metrics").text
        for outcome in documented:
            assert f'ethen_gateway_shadows_total{{outcome="{outcome}"}} 0.0' in text, outcome
        assert "ethen_gateway_shadows_in_flight 0.0" in text
