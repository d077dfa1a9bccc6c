"""The shell of cache-aware routing (:class:`~ethen.gateway.api.prompt_memory.PromptMemory`) without Redis:
a scope with nothing recorded is looked up without hashing the prompt, the hash is worked out when it is
first needed, and a prompt too short for any provider's cache is not recorded; what a lookup finds is the
same as before."""

from __future__ import annotations

import asyncio
from typing import Any

from ethen.gateway.api.prompt_memory import PromptMemory
from ethen.gateway.routing import Candidate, ModelInfo, PrefixMemory, Prices, prefix_hashes
from ethen.gateway.routing.prefix import MIN_CACHED_TOKENS

INFO = ModelInfo(context_window=128_000, max_output_tokens=4_096)
GPT = Candidate("oai", "gpt", INFO, Prices(1.0, 2.0))
TURN1 = {"model": "x", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}
TURN2 = {**TURN1, "messages": [*TURN1["messages"], {"role": "assistant", "content": "a"},
                               {"role": "user", "content": "q2"}]}


def _lookup(pm: PromptMemory, scope: str, body: dict[str, Any]) -> Any:
    return asyncio.run(pm.lookup(scope, body))


def test_an_empty_scope_is_looked_up_without_hashing_and_the_hash_comes_when_needed() -> None:
    pm = PromptMemory({"oai": "openai_compat"}, False)
    seen = _lookup(pm, "project:a", TURN1)
    assert seen is not None and dict(seen.cached) == {} and seen._prompt is None  # not hashed yet
    assert seen.prompt == prefix_hashes(TURN1)[-1]  # the same hash, when remember needs it
    pm.remember(seen, GPT, MIN_CACHED_TOKENS, TURN1)
    again = _lookup(pm, "project:a", TURN2)  # the next turn: the scope holds a prefix now
    assert again is not None and dict(again.cached) == {GPT.key: MIN_CACHED_TOKENS}
    assert again._prompt == prefix_hashes(TURN2)[-1]  # hashed once, at the lookup, and kept
    other = _lookup(pm, "project:b", TURN2)  # another project never learns it
    assert other is not None and dict(other.cached) == {}


def test_a_prompt_too_short_to_be_cached_is_not_recorded() -> None:
    memory = PrefixMemory()
    pm = PromptMemory({"oai": "openai_compat"}, False, memory)
    seen = _lookup(pm, "project:a", TURN1)
    pm.remember(seen, GPT, MIN_CACHED_TOKENS - 1, TURN1)
    assert len(memory) == 0 and not memory.holds("project:a")
    assert seen._prompt is None  # nor hashed
    pm.remember(seen, GPT, MIN_CACHED_TOKENS, TURN1)
    assert len(memory) == 1 and memory.holds("project:a")


def test_no_chat_body_is_no_prefix_whether_the_scope_holds_one_or_not() -> None:
    pm = PromptMemory({"oai": "openai_compat"}, False)
    bodies: list[dict[str, Any]] = [{"messages": "x"}, {"messages": [1, "y"]}, {"input": "z"},
                                    {"messages": []}]
    for body in bodies:
        assert _lookup(pm, "project:a", body) is None
    pm.remember(_lookup(pm, "project:a", TURN1), GPT, 5_000, TURN1)
    for body in bodies:
        assert _lookup(pm, "project:a", body) is None
    assert _lookup(PromptMemory({}, False, aware=False), "project:a", TURN1) is None
