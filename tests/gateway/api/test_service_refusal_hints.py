"""Issue 42 item 12: the 400/422/404 a client gets when nothing can serve its request says what to add:
a tool-capable, long-context provider (``ethen up --config examples/cloud-tools.toml``), a ``[model_map]``
entry for an unknown Claude model name, the providers the project may use. Through the real gateway on
127.0.0.1: a gateway like a plain ``ethen up`` (one small model without tools), chat and the Messages API
as Claude Code / Codex call them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.budget_harness import live_store, new_project_key
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, Live, live

OVERLAY = "ethen up --config examples/cloud-tools.toml"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
ANTHROPIC_TOOLS = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]
SMALL = next(r for r in ROUTES if r["model"] == "beta-small")  # 32k context, no tools: like the mesh model


@pytest.fixture(scope="module")
def plain() -> Iterator[Live]:
    with live(routes=[dict(SMALL)]) as lv:
        yield lv


def _messages(lv: Live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{lv.gateway.url}/v1/messages", json=body, timeout=15,
                      headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"})


def _chat(lv: Live, body: dict[str, Any], key: str = CLIENT_KEY) -> httpx.Response:
    return httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=15,
                      headers={"authorization": f"Bearer {key}"})


def test_claude_codes_model_name_says_which_model_map_entry_to_add(plain: Live) -> None:
    body = {"model": "claude-sonnet-4-6", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    r = _messages(plain, body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["param"] == "model"
    assert "[model_map]" in err["message"] and '"claude-*" = "ethen/auto"' in err["message"]
    assert "ANTHROPIC_MODEL=ethen/auto" in err["message"] and OVERLAY in err["message"]


def test_tools_and_a_long_prompt_say_which_provider_to_add(plain: Live) -> None:
    # Claude Code with ANTHROPIC_MODEL=ethen/auto: tools, and a system prompt longer than the small context
    body = {"model": "ethen/auto", "max_tokens": 2048, "tools": ANTHROPIC_TOOLS, "system": "s" * 120_000,
            "messages": [{"role": "user", "content": "hi"}]}
    r = _messages(plain, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "no_smart_route_candidate"
    assert err["rejections"] == [{"candidate": "beta/beta-small",
                                  "reasons": ["no_tool_support", "context_window_too_small"]}]
    msg = err["message"]
    assert "add a tool-capable provider" in msg and OVERLAY in msg
    assert "the largest context window here is 32000" in msg and "tokens of context" in msg
    # chat (Codex, the OpenAI SDKs): 422 with the same sentences
    r = _chat(plain, {"model": "beta-small", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert r.status_code == 422, r.text
    msg = r.json()["error"]["message"]
    assert "add a tool-capable provider" in msg and OVERLAY in msg and "context" not in msg.split(". ", 1)[1]


def test_an_unknown_model_on_chat_points_at_the_model_list(plain: Live) -> None:
    r = _chat(plain, {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "GET /v1/models lists" in r.json()["error"]["message"], r.text


def test_max_tokens_and_budget_ceiling_say_the_numbers(plain: Live) -> None:
    user = [{"role": "user", "content": "hi"}]
    r = _chat(plain, {"model": "beta-small", "messages": user, "max_tokens": 5000})
    assert r.status_code == 422 and "(at most 4000): lower it" in r.json()["error"]["message"], r.text
    r = _chat(plain, {"model": "beta-small", "messages": user, "max_tokens": 10,
                      "metadata": {"routing": {"budget_ceiling_usd": 0}}})
    msg = r.json()["error"]["message"]
    assert r.status_code == 422 and "budget_ceiling_usd 0 is below the cheapest estimate here ($0.000" in msg


def test_a_project_restricted_to_other_providers_says_which_it_may_use(tmp_path: Any) -> None:
    with live_store(f"sqlite:///{tmp_path / 'gw.db'}") as lv:
        key = new_project_key(lv, "gamma-only", allowed_providers=["gamma"])
        r = _chat(lv, {"model": "beta-small", "messages": [{"role": "user", "content": "hi"}]}, key)
    assert r.status_code == 422, r.text
    assert "This key's project may use only the providers gamma" in r.json()["error"]["message"]
