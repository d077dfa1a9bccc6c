"""``kind = "gemini"`` over real HTTP (issue 26): the openai SDK (chat, Responses) and the anthropic SDK
(Messages) talk to the gateway, the gateway talks the native Gemini API to a scripted upstream
(:mod:`upstream_cloud`): requests and answers translated both ways, streamed and not, tools, usage with cached
and thoughts tokens, finish reasons, a blocked prompt, errors."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from ethen.gateway.providers.gemini_wire import gemini_schema, to_gemini
from tests.gateway.service_harness import CLIENT_KEY, PROVIDER_KEY, Live
from tests.gateway.upstream_cloud import CloudBehavior, live_cloud

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look x up",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": ["integer", "null"]}},
                "required": ["x"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
    }
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}  # fmt: skip
SIG = "Cp8+Ab/x9Q=="  # a thoughtSignature (standard base64: "+", "/" and padding)
IMAGE: list[Any] = [
    {"role": "system", "content": "You describe images."},
    {"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def lv() -> Live:
    behaviors = {
        "up-gem-flash": CloudBehavior(
            cached_tokens=4, thoughts_tokens=5, answer_tool_results=True, signature=SIG
        )
    }
    with live_cloud(behaviors) as running:
        yield running  # type: ignore[misc]


def _sent(lv: Live) -> dict[str, Any]:
    call = lv.script.calls[-1]
    assert call["path"].startswith("gemini:") and call["headers"]["x-goog-api-key"] == PROVIDER_KEY
    assert "authorization" not in call["headers"]
    return call


def test_buffered_chat_translates_request_and_answer(lv: Live) -> None:
    r = lv.client().chat.completions.create(
        model="gem-flash",
        messages=IMAGE,
        max_tokens=64,
        temperature=0.2,
        top_p=0.9,
        stop=["END"],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
        },
    )
    assert r.choices[0].message.content == "Hello from upstream" and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 3 + 5)
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 4
    assert r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 5
    assert r.model_extra["ethen"]["routing"]["served_provider"] == "gem"
    call = _sent(lv)
    assert call["path"] == "gemini:generateContent"
    sent = call["body"]
    assert sent["model"] == "up-gem-flash"
    assert sent["systemInstruction"] == {"parts": [{"text": "You describe images."}]}
    assert sent["contents"] == [
        {
            "role": "user",
            "parts": [
                {"text": "What is this?"},
                {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
            ],
        }
    ]
    assert sent["generationConfig"] == {
        "temperature": 0.2,
        "topP": 0.9,
        "maxOutputTokens": 64,
        "stopSequences": ["END"],
        "responseMimeType": "application/json",
        "responseSchema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    }


def test_tool_call_and_tool_result_round_trip(lv: Live) -> None:
    client = lv.client()
    msgs: list[Any] = [{"role": "user", "content": "x?"}]
    r = client.chat.completions.create(model="gem-flash", messages=msgs, tools=TOOLS, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"x": 1})
    assert r.choices[0].finish_reason == "tool_calls"
    sent = _sent(lv)["body"]
    assert sent["tools"] == [{"functionDeclarations": [{"name": "lookup", "description": "Look x up",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "nullable": True}},
                       "required": ["x"]}}]}]  # fmt: skip
    assert sent["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"answer": 42}'},
    ]
    r2 = client.chat.completions.create(model="gem-flash", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Hello from upstream"
    contents = _sent(lv)["body"]["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    assert call.id == "call_0__thought__Cp8-Ab_x9Q"  # the signature rides in the id (URL-safe) ...
    assert contents[1]["parts"] == [
        {"functionCall": {"name": "lookup", "args": {"x": 1}}, "thoughtSignature": SIG}
    ]
    assert contents[2]["parts"] == [{"functionResponse": {"name": "lookup", "response": {"answer": 42}}}]


def test_streamed_chat_text_usage_and_tool_call(lv: Live) -> None:
    chunks = list(
        lv.client().chat.completions.create(
            model="gem-flash",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert _sent(lv)["path"] == "gemini:streamGenerateContent" and _sent(lv)["query"] == {"alt": "sse"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from upstream"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (11, 8)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 4
    chunks = list(
        lv.client().chat.completions.create(
            model="gem-flash", messages=[{"role": "user", "content": "x?"}], tools=TOOLS, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "lookup" and json.loads(deltas[0].function.arguments) == {"x": 1}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_responses_inbound_buffered_and_streamed(lv: Live) -> None:
    r = lv.client().responses.create(model="gem-flash", input="hi", instructions="Be brief.")
    assert r.output_text == "Hello from upstream"
    assert r.usage is not None and r.usage.input_tokens == 11 and r.usage.output_tokens == 8
    assert _sent(lv)["body"]["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    events = list(lv.client().responses.create(model="gem-flash", input="hi", stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello from upstream" and events[-1].type == "response.completed"
    assert _sent(lv)["path"] == "gemini:streamGenerateContent"


def test_messages_inbound_buffered_and_streamed(lv: Live) -> None:
    client = anthropic.Anthropic(base_url=lv.gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15)
    msg = client.messages.create(
        model="gem-flash", max_tokens=100, system="Be brief.", messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello from upstream"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.cache_read_input_tokens == 4 and msg.usage.input_tokens == 11 - 4
    assert _sent(lv)["body"]["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    with client.messages.stream(model="gem-flash", max_tokens=100,
                                messages=[{"role": "user", "content": "x?"}],
                                tools=[{"name": "lookup", "input_schema": {"type": "object", "properties": {
                                    "x": {"type": "integer"}}}}]) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    block = final.content[-1]
    assert block.type == "tool_use" and block.name == "lookup" and block.input == {"x": 1}
    assert _sent(lv)["path"] == "gemini:streamGenerateContent"


@pytest.mark.parametrize("stream", [False, True])
def test_blocked_prompt_is_a_content_filter_error(stream: bool) -> None:
    with live_cloud({"up-gem-flash": CloudBehavior(block_reason="SAFETY")}) as lv:
        with pytest.raises(openai.BadRequestError) as ei:
            out = lv.client().chat.completions.create(
                model="gem-flash", messages=[{"role": "user", "content": "x"}], stream=stream
            )
            if stream:
                list(out)  # type: ignore[arg-type]
        assert ei.value.status_code == 400 and ei.value.code == "content_filter"
        assert "blockReason = 'SAFETY'" in str(ei.value.message)


def test_finish_reasons_mid_stream_cut_and_upstream_errors() -> None:
    behaviors = {"up-gem-flash": CloudBehavior(finish="MAX_TOKENS")}
    with live_cloud(behaviors) as lv:
        r = lv.client().chat.completions.create(
            model="gem-flash", messages=[{"role": "user", "content": "x"}]
        )
        assert r.choices[0].finish_reason == "length"
    with live_cloud({"up-gem-flash": CloudBehavior(finish="SAFETY")}) as lv:
        chunks = list(
            lv.client().chat.completions.create(
                model="gem-flash", messages=[{"role": "user", "content": "x"}], stream=True
            )
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "content_filter"
        ]
    with live_cloud({"up-gem-flash": CloudBehavior(cut_after=1)}) as lv:
        with pytest.raises(openai.APIError) as ei:
            list(
                lv.client().chat.completions.create(
                    model="gem-flash", messages=[{"role": "user", "content": "x"}], stream=True
                )
            )
        assert ei.value.code == "upstream_stream_interrupted"
    with live_cloud({"up-gem-flash": CloudBehavior(fail_status=400)}) as lv:
        with pytest.raises(openai.BadRequestError) as ei2:
            lv.client().chat.completions.create(
                model="gem-flash", messages=[{"role": "user", "content": "x"}]
            )
        assert ei2.value.code == "upstream_bad_request" and "scripted failure 400" in ei2.value.message
        assert PROVIDER_KEY not in ei2.value.message


def test_wire_translation_edges() -> None:
    """Pure translation: named tool_choice, ``n``, penalties, a URL image, a non-JSON tool result."""
    body = {
        "messages": [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.webp"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "plain text"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "n": 2, "seed": 7, "presence_penalty": 0.5, "max_completion_tokens": 9,
    }  # fmt: skip
    out = to_gemini(body)
    assert out["systemInstruction"] == {"parts": [{"text": "Rules."}]}
    assert out["contents"][0]["parts"] == [
        {"fileData": {"mimeType": "image/webp", "fileUri": "https://x.test/a.webp"}}
    ]
    assert out["contents"][2]["parts"] == [
        {"functionResponse": {"name": "f", "response": {"result": "plain text"}}}
    ]
    assert out["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}}
    assert out["tools"] == [{"functionDeclarations": [{"name": "f"}]}]
    assert out["generationConfig"] == {
        "candidateCount": 2,
        "seed": 7,
        "presencePenalty": 0.5,
        "maxOutputTokens": 9,
    }
    assert gemini_schema({"anyOf": [{"type": "string", "$ref": "#/x"}], "items": {"type": "null"}}) == {
        "anyOf": [{"type": "string"}],
        "items": {"type": "null"},
    }


def test_reasoning_effort_becomes_thinking_config() -> None:
    def cfg(effort: str, model: str) -> Any:
        return to_gemini({"messages": [], "reasoning_effort": effort}, model)["generationConfig"][
            "thinkingConfig"
        ]

    assert cfg("low", "gemini-2.5-flash") == {"thinkingBudget": 1024}
    assert cfg("high", "gemini-2.5-pro") == {"thinkingBudget": 24576}
    assert cfg("none", "gemini-2.5-flash") == {"thinkingBudget": 0}
    assert cfg("medium", "models/gemini-3-pro-preview") == {"thinkingLevel": "high"}
    assert cfg("low", "gemini-3-flash") == {"thinkingLevel": "low"}
    assert "generationConfig" not in to_gemini(
        {"messages": [], "reasoning_effort": "bogus"}, "gemini-2.5-pro"
    )
