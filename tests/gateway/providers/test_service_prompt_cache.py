"""Prompt-cache hints through the real gateway (issue 45 item 1): the scripted upstream on loopback records
what it received (Anthropic's ``cache_control`` breakpoints, OpenAI's ``prompt_cache_key``) and bills the
cache reads and writes it is told to; the client sees them in every API shape."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

SYSTEM = "You are a careful coding agent. " * 200  # ~6.4 kB: past Sonnet's 1024-token minimum on its own
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 20,
                                           "parameters": {"type": "object", "properties": {}}}}
         for i in range(20)]  # fmt: skip
TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
]
WRITE, READ, PROMPT = 3000, 1000, 5000
ANTHROPIC = Behavior(prompt_tokens=PROMPT, cache_read_tokens=READ, cache_write_tokens=WRITE, tool_call=False)
OPENAI = Behavior(prompt_tokens=PROMPT, cache_read_tokens=READ, tool_call=False)
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}


@pytest.fixture(scope="module")
def lv() -> Live:
    with live({"up-gamma-claude": ANTHROPIC, "up-alpha-large": OPENAI}) as running:
        yield running  # type: ignore[misc]


def _post(lv: Live, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{lv.base_url}/{path}", json=body, headers=HEADERS, timeout=15)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _sent(lv: Live) -> dict[str, Any]:
    sent: dict[str, Any] = lv.script.calls[-1]["body"]
    return sent


def _breakpoints(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """Where the body's ``cache_control`` marks are: ("tools" | "system" | "messages.<i>", the mark)."""
    out: list[tuple[str, Any]] = [("tools", t["cache_control"]) for t in body.get("tools") or ()
                                  if "cache_control" in t]
    system = body.get("system")
    if isinstance(system, list):
        out += [("system", b["cache_control"]) for b in system if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        if isinstance(m["content"], list):
            out += [(f"messages.{i}", b["cache_control"]) for b in m["content"] if "cache_control" in b]
    return out


EPH = {"type": "ephemeral"}


def test_chat_to_anthropic_gets_breakpoints_and_reports_reads_and_writes(lv: Live) -> None:
    out = _post(lv, "chat/completions", {"model": "gamma-claude", "messages": TURNS, "tools": TOOLS})
    sent = _sent(lv)
    # end of tools, end of system, the last two user turns (the upstream merges nothing here)
    assert _breakpoints(sent) == [("tools", EPH), ("system", EPH), ("messages.0", EPH), ("messages.2", EPH)]
    assert sent["tools"][-1]["name"] == "tool_19" and sent["system"][0]["text"] == SYSTEM
    assert out["usage"]["prompt_tokens"] == PROMPT
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": READ, "cache_write_tokens": WRITE}
    # streamed: the usage chunk carries the same
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", headers=HEADERS, timeout=15,
                      json={"model": "gamma-claude", "messages": TURNS, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage[-1]["prompt_tokens_details"] == {"cached_tokens": READ, "cache_write_tokens": WRITE}
    assert _breakpoints(_sent(lv)) == [("system", EPH), ("messages.0", EPH), ("messages.2", EPH)]


def test_a_short_prompt_gets_no_breakpoint(lv: Live) -> None:
    _post(lv, "chat/completions", {"model": "gamma-claude", "messages": TURNS[1:]})
    assert _breakpoints(_sent(lv)) == []


def test_client_breakpoints_and_their_ttl_pass_through_untouched(lv: Live) -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": hour}]},
                *TURNS[1:]]
    tools = [*TOOLS[:-1], {**TOOLS[-1], "cache_control": hour}]
    _post(lv, "chat/completions", {"model": "gamma-claude", "messages": messages, "tools": tools})
    assert _breakpoints(_sent(lv)) == [("tools", hour), ("system", hour)]
    # LiteLLM's message-level form lands on the message's last block
    marked = [TURNS[0], {"role": "user", "content": "hi", "cache_control": hour}]
    _post(lv, "chat/completions", {"model": "gamma-claude", "messages": marked})
    assert _breakpoints(_sent(lv)) == [("messages.0", hour)]


def test_messages_native_gets_breakpoints_and_cache_creation(lv: Live) -> None:
    body = {"model": "gamma-claude", "max_tokens": 50, "system": SYSTEM,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{lv.gateway.url}/v1/messages", json=body, headers={"x-api-key": CLIENT_KEY}, timeout=15)
    assert r.status_code == 200, r.text
    assert _breakpoints(_sent(lv)) == [("system", EPH), ("messages.0", EPH)]
    usage = r.json()["usage"]
    assert (usage["cache_creation_input_tokens"], usage["cache_read_input_tokens"]) == (WRITE, READ)
    # the client's own breakpoint with its ttl: the body goes as it came
    hour = {"type": "ephemeral", "ttl": "1h"}
    mine = {**body, "system": [{"type": "text", "text": SYSTEM, "cache_control": hour}]}
    r = httpx.post(f"{lv.gateway.url}/v1/messages", json=mine, headers={"x-api-key": CLIENT_KEY}, timeout=15)
    assert r.status_code == 200 and _sent(lv)["system"] == mine["system"]
    assert _breakpoints(_sent(lv)) == [("system", hour)]


def test_responses_to_anthropic_gets_breakpoints_and_reports_cache(lv: Live) -> None:
    out = _post(lv, "responses", {"model": "gamma-claude", "instructions": SYSTEM, "input": "hi"})
    assert _breakpoints(_sent(lv)) == [("system", EPH), ("messages.0", EPH)]
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": READ, "cache_write_tokens": WRITE}
    body = {"model": "gamma-claude", "instructions": SYSTEM, "input": "hi", "stream": True}
    with httpx.stream("POST", f"{lv.base_url}/responses", headers=HEADERS, timeout=15, json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    done = [e for e in events if e["type"] == "response.completed"][-1]
    assert done["response"]["usage"]["input_tokens_details"] == {"cached_tokens": READ,
                                                                  "cache_write_tokens": WRITE}


def test_openai_upstreams_get_one_prompt_cache_key_per_conversation(lv: Live) -> None:
    out = _post(lv, "chat/completions", {"model": "alpha-large", "messages": TURNS[:2]})
    first = _sent(lv)["prompt_cache_key"]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": READ}
    _post(lv, "chat/completions", {"model": "alpha-large", "messages": TURNS})  # the next turn
    assert _sent(lv)["prompt_cache_key"] == first and first.startswith("ethen-")
    assert SYSTEM[:20] not in first
    other = [{"role": "system", "content": "another agent"}, *TURNS[1:]]
    _post(lv, "chat/completions", {"model": "alpha-large", "messages": other})
    assert _sent(lv)["prompt_cache_key"] != first
    _post(lv, "chat/completions", {"model": "alpha-large", "messages": TURNS, "prompt_cache_key": "mine"})
    assert _sent(lv)["prompt_cache_key"] == "mine"
    # Responses (Codex sends its own key) and Messages reach chat upstreams with a key too
    out = _post(lv, "responses", {"model": "alpha-large", "input": "hi", "prompt_cache_key": "codex-1"})
    assert _sent(lv)["prompt_cache_key"] == "codex-1"
    assert out["usage"]["input_tokens_details"]["cached_tokens"] == READ
    r = httpx.post(f"{lv.gateway.url}/v1/messages", headers={"x-api-key": CLIENT_KEY}, timeout=15,
                   json={"model": "alpha-large", "max_tokens": 20, "system": SYSTEM,
                         "messages": [{"role": "user", "content": "first question"}]})
    assert r.status_code == 200 and _sent(lv)["prompt_cache_key"] == first
    assert r.json()["usage"]["cache_read_input_tokens"] == READ
    assert r.json()["usage"]["input_tokens"] == PROMPT - READ


def test_auto_breakpoints_false_sends_requests_as_they_came() -> None:
    with live({"up-gamma-claude": ANTHROPIC}, prompt_cache={"auto_breakpoints": False}) as lv:
        _post(lv, "chat/completions", {"model": "gamma-claude", "messages": TURNS, "tools": TOOLS})
        assert _breakpoints(_sent(lv)) == []
        _post(lv, "chat/completions", {"model": "alpha-large", "messages": TURNS})
        assert "prompt_cache_key" not in _sent(lv)


def _counter(lv: Live, provider: str, kind: str) -> float:
    text = httpx.get(f"{lv.base_url}/metrics", timeout=5).text
    want = f'ethen_gateway_prompt_cache_tokens_total{{kind="{kind}",provider="{provider}"}} '
    return next((float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(want)), 0.0)


def test_cache_tokens_are_counted_and_logged(lv: Live) -> None:
    before = _counter(lv, "gamma", "read"), _counter(lv, "gamma", "write")
    r = httpx.post(f"{lv.base_url}/chat/completions", headers={**HEADERS, "x-request-id": "pcache-log-1"},
                   json={"model": "gamma-claude", "messages": TURNS}, timeout=15)
    assert r.status_code == 200
    deadline = time.monotonic() + 5  # the request log's writer counts off the request path
    while (_counter(lv, "gamma", "read"), _counter(lv, "gamma", "write")) != (before[0] + READ,
                                                                             before[1] + WRITE):
        assert time.monotonic() < deadline, "the prompt-cache counters never moved"
        time.sleep(0.02)
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    row = next(r for r in list(ring) if r["request_id"] == "pcache-log-1")
    assert (row["receipt"]["cost"]["cache_read_tokens"], row["receipt"]["cost"]["cache_write_tokens"]) == (
        READ, WRITE)
