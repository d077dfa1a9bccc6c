"""``POST /responses`` (issue 15) with the official ``openai`` SDK against a live gateway and the scripted
upstream: buffered and streamed answers, a function-call round trip, image input, ``text.format``
json_schema, every refusal, ``base_url=.../v1``; each body and stream event validated against the OpenAPI
description."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    }
]
IMAGE_INPUT: list[Any] = [
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
        ],
    }
]
CITY_JSON = ('{"city": ', '"Paris"}')


class City(BaseModel):
    city: str


@pytest.fixture(scope="module")
def lv() -> Live:
    # beta-tools answers a tool result with text (round trip) and its text is JSON (text.format)
    behaviors = {"up-beta-tools": Behavior(answer_tool_results=True, pieces=CITY_JSON)}
    with live(behaviors) as running:
        yield running  # type: ignore[misc]


def _valid(name: str, obj: Any) -> None:
    errors = sorted(validator(name).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].path)}"


def _raw_events(lv: Live, body: dict[str, Any], base: str | None = None) -> list[dict[str, Any]]:
    """The SSE events as sent (event name checked against the data's type), each validated."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base or lv.base_url}/responses", json={**body, "stream": True},
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=15) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name
                _valid("ResponseStreamEvent", ev)
                events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_buffered_text_answer_is_a_valid_response_with_the_receipt(lv: Live) -> None:
    raw = lv.client().responses.with_raw_response.create(
        model="ethen/auto", input="Summarize this transcript", instructions="Be brief.", max_output_tokens=50,
        temperature=0.2, metadata={"trace": "t1"},
    )
    r = raw.parse()
    assert r.output_text == "Hello from upstream" and r.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (11, 3, 14)
    assert r.instructions == "Be brief." and r.max_output_tokens == 50 and r.metadata == {"trace": "t1"}
    routing = r.model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto" and routing["attempts"][0]["outcome"] == "ok"
    assert float(raw.headers["x-ethen-overhead-ms"]) >= 0 and raw.headers["x-request-id"]
    _valid("Response", raw.http_response.json())
    sent = lv.script.calls[-1]["body"]  # the chat body the upstream got
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Summarize this transcript"},
    ]
    assert sent["max_completion_tokens"] == 50 and sent["temperature"] == 0.2
    assert sent["metadata"] == {"trace": "t1"}


def test_streamed_text_answer_events_in_order(lv: Live) -> None:
    events = list(lv.client().responses.create(model="ethen/auto", input="hi", stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from upstream"
    done = events[-1].response
    assert done.output_text == "Hello from upstream"
    assert done.usage is not None and done.usage.output_tokens == 3
    routing = done.model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto" and "overhead_ms" in routing
    raw = _raw_events(lv, {"model": "ethen/auto", "input": "hi"})
    assert [e["type"] for e in raw] == types
    assert "ethen" in raw[-1]["response"] and all("ethen" not in e.get("response", {}) for e in raw[:-1])


def test_function_call_round_trip_buffered_and_streamed(lv: Live) -> None:
    client = lv.client()
    first = client.responses.create(model="beta-tools", input="Weather in Paris?", tools=TOOLS,
                                    tool_choice="auto")
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"x": 1}'
    routing = first.model_extra["ethen"]["routing"]
    assert "tools" in routing["hard_requirements"]
    assert lv.script.calls[-1]["body"]["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                          "parameters": TOOLS[0]["parameters"], "strict": False}}
    ]
    follow_up: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'},
    ]
    second = client.responses.create(model="beta-tools", input=follow_up, tools=TOOLS)
    assert second.output_text == '{"city": "Paris"}'
    sent = lv.script.calls[-1]["body"]["messages"]
    assert sent[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"x": 1}'}}]}
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}
    # streamed: the call arrives as function_call_arguments events
    events = _raw_events(lv, {"model": "beta-tools", "input": "Weather?", "tools": TOOLS})
    types = [e["type"] for e in events]
    assert types[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert events[4]["arguments"] == '{"x": 1}' and events[4]["name"] == "get_weather"
    assert events[-1]["response"]["output"][0]["call_id"] == "call_1"
    streamed_second = _raw_events(lv, {"model": "beta-tools", "input": follow_up, "tools": TOOLS})
    assert streamed_second[-1]["response"]["output"][0]["content"][0]["text"] == '{"city": "Paris"}'


def test_image_input_routes_to_a_vision_model(lv: Live) -> None:
    r = lv.client().responses.create(model="ethen/auto", input=IMAGE_INPUT)
    routing = r.model_extra["ethen"]["routing"]
    assert "vision" in routing["hard_requirements"] and routing["selected_model"] != "beta-small"
    part = lv.script.calls[-1]["body"]["messages"][0]["content"][1]
    assert part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=",
                                                       "detail": "low"}}


def test_text_format_json_schema_is_structured_output(lv: Live) -> None:
    parsed = lv.client().responses.parse(model="ethen/auto", input="Where?", text_format=City)
    assert parsed.output_parsed == City(city="Paris")
    routing = parsed.model_extra["ethen"]["routing"]
    assert "structured_output" in routing["hard_requirements"]
    fmt = lv.script.calls[-1]["body"]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["schema"]["properties"] == {"city": {"title": "City", "type": "string"}}
    r = httpx.post(f"{lv.base_url}/responses", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                   json={"model": "ethen/auto", "input": "x", "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 200 and r.json()["text"] == {"format": {"type": "json_object"}}
    assert lv.script.calls[-1]["body"]["response_format"] == {"type": "json_object"}
    _valid("Response", r.json())


def test_base_url_ending_in_v1_works_for_every_endpoint(lv: Live) -> None:
    client = openai.OpenAI(base_url=f"{lv.gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=15)
    assert client.responses.create(model="ethen/auto", input="hi").output_text == "Hello from upstream"
    chat = client.chat.completions.create(model="ethen/auto", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "Hello from upstream"
    assert "ethen/auto" in [m.id for m in client.models.list()]
    assert httpx.get(f"{lv.gateway.url}/v1/healthz").json() == {"status": "ok"}
    assert "ethen_gateway_requests_total" in httpx.get(f"{lv.gateway.url}/v1/metrics").text
    r = httpx.post(f"{lv.gateway.url}/v1/routing/explain", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                   json={"model": "ethen/auto", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert _raw_events(lv, {"model": "ethen/auto", "input": "hi"}, f"{lv.gateway.url}/v1")[-1]["type"] == (
        "response.completed"
    )


# --- refusals --------------------------------------------------------------------------------------------


def test_no_candidate_is_422_with_rejections(lv: Live) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        lv.client().responses.create(model="beta-small", input=IMAGE_INPUT)
    assert ei.value.code == "no_smart_route_candidate"
    body = ei.value.body
    assert isinstance(body, dict) and body["rejections"][0]["candidate"] == "beta/beta-small"
    with pytest.raises(openai.UnprocessableEntityError):  # also when streaming: before the stream starts
        lv.client().responses.create(model="beta-small", input=IMAGE_INPUT, stream=True)


def test_bad_key_is_401(lv: Live) -> None:
    for key in ("ethen-wrong-key", "sk-not-ours"):
        with pytest.raises(openai.AuthenticationError) as ei:
            lv.client(key=key).responses.create(model="ethen/auto", input="hi")
        assert ei.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"tools": [{"type": "custom", "name": "p"}]}, "tools[0].type", "unsupported_value"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "unsupported_value"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input[0].content[0].file_id", "unsupported_value"),
        ({"input": None}, "input", "missing_required_parameter"),
        ({"input": 5}, "input", "invalid_type"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "invalid_value"),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"metadata": {"routing": {"latency_target": "warp"}}}, "metadata.routing.latency_target",
         "invalid_value"),
    ],
)
def test_invalid_or_unsupported_fields_are_400_naming_the_field(
    lv: Live, extra: dict[str, Any], param: str, code: str
) -> None:
    before = len(lv.script.calls)
    r = httpx.post(f"{lv.base_url}/responses", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                   json={"model": "ethen/auto", "input": "hi", **extra})
    assert r.status_code == 400, r.text
    _valid("ErrorResponse", r.json())
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    assert len(lv.script.calls) == before
    assert "store" not in extra or "response store" in r.json()["error"]["message"]


def test_store_false_and_background_false_are_accepted(lv: Live) -> None:
    r = lv.client().responses.create(model="ethen/auto", input="hi", store=False, background=False)
    assert r.store is False and r.output_text == "Hello from upstream"


def test_stream_cut_after_first_chunk_ends_with_an_error_event() -> None:
    with live({"up-beta-small": Behavior(cut_after=1)}) as lv:
        events = _raw_events(lv, {"model": "beta-small", "input": "hi"})
    assert events[-1]["type"] == "error" and events[-1]["code"]
    assert events[-1]["ethen"]["routing"]["selected_model"] == "beta-small"
    assert not any(e["type"] == "response.completed" for e in events)
    assert [e["type"] for e in events if e["type"] == "response.output_text.delta"]
