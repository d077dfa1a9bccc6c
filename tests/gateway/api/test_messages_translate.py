"""The Anthropic Messages translation (issue 26), pure: request -> chat body, chat completion -> Message,
chat chunks -> the Messages event stream, model names. Hypothesis: any split of a text or a tool call's
arguments into chunks translates to deltas that concatenate back to it, in a well-formed event sequence;
``resolve_model`` against a brute-force oracle."""

from __future__ import annotations

import fnmatch
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.api.messages import resolve_model, to_chat
from ethen.gateway.api.messages_stream import MessageEvents, from_chat, stop_reason, usage_from_chat
from ethen.gateway.errors import InvalidRequestError, ModelNotFoundError
from ethen.gateway.providers.anthropic_native import NativeBody, native_request

PNG = "iVBORw0KGgo="
CC = {"cache_control": {"type": "ephemeral"}}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}, **CC}


def _err(body: dict[str, Any], **kw: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        to_chat(body, **kw)
    return info.value


def test_a_full_request_translates_to_the_chat_body() -> None:
    body = {
        "model": "claude-sonnet-4", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "stop_sequences": ["END"], "stream": True, "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "system": [{"type": "text", "text": "Be brief.", **CC}, {"type": "text", "text": "Be kind."}],
        "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Look:", **CC},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C", **CC},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": [
                    {"type": "text", "text": "boom"},
                    {"type": "image",
                     "source": {"type": "base64", "media_type": "image/jpeg", "data": "AA"}}]},
                {"type": "text", "text": "Thanks"},
            ]},
        ],
    }  # fmt: skip
    assert to_chat(body) == {
        "model": "claude-sonnet-4", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "stop": ["END"],
        "stream": True, "stream_options": {"include_usage": True}, "user": "u-1",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                    "description": "Weather"}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief.\n\nBe kind."},
            {"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
            ]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AA"}},
                {"type": "text", "text": "Thanks"}]},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])  # fmt: skip
def test_tool_choice(choice: dict[str, Any], chat: Any) -> None:
    body = {
        "model": "m",
        "max_tokens": 1,
        "tools": [TOOL],
        "tool_choice": choice,
        "messages": [{"role": "user", "content": "hi"}],
    }
    out = to_chat(body)
    assert out["tool_choice"] == chat and "parallel_tool_calls" not in out


def test_a_string_system_and_content_and_metadata_routing() -> None:
    out = to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "S",
            "metadata": {"routing": {"latency_target": "fast"}},
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        }
    )
    assert out == {
        "model": "m",
        "max_tokens": 5,
        "metadata": {"routing": {"latency_target": "fast"}},
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ],
    }


@pytest.mark.parametrize(("patch", "param", "code"), [
    ({"max_tokens": None}, "max_tokens", "missing_required_parameter"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"model": None}, "model", "missing_required_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     "messages[0].content[0].source.type", "unsupported_value"),
    ({"messages": [{"role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "n", "input": []}]}]},
     "messages[0].content[0].input", "invalid_type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
     "unsupported_value"),
    ({"tools": [{"name": "t"}]}, "tools[0].input_schema", "missing_required_parameter"),
    ({"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice.type", "invalid_value"),
    ({"temperature": 1.5}, "temperature", "invalid_value"),
    ({"top_k": -1}, "top_k", "invalid_value"),
    ({"stop_sequences": ["a", 1]}, "stop_sequences[1]", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id", "invalid_type"),
])  # fmt: skip
def test_a_bad_body_names_the_field(patch: dict[str, Any], param: str, code: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **patch}
    err = _err({k: v for k, v in body.items() if v is not None})
    assert (err.param, err.code) == (param, code), err.message
    assert param in err.message


def test_count_tokens_bodies_need_no_max_tokens() -> None:
    assert to_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, count_only=True) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }


# --- the answer ---------------------------------------------------------------------------------------------


def _completion(message: dict[str, Any], finish: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "up",
        "usage": usage or {},
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def test_a_completion_with_text_and_a_tool_call_is_a_message() -> None:
    msg = from_chat(_completion(
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "think",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "f", "arguments": "not json"}}]},
        "tool_calls",
        {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 90}},
    ), "claude-x", ())  # fmt: skip
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["model"] == "claude-x" and msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "f", "input": {"_raw": "not json"}},
    ]
    assert msg["usage"] == {
        "input_tokens": 10,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 90,
    }


@pytest.mark.parametrize(("finish", "hit", "out"), [
    ("stop", None, ("end_turn", None)), ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None)), ("content_filter", None, ("refusal", None)),
    ("stop", "END", ("stop_sequence", "END")), ("stop", "OTHER", ("end_turn", None)),
    (None, None, ("end_turn", None)),
])  # fmt: skip
def test_stop_reasons(finish: str | None, hit: str | None, out: tuple[str, str | None]) -> None:
    assert stop_reason(finish, hit, ("END",)) == out


def test_usage_without_a_report_is_zero() -> None:
    assert usage_from_chat(None) == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


# --- the stream ---------------------------------------------------------------------------------------


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _parse(frames: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        head, data = frame.split(b"\n", 1)
        ev = json.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + ev["type"].encode() and frame.endswith(b"\n\n")
        out.append(ev)
    return out


def _run(chunks: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    events = MessageEvents("claude-x", ("END",), 42)
    frames = events.start({"requested_model": "claude-x"})
    for c in chunks:
        frames += events.chunk(c)
    terminal = {
        "choices": [],
        "usage": usage or {"prompt_tokens": 11, "completion_tokens": 3},
        "ethen": {"routing": {"overhead_ms": 1.0}},
    }
    return _parse(frames + events.complete(terminal))


def test_a_text_stream_is_the_exact_event_sequence() -> None:
    evs = _run(
        [
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "stop"),
        ]
    )
    assert [e["type"] for e in evs] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = evs[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 42
    assert start["ethen"] == {"routing": {"requested_model": "claude-x"}}
    assert evs[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert evs[3]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert evs[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert evs[6]["usage"]["input_tokens"] == 11 and evs[6]["usage"]["output_tokens"] == 3
    assert evs[6]["ethen"] == {"routing": {"overhead_ms": 1.0}}


def test_thinking_then_text_then_two_tool_calls_are_separate_blocks() -> None:
    evs = _run([
        _chunk({"reasoning_content": "hm"}), _chunk({"content": "ok"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
    ])  # fmt: skip
    starts = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {}},
        {"type": "tool_use", "id": "call_b", "name": "g", "input": {}},
    ]
    deltas = [(e["index"], e["delta"]) for e in evs if e["type"] == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "hm"}),
        (1, {"type": "text_delta", "text": "ok"}),
        (2, {"type": "input_json_delta", "partial_json": '{"a":'}),
        (2, {"type": "input_json_delta", "partial_json": " 1}"}),
        (3, {"type": "input_json_delta", "partial_json": "{}"}),
    ]
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_an_empty_answer_has_no_block_and_a_stream_error_is_an_error_event() -> None:
    assert [e["type"] for e in _run([_chunk({}, "length")])] == [
        "message_start",
        "message_delta",
        "message_stop",
    ]
    events = MessageEvents("m", (), 0)
    frame = events.error(
        {"error": {"code": "upstream_stream_interrupted", "message": "cut"}, "ethen": {"routing": {}}},
        lambda code: "api_error",
    )
    assert _parse([frame]) == [
        {
            "type": "error",
            "error": {"type": "api_error", "message": "cut", "code": "upstream_stream_interrupted"},
            "ethen": {"routing": {}},
        }
    ]


def _well_formed(evs: list[dict[str, Any]]) -> None:
    """message_start first, message_delta + message_stop last; blocks opened in index order, each stopped
    once before the next opens; one ping, right after the first block start."""
    types = [e["type"] for e in evs]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    open_index = None
    opened = 0
    for k, e in enumerate(evs[1:-2], 1):
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == opened
            open_index, opened = e["index"], opened + 1
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
        elif e["type"] == "ping":
            assert evs[k - 1]["type"] == "content_block_start" and evs[k - 1]["index"] == 0
        else:
            assert e["type"] == "content_block_delta" and e["index"] == open_index
    assert open_index is None and types.count("ping") == (1 if opened else 0)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@given(st.text(min_size=1), st.lists(st.integers(min_value=0), max_size=20))
def test_any_split_text_stream_concatenates_back(text: str, cuts: list[int]) -> None:
    evs = _run([_chunk({"content": p}) for p in _split(text, cuts)] + [_chunk({}, "stop")])
    _well_formed(evs)
    assert "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta") == text
    assert sum(e["type"] == "content_block_start" for e in evs) == 1


@given(
    st.text(max_size=30),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=4),
    st.lists(st.integers(min_value=0), max_size=10),
)
def test_any_split_tool_arguments_concatenate_to_the_call_input(
    text: str, args: dict[str, int], cuts: list[int]
) -> None:
    raw = json.dumps(args)
    calls = [
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]})
    ]
    calls += [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in _split(raw, cuts)]
    evs = _run([_chunk({"content": text}), *calls, _chunk({}, "tool_calls")])
    _well_formed(evs)
    tool_index = 1 if text else 0
    parts = [
        e["delta"]["partial_json"]
        for e in evs
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert all(
        e["index"] == tool_index
        for e in evs
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert json.loads("".join(parts)) == args and evs[-2]["delta"]["stop_reason"] == "tool_use"


# --- model names --------------------------------------------------------------------------------------

_NAMES = st.text(alphabet="abc-*?[]/", max_size=8)


def _oracle(model: str, known: set[str], mapping: list[tuple[str, str]]) -> str | None:
    if model in known:
        return model
    matches = [target for pattern, target in mapping if fnmatch.fnmatchcase(model, pattern)]
    return matches[0] if matches else None


@given(_NAMES, st.sets(_NAMES, max_size=4), st.lists(st.tuples(_NAMES, _NAMES), max_size=6))
def test_resolve_model_is_the_first_matching_pattern(
    model: str, known: set[str], mapping: list[tuple[str, str]]
) -> None:
    table: dict[str, str] = {}
    for pattern, target in mapping:
        table.setdefault(pattern, target)
    expected = _oracle(model, known, list(table.items()))
    if expected is None:
        with pytest.raises(ModelNotFoundError):
            resolve_model(model, known, table)
    else:
        assert resolve_model(model, known, table) == expected


def test_model_map_examples() -> None:
    table = {"claude-*haiku*": "ethen/cheap", "claude-*": "ethen/coding"}
    assert resolve_model("claude-3-5-haiku-20241022", set(), table) == "ethen/cheap"
    assert resolve_model("claude-sonnet-4-5", set(), table) == "ethen/coding"
    assert resolve_model("claude-haiku", {"claude-haiku"}, table) == "claude-haiku"
    with pytest.raises(ModelNotFoundError):
        resolve_model("gpt-4o", set(), table)


def test_the_native_body_is_the_clients_with_the_route_model_and_no_routing_hints() -> None:
    client = {"model": "claude-x", "max_tokens": 5, "stream": True, "top_k": 3,
              "metadata": {"user_id": "u", "routing": {"latency_target": "fast"}}, "messages": []}
    body = NativeBody({"model": "ethen/auto"}, client, None)
    assert dict(body) == {"model": "ethen/auto"}  # what every other provider reads
    assert native_request(body, "up-1", stream=False) == {"model": "up-1", "max_tokens": 5, "top_k": 3,
                                                          "metadata": {"user_id": "u"}, "messages": []}
    only_routing = NativeBody({}, {**client, "metadata": {"routing": {}}}, None)
    assert "metadata" not in native_request(only_routing, "up-1", stream=True)
    assert native_request(only_routing, "up-1", stream=True)["stream"] is True


def test_a_lenient_translation_leaves_out_what_chat_cannot_carry_and_names_it() -> None:
    body = {"model": "m", "max_tokens": 5, "tools": [{"type": "bash_20250124", "name": "bash"}, TOOL],
            "messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "text", "data": "d"}},
                {"type": "image", "source": {"type": "file", "file_id": "f"}},
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]},
                {"type": "text", "text": "hi"}]},
                {"role": "assistant",
                 "content": [{"type": "server_tool_use", "id": "s", "name": "web_search"}]}]}  # fmt: skip
    drop: list[str] = []
    chat = to_chat(body, drop=drop)
    assert drop == ["messages[0].content[0].type", "messages[0].content[1].source.type",
                    "messages[0].content[2].content[0].type", "messages[1].content[0].type", "tools[0].type"]
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t", "content": ""},
                                {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert _err(body).param == "messages[0].content[0].type"  # strict: the first one is refused


def test_structured_output_becomes_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}}
    assert to_chat(body)["response_format"] == {"type": "json_schema",
                                                "json_schema": {"name": "output", "schema": schema}}
    bad = {**body, "output_config": {"format": {"type": "xml"}}}
    assert _err(bad).param == "output_config.format.type"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_KINDS = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document", "x", 3])
_SOURCE = st.fixed_dictionaries({"type": st.sampled_from(["base64", "url", "file"])},
                                optional={"url": _JSON, "data": _JSON, "media_type": _JSON})
_BLOCK = st.fixed_dictionaries({"type": _KINDS}, optional={
    "text": _JSON, "source": _JSON | _SOURCE, "id": _JSON, "name": _JSON, "input": _JSON,
    "tool_use_id": _JSON, "content": _JSON, "is_error": _JSON})  # fmt: skip
_CONTENT = st.text(max_size=5) | st.lists(_BLOCK, max_size=3) | _JSON
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 1])},
                                 optional={"content": _CONTENT})
_BODY = st.fixed_dictionaries({}, optional={
    "model": st.text(max_size=5) | _JSON, "max_tokens": st.integers(-1, 5) | _JSON,
    "messages": st.lists(_MESSAGE, max_size=3) | _JSON, "system": _JSON, "tools": _JSON, "tool_choice": _JSON,
    "temperature": _JSON, "top_p": _JSON, "top_k": _JSON, "stop_sequences": _JSON, "stream": _JSON,
    "metadata": _JSON, "output_config": _JSON})  # fmt: skip


@settings(max_examples=300)
@given(_BODY, st.booleans(), st.booleans())
def test_any_body_translates_or_is_refused_naming_a_field(body: dict[str, Any], count_only: bool,
                                                          lenient: bool) -> None:
    """Never an exception other than ``InvalidRequestError`` (a 500 for a client's mistake)."""
    drop: list[str] | None = [] if lenient else None
    try:
        chat = to_chat(body, count_only=count_only, drop=drop)
    except InvalidRequestError as err:
        assert err.param is not None and err.code in (
            "invalid_type", "invalid_value", "missing_required_parameter", "unsupported_value")
        return
    assert isinstance(chat["model"], str) and isinstance(chat["messages"], list)
    json.dumps(chat)
