"""Cache-aware cost (issue 45 item 2), pure: the scorer's cost component with the prompt-cache lookup, and the
bounded prefix memory, each against a brute-force oracle written here."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ethen.gateway.errors import ModelNotFoundError, NoSmartRouteCandidateError
from ethen.gateway.routing import Candidate, PrefixMemory, RoutingContext, decide, prefix_hashes
from ethen.gateway.routing.policy import COST_REF_USD_PER_MTOK
from ethen.gateway.routing.prefix import MIN_CACHED_TOKENS, cache_ttl_s
from tests.gateway.routing.test_routing_properties import oracle, scenarios

RATIOS = st.sampled_from([1.0, 0.5, 0.25, 0.1, 0.0])


@st.composite
def cached_scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], RoutingContext, dict[tuple[str, str], int]]:
    body, ctx = draw(scenarios())
    pool = tuple(dataclasses.replace(c, cache_read_ratio=draw(RATIOS)) for c in ctx.pool)
    cached = {c.key: draw(st.integers(1, 300_000)) for c in pool if draw(st.booleans())}
    return body, dataclasses.replace(ctx, pool=pool), cached


def _decide(body: dict[str, Any], ctx: RoutingContext) -> Any:
    try:
        return decide(body, ctx)
    except (ModelNotFoundError, NoSmartRouteCandidateError):
        return None


def _oracle_cost_component(cand: Candidate, tokens: int, out: int, held: int) -> tuple[int, float]:
    hit = min(held, tokens)
    p = cand.prices
    usd = ((tokens - hit) * p.input_per_mtok + hit * p.input_per_mtok * cand.cache_read_ratio
           + out * p.output_per_mtok) / 1e6
    total = tokens + out
    return hit, COST_REF_USD_PER_MTOK / (COST_REF_USD_PER_MTOK + usd * 1e6 / total) if total else 1.0


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cached_scenarios())
def test_cached_share_is_priced_at_the_cache_read_price(
    scenario: tuple[dict[str, Any], RoutingContext, dict[tuple[str, str], int]],
) -> None:
    body, blind_ctx, cached = scenario
    blind = _decide(body, blind_ctx)
    aware = _decide(body, dataclasses.replace(blind_ctx, cached=cached))
    if blind is None:
        assert aware is None  # the cache never makes a request feasible: gates price it uncached
        return
    assert aware is not None
    # the same candidates pass and are rejected, with the same (uncached) estimates
    assert {sc.id for sc in aware.chain} == {sc.id for sc in blind.chain}
    assert aware.rejected == blind.rejected
    tokens = aware.requirements.input_tokens
    needs = oracle.needs_of(body)
    by_id = {sc.id: sc for sc in blind.chain}
    for sc in aware.chain:
        cand = sc.candidate
        out = min(oracle.DEFAULT_OUT, cand.info.max_output_tokens) if needs.max_out is None else needs.max_out
        hit, cost = _oracle_cost_component(cand, tokens, out, cached.get(cand.key, 0))
        assert sc.expected_cached_tokens == hit
        assert sc.cost == pytest.approx(cost)
        assert sc.cost >= by_id[sc.id].cost - 1e-12  # a cached share never makes a candidate dearer
        assert sc.estimated_cost_usd == by_id[sc.id].estimated_cost_usd
        others = sc.components.as_tuple()[:1] + sc.components.as_tuple()[2:]
        blind_c = by_id[sc.id].components.as_tuple()
        assert others == blind_c[:1] + blind_c[2:]
    if aware.canary is None or not aware.canary.promoted:
        top = aware.chain[0]
        assert aware.receipt.to_dict()["expected_cached_tokens"] == top.expected_cached_tokens
        assert all(top.score >= sc.score for sc in aware.chain)


# ---- the prefix memory against a brute-force log of every record ----

HASHES = [f"h{i}" for i in range(6)]
HOLDERS = [("anth", "claude"), ("oai", "gpt"), ("oai", "mini")]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(["p1", "p2"]), st.sampled_from(HASHES),
                  st.sampled_from(HOLDERS), st.integers(0, 5000), st.sampled_from([1.0, 300.0, 3600.0]),
                  st.floats(0, 50)),
        st.tuples(st.just("lookup"), st.sampled_from(["p1", "p2"]), st.integers(1, len(HASHES)),
                  st.floats(0, 50)),
    ),
    max_size=40,
)


def _brute(log: list[tuple[str, str, tuple[str, str], int, float]], scope: str, hashes: list[str],
           now: float) -> dict[tuple[str, str], int]:
    """Per holder: the tokens of its latest record under the longest of ``hashes`` it holds unexpired."""
    latest: dict[tuple[str, str, tuple[str, str]], tuple[int, float]] = {}
    for s, h, holder, tokens, expires in log:
        latest[(s, h, holder)] = (tokens, expires)
    out: dict[tuple[str, str], int] = {}
    for h in reversed(hashes):
        for holder in HOLDERS:
            got = latest.get((scope, h, holder))
            if got is not None and got[1] > now and got[0] >= MIN_CACHED_TOKENS and holder not in out:
                out[holder] = got[0]
    return out


@settings(max_examples=600, deadline=None)
@given(OPS, st.sampled_from([1, 2, 3, 100]), st.sampled_from([300, 800, 10**9]))
def test_memory_matches_a_brute_force_log_within_its_bounds(ops: list[Any], entries: int, nbytes: int
                                                            ) -> None:
    mem = PrefixMemory(max_entries=entries, max_bytes=nbytes)
    log: list[tuple[str, str, tuple[str, str], int, float]] = []
    t = 0.0
    for op in ops:
        t += op[-1]  # time only moves forward
        if op[0] == "record":
            _, scope, h, holder, tokens, ttl, _dt = op
            mem.record(scope, h, holder, tokens, ttl, t)
            log.append((scope, h, holder, tokens, t + ttl))
        else:
            _, scope, n, _dt = op
            got = mem.lookup(scope, HASHES[:n], t)
            want = _brute(log, scope, HASHES[:n], t)
            if entries >= 100 and nbytes >= 10**9:
                assert got == want  # unbounded: exactly the log's answer
            else:  # bounded: what is left is right, from the same or a shorter prefix
                for holder, tokens in got.items():
                    assert any(s == scope and hh in HASHES[:n] and ho == holder and tk == tokens and ex > t
                               for s, hh, ho, tk, ex in log)
        assert len(mem) <= entries
        assert mem.bytes <= nbytes or len(mem) <= 1


def test_prefix_hashes_extend_turn_by_turn_and_ignore_the_api_shape() -> None:
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "q2"}]}
    parts = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "S"}]},
                          {"role": "user", "content": [{"type": "text", "text": "q1"}]}]}
    h1, h2 = prefix_hashes(turn1), prefix_hashes(turn2)
    assert h2[: len(h1)] == h1 and len(h2) == 4 and prefix_hashes(parts) == h1
    assert prefix_hashes({**turn1, "tools": [{"type": "function"}]})[0] != h1[0]
    assert all("q1" not in h and "S" not in h for h in h1)


def test_ttl_by_kind_and_breakpoint() -> None:
    mark = {"type": "ephemeral", "ttl": "1h"}
    hour = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": mark}]}]}
    plain = {"messages": [{"role": "user", "content": "x"}]}
    assert cache_ttl_s("anthropic", [plain], True) == 300.0
    assert cache_ttl_s("anthropic", [plain], False) is None  # no breakpoint: Anthropic caches nothing
    assert cache_ttl_s("anthropic", [hour], False) == 3600.0
    assert cache_ttl_s("openai_compat", [plain], False) == 300.0
    assert cache_ttl_s("mesh", [plain], True) is None


def test_prefix_hashes_of_a_body_that_is_no_chat_body() -> None:
    for messages in (True, 1, 1.5, "x", {"role": "user"}, None):
        assert prefix_hashes({"messages": messages, "tools": 3}) == ()
    assert len(prefix_hashes({"messages": [1, {"role": "user", "content": {"x": [1]}}], "tools": "t"})) == 1


@settings(max_examples=600, deadline=None)
@given(OPS, st.sampled_from([1, 2, 3, 100]), st.sampled_from([300, 800, 10**9]))
def test_holds_names_exactly_the_scopes_with_an_entry(ops: list[Any], entries: int, nbytes: int) -> None:
    """The shell skips hashing a prompt of a scope ``holds`` denies: it must never deny one with an entry
    (evictions included), and a scope it denies finds nothing."""
    mem = PrefixMemory(max_entries=entries, max_bytes=nbytes)
    t = 0.0
    for op in ops:
        t += op[-1]
        if op[0] == "record":
            _, scope, h, holder, tokens, ttl, _dt = op
            mem.record(scope, h, holder, tokens, ttl, t)
        for scope in ("p1", "p2"):
            assert mem.holds(scope) == any(key[0] == scope for key in mem._entries)
            if not mem.holds(scope):
                assert mem.lookup(scope, HASHES, t) == {}
