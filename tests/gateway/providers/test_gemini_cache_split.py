"""Gemini explicit context caching, the pure part (:mod:`ethen.gateway.providers.gemini_cache`): the split of
a translated body at the client's last breakpoint and the memory of cache names, against brute-force
oracles (the cut: translating the covered messages alone and comparing turns)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.api.messages import chat_breakpoints, to_chat
from ethen.gateway.providers.gemini_cache import (
    CACHED_KEYS,
    CacheNames,
    breakpoints,
    choose_cut,
    expire_epoch,
    min_cache_tokens,
    plan,
    prefix_key,
    split_at,
)
from ethen.gateway.providers.gemini_wire import to_gemini

TTLS = st.sampled_from([None, "5m", "1h"])
EPH = {"type": "ephemeral"}


def _mark(ttl: str | None) -> dict[str, Any]:
    return {"type": "ephemeral"} | ({"ttl": ttl} if ttl else {})


@st.composite
def _content(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return draw(st.sampled_from(["", "a", "bb", "hello"]))
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        part: dict[str, Any] = {"type": "text", "text": draw(st.sampled_from(["x", "yy", ""]))}
        if draw(st.integers(0, 4)) == 0:
            part["cache_control"] = _mark(draw(TTLS))
        parts.append(part)
    return parts


@st.composite
def _chat(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    calls = 0
    for _ in range(draw(st.integers(0, 9))):
        role = draw(st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]))
        msg: dict[str, Any] = {"role": role, "content": draw(_content())}
        if role == "assistant" and draw(st.booleans()):
            msg["tool_calls"] = [{"id": f"c{calls}", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}]
            calls += 1
        if role == "tool":
            msg["tool_call_id"] = f"c{draw(st.integers(0, max(0, calls - 1)))}"
        if draw(st.integers(0, 4)) == 0:
            msg["cache_control"] = _mark(draw(TTLS))
        messages.append(msg)
    body: dict[str, Any] = {"messages": messages}
    if draw(st.booleans()):
        tool: dict[str, Any] = {"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        if draw(st.booleans()):
            tool["cache_control"] = _mark(draw(TTLS))
        body["tools"] = [tool]
        if draw(st.booleans()):
            body["tool_choice"] = "auto"
    if draw(st.booleans()):
        body["temperature"] = 0.5
    return body


def _oracle_marks(chat: dict[str, Any]) -> list[tuple[int, int]]:
    """(messages covered, ttl s) of every breakpoint, found the plain way."""
    out = []
    tool_marks = [t["cache_control"] for t in chat.get("tools", ()) if "cache_control" in t]
    if tool_marks:
        out.append((0, 3600 if any(m.get("ttl") == "1h" for m in tool_marks) else 300))
    for i, msg in enumerate(chat["messages"]):
        marks = [msg["cache_control"]] if "cache_control" in msg else []
        if isinstance(msg["content"], list):
            marks += [p["cache_control"] for p in msg["content"] if "cache_control" in p]
        if marks:
            out.append((i + 1, 3600 if any(m.get("ttl") == "1h" for m in marks) else 300))
    return out


def _oracle_cut(chat: dict[str, Any], covered: int) -> int:
    """The leading turns of the full translation equal to those of the covered messages translated alone."""
    full = to_gemini(chat)["contents"]
    alone = to_gemini({**chat, "messages": chat["messages"][:covered]})["contents"]
    k = min(len(full), len(alone))
    while k and alone[:k] != full[:k]:
        k -= 1
    return k


@settings(max_examples=400, deadline=None)
@given(_chat())
def test_the_cut_is_the_last_breakpoint_leaving_the_request_a_turn(chat: dict[str, Any]) -> None:
    full = to_gemini(chat)["contents"]
    marks = _oracle_marks(chat)
    assert [(b.covered, b.ttl_s) for b in breakpoints(chat)] == marks
    usable = [(_oracle_cut(chat, covered), ttl) for covered, ttl in marks]
    usable = [(cut, ttl) for cut, ttl in usable if cut < len(full)]
    want = None
    if usable:
        cut = max(c for c, _ in usable)
        want = (cut, max(t for c, t in usable if c == cut))
    elif marks and full:  # every mark in the last turn: what precedes the messages
        want = (0, max(t for _, t in marks))
    assert choose_cut(chat, len(full)) == want


@settings(max_examples=300, deadline=None)
@given(_chat(), st.integers(0, 12))
def test_prefix_and_rest_make_the_original(chat: dict[str, Any], cut: int) -> None:
    gemini = to_gemini(chat, "m-flash")
    cut = min(cut, len(gemini["contents"]))
    split = split_at(gemini, cut, "m-flash", 300)
    assert split.cached.get("contents", []) + split.rest["contents"] == gemini["contents"]
    assert len(split.cached.get("contents", [])) == cut == split.turns
    assert not set(split.rest) & set(CACHED_KEYS)
    assert {k: v for k, v in split.cached.items() if k != "contents"} == {
        k: gemini[k] for k in CACHED_KEYS if k in gemini}
    assert {k: v for k, v in split.rest.items() if k != "contents"} == {
        k: v for k, v in gemini.items() if k not in (*CACHED_KEYS, "contents")}
    assert split.key == prefix_key("models/m-flash", split.cached) != prefix_key("m-pro", split.cached)
    assert len(split.key) == 64 and "hello" not in split.key


def test_plan_caches_only_a_marked_prefix_past_the_minimum() -> None:
    big = "word " * 1000  # 5,000 bytes: ~1,666 tokens estimated
    chat = {"messages": [{"role": "system", "content": [{"type": "text", "text": big,
                                                         "cache_control": {"type": "ephemeral"}}]},
                         {"role": "user", "content": "q"}]}  # fmt: skip
    split = plan(chat, to_gemini(chat), "gemini-2.5-flash")
    assert split is not None and split.turns == 0 and split.ttl_s == 300
    assert split.cached == {"systemInstruction": {"parts": [{"text": big}]}}
    assert split.rest == {"contents": [{"role": "user", "parts": [{"text": "q"}]}]}
    assert plan(chat, to_gemini(chat), "gemini-2.5-pro") is None  # Pro: 4,096 tokens at least
    assert (min_cache_tokens("gemini-2.5-pro"), min_cache_tokens("gemini-3-flash-preview")) == (4096, 1024)
    unmarked = {"messages": [{"role": "system", "content": big}, {"role": "user", "content": "q"}]}
    assert plan(unmarked, to_gemini(unmarked), "gemini-2.5-flash") is None
    # a mark on the last turn only: what precedes the messages is cached, the turn goes with the request
    hour = {"type": "ephemeral", "ttl": "1h"}
    last = {"messages": [{"role": "system", "content": big},
                         {"role": "user", "content": "q", "cache_control": hour}]}
    split = plan(last, to_gemini(last), "gemini-2.5-flash")
    assert split is not None and split.turns == 0 and split.ttl_s == 3600


_OPS = st.lists(st.tuples(st.sampled_from(["hold", "refuse", "drop", "lookup"]), st.sampled_from("abcde"),
                          st.integers(0, 50)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_cache_names_against_a_plain_model(ops: list[tuple[str, str, int]]) -> None:
    names = CacheNames(max_entries=3)
    model: dict[str, tuple[str | None, float]] = {}  # key -> (name, until), in least recently used order
    now = 1000.0
    for op, key, dt in ops:
        now += dt
        if op == "hold":
            expires = now + 100
            until = expires - min(30.0, 100 / 10)
            model.pop(key, None)
            model[key] = (f"cachedContents/{key}", until)
            names.hold(key, f"cachedContents/{key}", expires, now)
        elif op == "refuse":
            model.pop(key, None)
            model[key] = (None, now + 60)
            names.refuse(key, now + 60)
        elif op == "drop":
            model.pop(key, None)
            names.drop(key)
        else:
            held = model.get(key)
            want = None
            if held is not None and held[1] <= now:
                del model[key]
            elif held is not None:
                want = (held[0],)
                model[key] = model.pop(key)
            assert names.lookup(key, now) == want
        while len(model) > 3:
            del model[next(iter(model))]
        assert len(names) == len(model)


def test_expire_time_is_read_to_the_microsecond() -> None:
    want = datetime(2026, 12, 7, 23, 35, 0, 123456, tzinfo=UTC).timestamp()
    assert expire_epoch("2026-12-07T23:35:00.123456789Z", 5.0) == want
    assert expire_epoch("2026-12-07T23:35:00Z", 5.0) == want - 0.123456
    assert expire_epoch("soon", 5.0) == expire_epoch(None, 5.0) == 5.0


def test_a_messages_body_marks_land_on_its_chat_translation() -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "model": "m", "max_tokens": 5,
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": EPH}],
        "system": [{"type": "text", "text": "sys", "cache_control": hour}],
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [  # -> a tool message and a user message, both covered
                {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                {"type": "text", "text": "b", "cache_control": EPH}]},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": [  # marked before its end: only the turns before it are covered
                {"type": "text", "text": "d", "cache_control": EPH}, {"type": "text", "text": "e"}]},
        ],
    }  # fmt: skip
    marks = chat_breakpoints(body)
    assert marks == [(0, EPH), (1, hour), (5, EPH), (6, EPH)]
    chat = to_chat(body)
    assert [m["role"] for m in chat["messages"][:5]] == ["system", "user", "assistant", "tool", "user"]
    gemini = to_gemini(chat)
    # the last mark covers chat messages up to "c": the Gemini turns before "d e" are cached
    assert choose_cut(chat, len(gemini["contents"]), marks) == (4, 300)
    assert chat_breakpoints({"messages": "nope"}) == [] == chat_breakpoints({"model": "m", "messages": [{}]})
