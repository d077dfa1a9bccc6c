"""The Anthropic Messages API inbound (issue 26) with the real ``anthropic`` SDK against a live gateway and
the scripted OpenAI-compatible upstream: create, stream (the exact event order), a tool round trip,
count_tokens, ``x-api-key`` / bearer auth, Anthropic's error envelope and statuses, ``[model_map]`` routing,
the receipt, rate limits, the config's checks."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from ethen.app import create_app
from ethen.gateway.api.messages_http import error_status_and_type, status_of_code
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError, GatewayError
from ethen.gateway.routing import parse_requirements
from tests.gateway.budget_harness import ADMIN_KEY, live_store, new_project_key
from tests.gateway.service_harness import CLIENT_KEY, ENV, ROUTES, Live, config_dict, live
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

MODEL_MAP = {"claude-*haiku*": "beta-small", "claude-*": "ethen/auto", "legacy-tools": "beta/beta-tools"}
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather for a city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                     "cache_control": {"type": "ephemeral"}}]  # fmt: skip
HI: list[Any] = [{"role": "user", "content": "hi"}]
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def lv() -> Live:
    behaviors = {"up-beta-tools": Behavior(answer_tool_results=True),
                 "up-gamma-claude": Behavior(cut_after=1)}  # fmt: skip
    with live(behaviors, model_map=MODEL_MAP) as running:
        yield running  # type: ignore[misc]


def _client(lv: Live, **kw: Any) -> anthropic.Anthropic:
    if "auth_token" not in kw:
        kw.setdefault("api_key", CLIENT_KEY)
    return anthropic.Anthropic(base_url=lv.gateway.url, max_retries=0, timeout=15, **kw)


def _events(lv: Live, body: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str, dict[str, Any]]]:
    """The SSE events as sent: (event name, data), the name checked against the data's type."""
    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream(
        "POST",
        f"{lv.gateway.url}{path}",
        json={**body, "stream": True},
        timeout=15,
        headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                if name not in ("error", "ping"):  # each event validates against the SDK's pydantic types
                    STREAM_EVENT.validate_python(data)
                out.append((name, data))
    return out


def test_create_answers_a_message_with_usage_and_the_receipt(lv: Live) -> None:
    raw = _client(lv).messages.with_raw_response.create(
        model="ethen/auto",
        max_tokens=50,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=HI,
        stop_sequences=["END"],
        metadata={"user_id": "u-7"},
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0.2, "top_k": 5},  # (the SDK 2.x no longer takes them as arguments)
        extra_headers={"anthropic-beta": "made-up-beta-2099-01-01,prompt-caching-2024-07-31"},
    )
    m = raw.parse()
    Message.model_validate(raw.http_response.json())  # strict, unlike the SDK's own parsing
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [(b.type, b.text) for b in m.content if b.type == "text"] == [("text", "Hello from upstream")]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.model == "ethen/auto"
    assert (m.usage.input_tokens, m.usage.output_tokens) == (11, 3)
    assert (m.usage.cache_read_input_tokens, m.usage.cache_creation_input_tokens) == (0, 0)
    routing = m.model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto" and routing["attempts"][0]["outcome"] == "ok"
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    sent = lv.script.calls[-1]["body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 50 and sent["temperature"] == 0.2 and sent["stop"] == ["END"]
    assert sent["user"] == "u-7" and "top_k" not in sent and "metadata" not in sent


def _logged(lv: Live, rid: str) -> dict[str, Any]:
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows = [r for r in list(ring) if r["request_id"] == rid]
        if rows:
            return rows[0]
        time.sleep(0.02)
    raise AssertionError(f"{rid} not in the request log")


def test_the_request_log_records_messages_requests_and_refusals(lv: Live) -> None:
    client = _client(lv)
    client.messages.create(model="claude-3-haiku", max_tokens=5, messages=HI,
                           extra_headers={"x-request-id": "msg-log-ok"})
    row = _logged(lv, "msg-log-ok")
    assert (row["endpoint"], row["status"], row["outcome"]) == ("messages", 200, "ok")
    assert row["key_id"] == "config:test" and row["prompt_tokens"] == 11
    assert row["requested_model"] == row["selected_model"] == "beta-small"  # the routed name
    with client.messages.stream(model="ethen/auto", max_tokens=5, messages=HI,
                                extra_headers={"x-request-id": "msg-log-stream"}) as stream:
        stream.get_final_message()
    assert _logged(lv, "msg-log-stream")["stream"] is True
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=HI,
                               extra_headers={"x-request-id": "msg-log-404"})
    row = _logged(lv, "msg-log-404")
    assert (row["endpoint"], row["status"], row["error_code"]) == ("messages", 404, "model_not_found")


def test_the_api_gateway_prefix_and_beta_query_serve_too(lv: Live) -> None:
    client = anthropic.Anthropic(base_url=f"{lv.gateway.url}/api/gateway", api_key=CLIENT_KEY, max_retries=0)
    assert client.messages.create(model="ethen/auto", max_tokens=5, messages=HI).content[0].type == "text"
    r = httpx.post(
        f"{lv.gateway.url}/v1/messages?beta=true",
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
        json={"model": "ethen/auto", "max_tokens": 5, "messages": HI},
        timeout=15,
    )
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_stream_is_the_exact_event_sequence_and_the_sdk_reads_it(lv: Live) -> None:
    events = _events(lv, {"model": "ethen/auto", "max_tokens": 20, "messages": HI})
    assert [n for n, _ in events] == [
        "message_start", "content_block_start", "ping", *["content_block_delta"] * 3, "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["ethen"]["routing"]["requested_model"] == "ethen/auto"
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert (
        "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "Hello from upstream"
    )
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert (delta["usage"]["input_tokens"], delta["usage"]["output_tokens"]) == (11, 3)
    assert "overhead_ms" in delta["ethen"]["routing"]
    with _client(lv).messages.stream(model="ethen/auto", max_tokens=20, messages=HI) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "text" and final.content[0].text == "Hello from upstream"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3


def test_tool_use_round_trip_buffered_and_streamed(lv: Live) -> None:
    client = _client(lv)
    first = client.messages.create(
        model="beta-tools",
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "auto"},
        messages=[{"role": "user", "content": "Paris?"}],
    )
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"x": 1}
    assert "tools" in first.model_extra["ethen"]["routing"]["hard_requirements"]
    assert lv.script.calls[-1]["body"]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    second = client.messages.create(model="beta-tools", max_tokens=100, tools=TOOLS, messages=[
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          *[b.model_dump(exclude_none=True) for b in first.content]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21C"}]},
    ])  # fmt: skip
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    sent = lv.script.calls[-1]["body"]["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"x": 1}'}}
        ],
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "21C"}
    events = _events(lv, {"model": "beta-tools", "max_tokens": 50, "tools": TOOLS, "messages": HI})
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "get_weather",
        "input": {},
    }
    assert events[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model="beta-tools", max_tokens=50, tools=TOOLS, messages=HI) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"x": 1}


def test_count_tokens_is_the_gateway_estimate(lv: Live) -> None:
    client = _client(lv)
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "system": "Be brief.",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "How warm is Paris today?"}],
    }
    counted = client.messages.count_tokens(**body)
    chat = {"model": "ethen/auto", "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": TOOLS[0]["input_schema"]}}],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": body["messages"][0]["content"]}]}  # fmt: skip
    assert counted.input_tokens == parse_requirements(chat).input_tokens > 0
    longer = client.messages.count_tokens(
        model="ethen/auto", messages=[{"role": "user", "content": "word " * 300}]
    )
    assert longer.input_tokens > counted.input_tokens
    r = httpx.post(
        f"{lv.gateway.url}/v1/messages/count_tokens?beta=true", json={"model": "ethen/auto", "messages": HI}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="gpt-4o", messages=HI)


def test_auth_by_x_api_key_or_bearer_and_refusals(lv: Live) -> None:
    assert _client(lv).messages.create(model="ethen/auto", max_tokens=5, messages=HI).type == "message"
    assert lv.script.calls[-1]["headers"].get("x-api-key") != CLIENT_KEY  # the client's key is not forwarded
    bearer = anthropic.Anthropic(base_url=lv.gateway.url, auth_token=CLIENT_KEY, max_retries=0)
    assert bearer.messages.create(model="ethen/auto", max_tokens=5, messages=HI).type == "message"
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(lv, api_key="ethen-wrong-key").messages.create(model="ethen/auto", max_tokens=5, messages=HI)
    assert info.value.status_code == 401
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["request_id"] == info.value.response.headers["x-request-id"]
    assert CLIENT_KEY not in info.value.response.text


def test_x_api_key_works_on_every_gateway_endpoint(lv: Live) -> None:
    headers = {"x-api-key": CLIENT_KEY}
    assert httpx.get(f"{lv.gateway.url}/v1/models", headers=headers, timeout=15).status_code == 200
    r = httpx.post(f"{lv.gateway.url}/v1/chat/completions", headers=headers, timeout=15,
                   json={"model": "ethen/auto", "messages": HI})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(f"{lv.gateway.url}/v1/routing/explain", headers=headers, timeout=15,
                   json={"model": "ethen/auto", "messages": HI})
    assert r.status_code == 200
    assert httpx.get(f"{lv.gateway.url}/v1/models", timeout=15).status_code == 401


def test_a_bad_body_is_400_invalid_request_error(lv: Live) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(lv).messages.create(model="ethen/auto", max_tokens=0, messages=HI)
    err = info.value.response.json()
    assert info.value.status_code == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == "max_tokens"
    r = httpx.post(
        f"{lv.gateway.url}/v1/messages",
        json={"model": "ethen/auto", "messages": HI},
        timeout=15,
        headers={"x-api-key": CLIENT_KEY},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"
    r = httpx.post(
        f"{lv.gateway.url}/v1/messages",
        content=b"{not json",
        timeout=15,
        headers={"x-api-key": CLIENT_KEY, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_structured_output_is_a_hard_gate_and_reaches_the_upstream(lv: Live) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    m = _client(lv).messages.create(model="ethen/auto", max_tokens=20, messages=HI,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    routing = m.model_extra["ethen"]["routing"]
    assert "structured_output" in routing["hard_requirements"]
    assert "gamma/gamma-claude" not in routing["chain"] and "beta/beta-small" not in routing["chain"]
    sent = lv.script.calls[-1]["body"]
    expected = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert sent["response_format"] == expected


def test_no_candidate_is_400_with_the_rejections(lv: Live) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:  # beta-small has no tools (a hard gate)
        _client(lv).messages.create(model="beta-small", max_tokens=5, messages=HI, tools=TOOLS)
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "no_smart_route_candidate"
    assert err["rejections"][0]["candidate"] == "beta/beta-small"


def test_unknown_model_is_404_not_found_error(lv: Live) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        _client(lv).messages.create(model="gpt-4o", max_tokens=5, messages=HI)
    err = info.value.response.json()["error"]
    assert info.value.status_code == 404 and err["type"] == "not_found_error" and "gpt-4o" in err["message"]


def test_model_map_routes_claude_names_first_match_in_order(lv: Live) -> None:
    client = _client(lv)
    haiku = client.messages.create(model="claude-3-5-haiku-20241022", max_tokens=5, messages=HI)
    assert lv.script.calls[-1]["body"]["model"] == "up-beta-small"
    assert haiku.model == "claude-3-5-haiku-20241022"
    routing = haiku.model_extra["ethen"]["routing"]
    assert routing["model_map"] == {"requested": "claude-3-5-haiku-20241022", "routed_as": "beta-small"}
    sonnet = client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=HI)
    assert sonnet.model_extra["ethen"]["routing"]["requested_model"] == "ethen/auto"
    client.messages.create(model="legacy-tools", max_tokens=5, messages=HI)
    assert lv.script.calls[-1]["body"]["model"] == "up-beta-tools"
    image: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
            ],
        }
    ]
    seen = client.messages.create(model="claude-opus-4", max_tokens=5, messages=image)  # hard gate: vision
    routing = seen.model_extra["ethen"]["routing"]
    assert "vision" in routing["hard_requirements"] and "beta/beta-small" not in routing["chain"]
    call = lv.script.calls[-1]
    sent = call["body"]["messages"][-1]["content"][1]  # a chat upstream's image part, or the block as it came
    assert sent == ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
                    if call["path"] == "chat" else image[0]["content"][1])


def test_a_mid_stream_failure_is_an_error_event(lv: Live) -> None:
    events = _events(lv, {"model": "gamma-claude", "max_tokens": 20, "messages": HI})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    err = events[-1][1]
    assert err["error"]["type"] == "api_error" and err["error"]["code"] == "upstream_stream_interrupted"
    assert err["ethen"]["routing"]["attempts"][-1]["outcome"] == "error"
    with (
        pytest.raises(anthropic.APIStatusError),
        _client(lv).messages.stream(model="gamma-claude", max_tokens=20, messages=HI) as stream,
    ):
        stream.get_final_message()


def test_rate_limits_apply_and_answer_429_rate_limit_error() -> None:
    keys = [{"name": "limited", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest(), "rpm": 1}]
    with live(api_keys=keys) as lv:
        client = _client(lv)
        client.messages.create(model="ethen/auto", max_tokens=5, messages=HI)
        with pytest.raises(anthropic.RateLimitError) as info:
            client.messages.create(model="ethen/auto", max_tokens=5, messages=HI)
    assert info.value.response.json()["error"]["type"] == "rate_limit_error"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_project_keys_and_budgets_apply(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'gw.db'}") as lv:
        rich = new_project_key(lv, "rich", budget_usd=1.0, budget_window="day")
        broke = new_project_key(lv, "broke", budget_usd=0.0, budget_window="day")
        m = _client(lv, api_key=rich).messages.create(model="ethen/auto", max_tokens=5, messages=HI,
                                                      extra_headers={"x-request-id": "msg-project-1"})
        assert m.type == "message" and _logged_store(lv, "msg-project-1")["project"] == "rich"
        with pytest.raises(anthropic.APIStatusError) as info:
            _client(lv, api_key=broke).messages.create(model="ethen/auto", max_tokens=5, messages=HI)
    assert info.value.status_code == 402
    err = info.value.response.json()["error"]
    assert err["type"] == "billing_error" and err["code"] == "budget_exceeded"


def _logged_store(lv: Live, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r = httpx.get(f"{lv.gateway.url}/api/admin/v1/requests/{rid}", timeout=5,
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
        if r.status_code == 200:
            row: dict[str, Any] = r.json()
            return row
        time.sleep(0.05)
    raise AssertionError(f"{rid} not in the request log")


@pytest.mark.parametrize(("status", "out"), [
    (400, (400, "invalid_request_error")), (401, (401, "authentication_error")),
    (402, (402, "billing_error")),
    (403, (403, "permission_error")), (404, (404, "not_found_error")), (413, (413, "request_too_large")),
    (422, (400, "invalid_request_error")), (429, (429, "rate_limit_error")), (500, (500, "api_error")),
    (502, (500, "api_error")), (503, (529, "overloaded_error")), (504, (504, "timeout_error")),
])  # fmt: skip
def test_error_statuses_map_to_anthropics(status: int, out: tuple[int, str]) -> None:
    assert error_status_and_type(status) == out


def test_stream_error_codes_find_their_status() -> None:
    assert status_of_code("upstream_stream_interrupted") == 502
    assert status_of_code("store_unavailable") == 503
    assert status_of_code("no-such-code") == 500
    assert status_of_code(GatewayError.default_code) == 500


@pytest.mark.parametrize(("table", "needle"), [
    ({"claude-*": "ethen/nope"}, "model_map.'claude-*' = 'ethen/nope'"),
    ({"claude-*": "gamma/beta-small"}, "model_map.'claude-*' = 'gamma/beta-small'"),
    ({"claude-*": ""}, "model_map.claude-*"),
    ({"claude-*": 3}, "model_map.claude-*"),
])  # fmt: skip
def test_a_bad_model_map_names_key_and_value(table: dict[str, Any], needle: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse_config(config_dict("http://127.0.0.1:9", model_map=table))
    assert needle in info.value.message


# --- native pass-through to a kind = "anthropic" provider -------------------------------------------

NATIVE_BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5", "max_tokens": 64, "top_k": 7, "metadata": {"user_id": "u-1"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "messages": [
        {"role": "user",
         "content": [{"type": "text", "text": "Paris?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "SIG=="},
                                          {"type": "text", "text": "Let me see."}]},
        {"role": "user", "content": "go on"},
    ],
}  # fmt: skip
BETA = "interleaved-thinking-2025-05-14,made-up-beta-2099-01-01"


@pytest.fixture(scope="module")
def native() -> Live:
    with live(model_map={"claude-*": "gamma-claude"}) as running:
        yield running  # type: ignore[misc]


def test_native_pass_through_keeps_the_body_and_betas_and_returns_the_message_as_is(native: Live) -> None:
    headers = {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01", "anthropic-beta": BETA}
    url = f"{native.gateway.url}/v1/messages?beta=true"
    r = httpx.post(url, json=NATIVE_BODY, timeout=15, headers=headers)
    assert r.status_code == 200, r.text
    call = native.script.calls[-1]
    assert call["path"] == "messages" and call["headers"]["anthropic-beta"] == BETA
    assert call["body"] == {**NATIVE_BODY, "model": "up-gamma-claude"}  # signatures, cache_control, top_k
    msg = r.json()
    assert msg["id"] == "msg_1" and msg["model"] == "up-gamma-claude"  # the upstream's Message as it came
    assert msg["content"] == [{"type": "text", "text": "Hello from upstream"}]
    routing = msg["ethen"]["routing"]
    assert routing["served_provider"] == "gamma" and routing["model_map"]["requested"] == "claude-sonnet-4-5"
    m = _client(native).messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=HI)
    assert m.id == "msg_1" and m.usage.input_tokens == 11


def test_native_stream_is_the_upstreams_events_with_the_receipt(native: Live) -> None:
    events = _events(native, {**NATIVE_BODY, "stream": False})
    assert native.script.calls[-1]["body"] == {**NATIVE_BODY, "model": "up-gamma-claude", "stream": True}
    assert [n for n, _ in events] == [
        "message_start", "content_block_start", "ping", *["content_block_delta"] * 3, "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0][1]["message"]["id"] == "msg_1"
    assert events[0][1]["message"]["ethen"]["routing"]["served_provider"] == "gamma"
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn"}
    assert events[-2][1]["usage"] == {"output_tokens": 3}
    assert "overhead_ms" in events[-2][1]["ethen"]["routing"]
    with _client(native).messages.stream(model="claude-x", max_tokens=20, tools=TOOLS, messages=HI) as stream:
        final = stream.get_final_message()
    assert final.id == "msg_1" and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"x": 1}
    row = _logged(native, _events_rid(native))
    assert row["endpoint"] == "messages" and row["completion_tokens"] == 3 and row["outcome"] == "ok"


def _events_rid(lv: Live) -> str:
    """A streamed native request's id (sent with its own x-request-id), once its stream has ended."""
    body = {**NATIVE_BODY, "stream": True}
    with httpx.stream("POST", f"{lv.gateway.url}/v1/messages", json=body, timeout=15,
                      headers={"x-api-key": CLIENT_KEY, "x-request-id": "native-stream-1"}) as r:
        assert r.status_code == 200
        r.read()
    return "native-stream-1"


WEB_SEARCH: list[Any] = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}, *TOOLS]
DOCUMENT: list[Any] = [{"role": "user", "content": [
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Paris is warm."}},
    {"type": "text", "text": "Summarize."}]}]  # fmt: skip


def test_what_only_anthropic_carries_is_routed_to_anthropic_providers_only(native: Live) -> None:
    client = _client(native)
    m = client.messages.create(model="ethen/auto", max_tokens=50, tools=WEB_SEARCH, messages=DOCUMENT)
    routing = m.model_extra["ethen"]["routing"]
    assert routing["native_only"] == ["messages[0].content[0].type", "tools[0].type"]
    assert routing["chain"] == ["gamma/gamma-claude"] and routing["served_provider"] == "gamma"
    call = native.script.calls[-1]
    assert call["path"] == "messages" and call["body"]["tools"] == WEB_SEARCH
    assert call["body"]["messages"] == DOCUMENT
    counted = client.messages.count_tokens(model="ethen/auto", tools=WEB_SEARCH, messages=DOCUMENT)
    assert counted.input_tokens > 0


def test_without_an_anthropic_provider_it_is_400_unsupported_value() -> None:
    with ServerThread(make_upstream_app(Script())) as up:
        data = config_dict(up.url)
        data["providers"] = [p for p in data["providers"] if p["kind"] != "anthropic"]
        data["routes"] = [r for r in data["routes"] if r["provider"] != "gamma"]
        with ServerThread(create_app(parse_config(data), env=ENV)) as gw:
            client = anthropic.Anthropic(base_url=gw.url, api_key=CLIENT_KEY, max_retries=0, timeout=15)
            with pytest.raises(anthropic.BadRequestError) as info:
                client.messages.create(model="ethen/auto", max_tokens=5, messages=HI, tools=WEB_SEARCH)
    err = info.value.response.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unsupported_value",
                                                        "tools[0].type")


def test_a_native_request_falls_back_to_a_chat_provider_by_translation() -> None:
    backup = {**next(r for r in ROUTES if r["model"] == "gamma-claude"), "provider": "beta",
              "upstream_model": "up-beta-fallback",
              "prices": {"input_per_mtok": 50.0, "output_per_mtok": 90.0}}  # ranked after gamma
    backup["info"] = {**backup["info"], "quality": 0.1, "latency_ms": 5000.0}
    failing = {"up-gamma-claude": Behavior(fail_status=500)}
    with live(failing, routes=[*ROUTES, backup], model_map={"claude-*": "gamma-claude"}) as lv:
        m = _client(lv).messages.create(**{k: v for k, v in NATIVE_BODY.items() if k != "top_k"})
        routing = m.model_extra["ethen"]["routing"]
        assert [a["candidate"] for a in routing["attempts"]] == ["gamma/gamma-claude", "beta/gamma-claude"]
        assert routing["served_provider"] == "beta" and m.content[0].text == "Hello from upstream"
        paths = [(c["path"], c["body"]["model"]) for c in lv.script.calls]
        assert paths == [("messages", "up-gamma-claude"), ("chat", "up-beta-fallback")]
        assert lv.script.calls[-1]["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
        events = _events(lv, NATIVE_BODY)
    assert [n for n, _ in events][:3] == ["message_start", "content_block_start", "ping"]
    assert events[-2][1]["ethen"]["routing"]["served_provider"] == "beta"
