"""The Anthropic Messages provider over real HTTP: the openai SDK talks to the gateway, the gateway talks the
Messages API to the scripted upstream (``POST /v1/messages``)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.service_harness import PROVIDER_KEY, Live, live
from tests.gateway.upstream import Behavior

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
IMAGE = [
    {"role": "system", "content": "You describe images."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    },
]


@pytest.fixture(scope="module")
def lv() -> Live:
    with live() as running:
        yield running  # type: ignore[misc]


def test_buffered_with_image_is_translated_both_ways(lv: Live) -> None:
    r = lv.client().chat.completions.create(model="gamma-claude", messages=IMAGE, max_tokens=64)
    assert r.choices[0].message.content == "Hello from upstream"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 3)
    assert r.model_extra["ethen"]["routing"]["served_provider"] == "gamma"
    call = lv.script.calls[-1]
    assert call["path"] == "messages"
    assert call["headers"]["x-api-key"] == PROVIDER_KEY and call["headers"]["anthropic-version"]
    sent = call["body"]
    assert (
        sent["model"] == "up-gamma-claude"
        and sent["system"] == "You describe images."
        and sent["max_tokens"] == 64
    )
    assert sent["messages"][0]["content"][1]["source"] == {
        "type": "base64",
        "media_type": "image/png",
        "data": "iVBORw0KGgo=",
    }


def test_buffered_tool_call(lv: Live) -> None:
    r = lv.client().chat.completions.create(
        model="gamma-claude", messages=[{"role": "user", "content": "x?"}], tools=TOOLS
    )
    call = r.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "lookup",
        {"x": 1},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert lv.script.calls[-1]["body"]["tools"][0]["input_schema"]["properties"] == {"x": {"type": "integer"}}


def test_streaming_text_and_usage(lv: Live) -> None:
    chunks = list(
        lv.client().chat.completions.create(
            model="gamma-claude",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from upstream"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 11
    assert chunks[-1].usage.completion_tokens == 3


def test_streaming_tool_call_arguments_assemble(lv: Live) -> None:
    chunks = list(
        lv.client().chat.completions.create(
            model="gamma-claude", messages=[{"role": "user", "content": "x?"}], tools=TOOLS, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == "toolu_1" and deltas[0].function.name == "lookup"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"x": 1}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_anthropic_mid_stream_cut_and_errors() -> None:
    with live({"up-gamma-claude": Behavior(cut_after=1)}) as lv:
        with pytest.raises(openai.APIError) as ei:
            for _ in lv.client().chat.completions.create(
                model="gamma-claude", messages=[{"role": "user", "content": "x"}], stream=True
            ):
                pass
        assert ei.value.code == "upstream_stream_interrupted"
    with live({"up-gamma-claude": Behavior(fail_status=529)}) as lv:
        with pytest.raises(openai.APIStatusError) as ei2:
            lv.client().chat.completions.create(
                model="gamma-claude", messages=[{"role": "user", "content": "x"}]
            )
        assert ei2.value.code == "upstream_server_error"
