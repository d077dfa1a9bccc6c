"""Our bodies against the OpenAI API description: responses, every SSE line, model lists, errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def check(name: str, obj: Any) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator(name).iter_errors(obj)]
    assert not errors, (name, errors, obj)


def test_validator_rejects_a_wrong_body() -> None:
    with pytest.raises(AssertionError):
        check("CreateChatCompletionResponse", {"id": "x", "object": "chat.completion", "choices": []})
    with pytest.raises(AssertionError):
        check("ErrorResponse", {"error": {"message": "m"}})


@pytest.fixture(scope="module")
def lv() -> Live:
    with live({"up-beta-tools": Behavior(cut_after=1)}) as running:
        yield running  # type: ignore[misc]


def post(lv: Live, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{lv.base_url}/chat/completions", json=body, headers=headers or AUTH, timeout=15)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "ethen/auto", "messages": USER},
        {"model": "ethen/auto", "messages": USER, "tools": TOOLS},
        {"model": "gamma-claude", "messages": USER},
        {"model": "gamma-claude", "messages": USER, "tools": TOOLS},
    ],
)
def test_buffered_responses_match_create_chat_completion_response(lv: Live, body: dict[str, Any]) -> None:
    r = post(lv, body)
    assert r.status_code == 200
    check("CreateChatCompletionResponse", r.json())


@pytest.mark.parametrize(
    "body",
    [
        {"model": "ethen/auto", "messages": USER, "stream": True},
        {"model": "ethen/auto", "messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "alpha-large", "messages": USER, "stream": True, "tools": TOOLS},
        {
            "model": "gamma-claude",
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"model": "gamma-claude", "messages": USER, "stream": True, "tools": TOOLS},
    ],
)
def test_every_sse_line_matches_create_chat_completion_stream_response(
    lv: Live, body: dict[str, Any]
) -> None:
    lines = 0
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", json=body, headers=AUTH, timeout=15) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for payload in data[:-1]:
        check("CreateChatCompletionStreamResponse", json.loads(payload))
        lines += 1
    assert lines >= 3


def test_stream_error_event_payload_matches_error_response(lv: Live) -> None:
    body = {"model": "beta-tools", "messages": USER, "stream": True}
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", json=body, headers=AUTH, timeout=15) as r:
        raw = [ln for ln in r.iter_lines() if ln]
    assert raw[-2] == "event: error"
    err = json.loads(raw[-1][6:])
    check("ErrorResponse", err)
    for ln in raw[:-2]:
        check("CreateChatCompletionStreamResponse", json.loads(ln[6:]))


def test_models_match_list_models_response(lv: Live) -> None:
    r = httpx.get(f"{lv.base_url}/models", headers=AUTH)
    check("ListModelsResponse", r.json())


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        ({"model": "ethen/auto", "messages": USER}, {"authorization": "Bearer nope"}, 401),
        ({"model": "nope", "messages": USER}, None, 404),
        ({"model": "beta-small", "messages": USER, "tools": TOOLS}, None, 422),
        ({"model": "ethen/auto", "messages": "x"}, None, 400),
        ({"model": "beta-tools", "messages": USER, "max_tokens": 10**9}, None, 422),
    ],
)
def test_errors_match_error_response(
    lv: Live, body: dict[str, Any], headers: dict[str, str] | None, status: int
) -> None:
    r = post(lv, body, headers)
    assert r.status_code == status
    check("ErrorResponse", r.json())


def test_upstream_error_matches_error_response() -> None:
    with live({"up-beta-small": Behavior(fail_status=500)}) as lv:
        r = post(lv, {"model": "beta-small", "messages": USER})
        assert r.status_code == 502
        check("ErrorResponse", r.json())
