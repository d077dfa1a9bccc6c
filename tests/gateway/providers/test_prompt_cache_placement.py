"""Breakpoint placement and the conversation key (pure; issue 45 item 1)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers.prompt_cache import (
    MAX_BREAKPOINTS,
    conversation_key,
    has_breakpoints,
    min_cacheable_tokens,
    place_breakpoints,
)
from tests.gateway.service_harness import config_dict


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _marks(obj: Any) -> int:
    if isinstance(obj, dict):
        return ("cache_control" in obj) + sum(_marks(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(_marks(v) for v in obj)
    return 0


def test_minimums_follow_anthropics_table() -> None:
    assert min_cacheable_tokens("claude-sonnet-4-5") == 1024
    assert min_cacheable_tokens("claude-opus-4-1") == 1024
    assert min_cacheable_tokens("claude-3-5-haiku-latest") == 2048
    assert min_cacheable_tokens("claude-haiku-4-5") == 4096
    assert min_cacheable_tokens("claude-opus-4-5") == 4096


def test_haiku_needs_a_longer_prefix_than_sonnet() -> None:
    body = {"system": "x" * (1500 * 3), "messages": [{"role": "user", "content": "hi"}]}  # ~1500 tokens
    assert _marks(place_breakpoints(body, "claude-sonnet-4-5")) == 2
    assert _marks(place_breakpoints(body, "claude-3-5-haiku-latest")) == 0


def test_thinking_blocks_are_never_marked_and_strings_become_blocks() -> None:
    body = {"system": "s" * 6000, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "thinking", "thinking": "t"}]}]}
    out = place_breakpoints(body, "claude-sonnet-4-5")
    mark = {"type": "ephemeral"}
    assert out["messages"][0]["content"] == [{"type": "text", "text": "q", "cache_control": mark}]
    assert "cache_control" not in out["messages"][2]["content"][-1]
    assert _marks(out) == 2  # system and the first user turn


_TEXT = st.text(alphabet="ab ", max_size=4000)
_BLOCK = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, _TEXT),
                   st.just({"type": "thinking", "thinking": "t", "signature": "s"}))
_MSG = st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "assistant"]),
                 st.one_of(_TEXT, st.lists(_BLOCK, max_size=3)))
_TOOL = st.builds(lambda d: {"name": "t", "description": d, "input_schema": {}}, _TEXT)
_BODY = st.fixed_dictionaries(
    {"messages": st.lists(_MSG, max_size=6)},
    optional={"system": st.one_of(_TEXT, st.lists(_BLOCK, max_size=2)),
              "tools": st.lists(_TOOL, min_size=1, max_size=3)})


@given(_BODY, st.sampled_from(["claude-sonnet-4-5", "claude-3-haiku", "claude-opus-4-5"]))
def test_placement_only_adds_at_most_four_marks_past_the_minimum(body: dict[str, Any], model: str) -> None:
    before = copy.deepcopy(body)
    out = place_breakpoints(body, model)
    assert body == before  # the input is not mutated
    assert _marks(out) <= MAX_BREAKPOINTS
    # nothing but marks changed (a string content may have become one text block)
    norm = place_breakpoints(_strip(out), model)
    assert _strip(norm) == _strip(out)
    # a prompt shorter than the minimum (every byte counted) is never marked
    if len(str(body).encode()) // 3 < min_cacheable_tokens(model):
        assert _marks(out) == 0
    # a marked body goes as it came
    if has_breakpoints(out):
        assert place_breakpoints(out, model) == out


def test_conversation_key_is_stable_across_turns_and_shapes() -> None:
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "q2"}]}
    parts = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "S"}]},
                          {"role": "user", "content": [{"type": "text", "text": "q1",
                                                        "cache_control": {"type": "ephemeral"}}]}]}
    key = conversation_key(turn1)
    assert key is not None and key == conversation_key(turn2) == conversation_key(parts)
    assert conversation_key({"messages": [{"role": "user", "content": "q2"}]}) != key
    assert conversation_key({**turn1, "tools": [{"type": "function"}]}) != key
    assert conversation_key({"messages": []}) is None


def test_a_bad_prompt_cache_setting_names_key_and_value() -> None:
    assert parse_config(config_dict("http://127.0.0.1:9")).prompt_cache.auto_breakpoints is True
    with pytest.raises(GatewayConfigError, match=r"prompt_cache\.auto_breakpoints = 'maybe'"):
        parse_config(config_dict("http://127.0.0.1:9", prompt_cache={"auto_breakpoints": "maybe"}))
