"""Gemini explicit context caching through the real gateway (issue 45 item 1): a chat request carrying the
client's ``cache_control`` breakpoints to a ``kind = "gemini"`` provider has its prefix put in a
``cachedContents`` resource once, and is sent naming it with only the rest. The scripted Gemini upstream
(:mod:`upstream_cloud`) serves ``cachedContents``, answers over a named cache as Gemini does (refusing a
``systemInstruction`` / ``tools`` beside it), refuses small prefixes and can lose its caches."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from ethen.gateway.providers.gemini_wire import to_gemini
from tests.gateway.service_harness import CLIENT_KEY, Live
from tests.gateway.upstream_cloud import CloudBehavior, cache_tokens, live_cloud

HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}
EPH = {"type": "ephemeral"}
PARAMS = {"type": "object", "properties": {"x": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "lookup", "description": "Looks a thing up. " * 10, "parameters": PARAMS}}]
PROMPT = 7  # the scripted upstream's uncached prompt tokens


def _system(tag: str) -> str:
    return f"[{tag}] You are a careful coding agent. " * 200  # ~7 kB: past the 1,024-token minimum


def _turns(tag: str, n: int, mark: dict[str, Any] | None = EPH) -> list[dict[str, Any]]:
    """A conversation's messages at its ``n``-th user turn, the system message marked with ``mark``."""
    part: dict[str, Any] = {"type": "text", "text": _system(tag)}
    if mark is not None:
        part["cache_control"] = mark
    out: list[dict[str, Any]] = [{"role": "system", "content": [part]}]
    for i in range(n):
        if i:
            out.append({"role": "assistant", "content": f"answer {i}"})
        out.append({"role": "user", "content": f"question {i + 1}"})
    return out


@pytest.fixture(scope="module")
def lv() -> Live:
    with live_cloud({"up-gem-flash": CloudBehavior(prompt_tokens=PROMPT, tool_call=False)}) as running:
        yield running  # type: ignore[misc]


def _behave(lv: Live, **kw: Any) -> None:
    lv.script.behaviors["up-gem-flash"] = CloudBehavior(prompt_tokens=PROMPT, tool_call=False, **kw)


@pytest.fixture(autouse=True)
def _fresh(lv: Live) -> None:
    _behave(lv)
    lv.script.calls.clear()


def _chat(lv: Live, messages: list[dict[str, Any]], rid: str | None = None, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{lv.base_url}/chat/completions", timeout=15,
                   headers={**HEADERS, **({"x-request-id": rid} if rid else {})},
                   json={"model": "gem-flash", "messages": messages, **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _calls(lv: Live, path: str) -> list[dict[str, Any]]:
    return [c["body"] for c in lv.script.calls if c["path"] == path]


def _details(out: dict[str, Any]) -> tuple[int, int, int]:
    usage = out["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return usage["prompt_tokens"], details.get("cached_tokens", 0), details.get("cache_write_tokens", 0)


def test_two_turns_create_one_cache_and_send_only_the_rest(lv: Live) -> None:
    first = _chat(lv, _turns("a", 1), "gem-cache-1", tools=TOOLS, tool_choice="auto")
    second = _chat(lv, _turns("a", 2), tools=TOOLS, tool_choice="auto")
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"] == (
        "Hello from upstream")
    [created] = _calls(lv, "gemini:cachedContents")
    want_full = to_gemini({"messages": _turns("a", 2), "tools": TOOLS, "tool_choice": "auto"})
    assert created == {"model": "models/up-gem-flash", "systemInstruction": want_full["systemInstruction"],
                       "tools": want_full["tools"], "toolConfig": want_full["toolConfig"], "ttl": "300s"}
    gens = _calls(lv, "gemini:generateContent")
    assert len(gens) == 2 and gens[0]["cachedContent"] == gens[1]["cachedContent"]
    assert gens[0]["cachedContent"].startswith("cachedContents/")
    for sent, n in zip(gens, (1, 2), strict=True):
        assert not {"systemInstruction", "tools", "toolConfig"} & set(sent)
        assert sent["contents"] == to_gemini({"messages": _turns("a", n)})["contents"]
    written = cache_tokens(created)
    assert _details(first) == (PROMPT + 2 * written, written, written)  # read what it wrote, once billed
    assert _details(second) == (PROMPT + written, written, 0)
    deadline = time.monotonic() + 5  # the receipt shows the write (logged off the request path)
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    while not (rows := [r for r in list(ring) if r["request_id"] == "gem-cache-1"]):
        assert time.monotonic() < deadline, "the request was never logged"
        time.sleep(0.02)
    cost = rows[0]["receipt"]["cost"]
    assert (cost["cache_read_tokens"], cost["cache_write_tokens"]) == (written, written)


def test_a_breakpoint_mid_conversation_caches_its_turns_with_its_ttl(lv: Live) -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    msgs = _turns("b", 3, mark=None)
    msgs[1] = {**msgs[1], "cache_control": hour}  # LiteLLM's message-level form, on the first user turn
    out = _chat(lv, msgs)
    [created] = _calls(lv, "gemini:cachedContents")
    full = to_gemini({"messages": msgs})
    assert created["ttl"] == "3600s" and created["contents"] == full["contents"][:1]
    [sent] = _calls(lv, "gemini:generateContent")
    assert sent["contents"] == full["contents"][1:] and "systemInstruction" not in sent
    assert _details(out)[1:] == (cache_tokens(created), cache_tokens(created))


def test_no_breakpoint_no_cache(lv: Live) -> None:
    out = _chat(lv, _turns("c", 2, mark=None))
    assert _calls(lv, "gemini:cachedContents") == []
    [sent] = _calls(lv, "gemini:generateContent")
    assert "cachedContent" not in sent and sent == {**to_gemini({"messages": _turns("c", 2)}),
                                                    "model": "up-gem-flash"}
    assert _details(out) == (PROMPT, 0, 0)
    _chat(lv, _turns("c", 2))  # the same conversation, marked: the mark alone makes the difference
    assert len(_calls(lv, "gemini:cachedContents")) == 1


def test_auto_breakpoints_false_creates_nothing(lv: Live) -> None:
    _chat(lv, _turns("d", 1))
    assert len(_calls(lv, "gemini:cachedContents")) == 1  # on by default ...
    with live_cloud({"up-gem-flash": CloudBehavior(tool_call=False)},
                    prompt_cache={"auto_breakpoints": False}) as off:
        _chat(off, _turns("d", 1))  # ... off: the same request goes as it came
        assert _calls(off, "gemini:cachedContents") == []
        [sent] = _calls(off, "gemini:generateContent")
        assert "cachedContent" not in sent and "systemInstruction" in sent


def test_a_refused_creation_sends_the_request_as_it_came_and_is_not_retried(lv: Live) -> None:
    _behave(lv, cache_min_tokens=1_000_000)
    for n in (1, 2):
        out = _chat(lv, _turns("e", n))
        assert out["choices"][0]["message"]["content"] == "Hello from upstream"
        assert _details(out) == (PROMPT, 0, 0)
        sent = _calls(lv, "gemini:generateContent")[-1]
        assert "cachedContent" not in sent and sent["systemInstruction"]["parts"][0]["text"] == _system("e")
        assert sent["contents"] == to_gemini({"messages": _turns("e", n)})["contents"]
    assert len(_calls(lv, "gemini:cachedContents")) == 1  # refused once, not asked again
    _behave(lv, cache_fail_status=503)
    out = _chat(lv, _turns("e2", 1))  # Gemini's cache service failing: the request still goes
    assert out["choices"][0]["message"]["content"] == "Hello from upstream"
    assert len(_calls(lv, "gemini:cachedContents")) == 2 and "cachedContent" not in _calls(
        lv, "gemini:generateContent")[-1]


def test_a_cache_gone_on_the_generate_call_falls_back_to_the_whole_request(lv: Live) -> None:
    _chat(lv, _turns("f", 1))
    assert len(_calls(lv, "gemini:cachedContents")) == 1
    _behave(lv, cache_gone=True)
    out = _chat(lv, _turns("f", 2))
    assert out["choices"][0]["message"]["content"] == "Hello from upstream"
    assert _details(out) == (PROMPT, 0, 0)
    gens = _calls(lv, "gemini:generateContent")
    assert [("cachedContent" in g) for g in gens] == [True, True, False]
    assert gens[-1]["systemInstruction"]["parts"][0]["text"] == _system("f")
    _behave(lv)
    _chat(lv, _turns("f", 3))  # the lost cache was forgotten: the next turn makes a new one
    assert len(_calls(lv, "gemini:cachedContents")) == 2
    gens = _calls(lv, "gemini:generateContent")
    assert gens[-1]["cachedContent"].startswith("cachedContents/") and gens[-1]["cachedContent"] != gens[0][
        "cachedContent"]


def test_a_streamed_request_with_a_breakpoint_uses_the_cache(lv: Live) -> None:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{lv.base_url}/chat/completions", headers=HEADERS, timeout=15,
                      json={"model": "gem-flash", "messages": _turns("g", 2), "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == "Hello from upstream"
    [created] = _calls(lv, "gemini:cachedContents")
    [sent] = _calls(lv, "gemini:streamGenerateContent")
    assert sent["cachedContent"].startswith("cachedContents/") and "systemInstruction" not in sent
    assert sent["contents"] == to_gemini({"messages": _turns("g", 2)})["contents"]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    written = cache_tokens(created)
    assert _details({"usage": usage}) == (PROMPT + 2 * written, written, written)


def test_a_messages_request_with_marked_blocks_uses_the_cache(lv: Live) -> None:
    """``/v1/messages`` to a Gemini route: the client's breakpoints are on its blocks, on the system prompt
    and the newest turn (Claude Code's form): the system prompt is cached, every turn reads it."""
    def body(n: int) -> dict[str, Any]:
        turns: list[dict[str, Any]] = []
        for i in range(n):
            if i:
                turns.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]})
            text: dict[str, Any] = {"type": "text", "text": f"question {i + 1}"}
            turns.append({"role": "user", "content": [text | ({"cache_control": EPH} if i == n - 1 else {})]})
        return {"model": "gem-flash", "max_tokens": 50, "messages": turns,
                "system": [{"type": "text", "text": _system("h"), "cache_control": EPH}]}

    for n in (1, 2):
        r = httpx.post(f"{lv.gateway.url}/v1/messages", json=body(n), headers={"x-api-key": CLIENT_KEY},
                       timeout=15)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == "Hello from upstream"
    [created] = _calls(lv, "gemini:cachedContents")
    assert created["systemInstruction"] == {"parts": [{"text": _system("h")}]} and "contents" not in created
    gens = _calls(lv, "gemini:generateContent")
    assert [g["cachedContent"] for g in gens] == [gens[0]["cachedContent"]] * 2
    assert [len(g["contents"]) for g in gens] == [1, 3] and "systemInstruction" not in gens[1]
    usage = r.json()["usage"]  # the second turn read the cache the first wrote
    written = cache_tokens(created)
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (written, 0)
    assert usage["input_tokens"] == PROMPT


def test_concurrent_first_turns_create_the_cache_once(lv: Live) -> None:
    _behave(lv, cache_latency_s=0.3)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda n: _chat(lv, _turns("i", n)), (1, 2, 3, 4)))
    assert len(_calls(lv, "gemini:cachedContents")) == 1
    gens = _calls(lv, "gemini:generateContent")
    assert len({g["cachedContent"] for g in gens}) == 1 and len(gens) == 4
    assert sorted(_details(o)[2] > 0 for o in outs) == [False, False, False, True]  # one wrote it
