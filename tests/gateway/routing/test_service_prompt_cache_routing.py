"""Cache-aware routing through the real gateway (issue 45 item 2): a conversation's second turn stays on the
provider holding its prefix in its prompt cache because that is cheaper there, while a new conversation goes
to the provider that is cheaper uncached."""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack
from typing import Any

import httpx
import redis

from ethen.app import create_app
from ethen.gateway.config import parse_config
from tests.gateway.accounting.test_ratelimit import redis_url_or_skip
from tests.gateway.service_harness import CLIENT_KEY, ENV, ROUTES, Live, config_dict, live
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

INFO = {**ROUTES[0]["info"], "context_window": 200_000}
AGENT_ROUTES = [
    # Anthropic: 3.00 $/Mtok input, reads at 0.1x (genai-prices' claude-sonnet-4-5)
    {"model": "agent", "provider": "gamma", "upstream_model": "claude-sonnet-4-5", "info": INFO,
     "prices": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}},
    # an OpenAI-compatible upstream: cheaper uncached, no known cache-read price
    {"model": "agent", "provider": "alpha", "upstream_model": "up-agent", "info": INFO,
     "prices": {"input_per_mtok": 2.0, "output_per_mtok": 15.0}},
]  # fmt: skip
PROMPT = 20_000  # what the upstreams bill as the prompt (the memory records it)
SYSTEM = "You are a coding agent with many tools. " * 1650  # ~66 kB: ~22k tokens by the gateway's estimate
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}


def _turn(lv: Any, system: str, turns: list[dict[str, Any]], only: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "agent", "max_tokens": 100,
                            "messages": [{"role": "system", "content": system}, *turns]}
    if only is not None:
        body["providerOptions"] = {"gateway": {"only": [only]}}
    r = httpx.post(f"{lv.base_url}/chat/completions", json=body, headers=HEADERS, timeout=15)
    assert r.status_code == 200, r.text
    routing: dict[str, Any] = r.json()["ethen"]["routing"]
    return routing


def test_the_second_turn_stays_where_its_prefix_is_cached() -> None:
    behaviors = {m: Behavior(prompt_tokens=PROMPT, tool_call=False)
                 for m in ("claude-sonnet-4-5", "up-agent")}
    with live(behaviors, routes=AGENT_ROUTES) as lv:
        first = [{"role": "user", "content": "fix the bug in parser.py"}]
        # both providers get one served call (the same telemetry), each for its own conversation
        assert _turn(lv, "other agent " + SYSTEM, first, only="alpha")["selected_provider"] == "alpha"
        one = _turn(lv, SYSTEM, first, only="gamma")
        assert one["selected_provider"] == "gamma" and one["expected_cached_tokens"] == 0
        # a conversation nobody holds goes where the uncached price is lower
        new = _turn(lv, "a third agent " + SYSTEM, first)
        assert new["selected_provider"] == "alpha" and new["expected_cached_tokens"] == 0
        # the next turn of the conversation gamma served: its prefix is read at 0.1x there
        second = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now tests"}]
        two = _turn(lv, SYSTEM, second)
        assert two["selected_provider"] == "gamma"
        assert two["expected_cached_tokens"] == PROMPT
        assert two["chain"] == ["gamma/agent", "alpha/agent"]
        assert two["score_components"]["cost"] > new["score_components"]["cost"]
        # the Anthropic upstream was asked to cache that prefix (auto breakpoints)
        sent = [c["body"] for c in lv.script.calls if c["path"] == "messages"][-1]
        assert sent["system"][-1]["cache_control"] == {"type": "ephemeral"}


def test_instances_share_who_holds_a_prefix_through_redis() -> None:
    url = redis_url_or_skip()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    behaviors = {m: Behavior(prompt_tokens=PROMPT, tool_call=False)
                 for m in ("claude-sonnet-4-5", "up-agent")}
    script = Script(behaviors=behaviors)
    with ExitStack() as stack:
        up = stack.enter_context(ServerThread(make_upstream_app(script)))
        shared = {"redis_url": url, "key_prefix": prefix}
        cfg = parse_config(config_dict(up.url, routes=AGENT_ROUTES, shared=shared))
        a, b = (Live(script, up, stack.enter_context(ServerThread(create_app(cfg, env=ENV))), cfg)
                for _ in "ab")
        first = [{"role": "user", "content": "fix the bug in parser.py"}]
        _turn(b, "other agent " + SYSTEM, first, only="alpha")  # b's telemetry: one alpha call ...
        _turn(a, SYSTEM, first, only="gamma")  # ... a serves the conversation's first turn on gamma
        rd = redis.Redis.from_url(url)
        deadline = time.monotonic() + 5
        while not list(rd.scan_iter(match=f"{prefix}:pcache:*")):
            assert time.monotonic() < deadline, "the holder never reached Redis"
            time.sleep(0.01)
        key = next(k for k in rd.scan_iter(match=f"{prefix}:pcache:*") if rd.hexists(k, "gamma/agent"))
        assert 0 < rd.ttl(key) <= 301 and SYSTEM[:20].encode() not in key  # a hash, never the text
        second = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now tests"}]
        two = _turn(b, SYSTEM, second)  # b never served this conversation: it learns the holder from Redis
        assert two["selected_provider"] == "gamma" and two["expected_cached_tokens"] == PROMPT


def test_cache_blind_routing_prices_every_candidate_uncached() -> None:
    """``[prompt_cache] cache_aware_routing = false``: the same conversation's second turn is priced as if
    nothing were cached, so it goes where the uncached price is lower (the bench's baseline)."""
    behaviors = {m: Behavior(prompt_tokens=PROMPT, tool_call=False)
                 for m in ("claude-sonnet-4-5", "up-agent")}
    with live(behaviors, routes=AGENT_ROUTES, prompt_cache={"cache_aware_routing": False}) as lv:
        first = [{"role": "user", "content": "fix the bug in parser.py"}]
        assert _turn(lv, "other agent " + SYSTEM, first, only="alpha")["selected_provider"] == "alpha"
        assert _turn(lv, SYSTEM, first, only="gamma")["selected_provider"] == "gamma"
        second = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now tests"}]
        two = _turn(lv, SYSTEM, second)
        assert two["selected_provider"] == "alpha" and two["expected_cached_tokens"] == 0
        # the breakpoints are still placed: only the scoring is blind
        sent = [c["body"] for c in lv.script.calls if c["path"] == "messages"][-1]
        assert sent["system"][-1]["cache_control"] == {"type": "ephemeral"}
