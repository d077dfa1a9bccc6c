"""The shadow plan (issue 27, ``ethen.gateway.routing.shadow``): hypothesis properties against a brute-force
oracle written from the module's docstring (its own hash, its own gate checks), plus examples."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.routing import Candidate, ModelInfo, Prices, ProjectPolicy, Requirements
from ethen.gateway.routing.policy import HardGates
from ethen.gateway.routing.shadow import (
    ShadowFacts,
    ShadowPlan,
    ShadowRule,
    plan_shadows,
    promotion_verdict,
    sampled,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
ALIAS = "ethen/coding"


def cand(pid: str, model: str, *, tools: bool, vision: bool, structured: bool, ctx: int,
         out: int) -> Candidate:
    info = ModelInfo(context_window=ctx, max_output_tokens=out, supports_tools=tools, supports_vision=vision,
                     supports_structured_output=structured)
    return Candidate(pid, model, info, Prices(1.0, 2.0))


def oracle_bucket(rid: str, alias: str, cid: str) -> int:
    h = hashlib.blake2b(f"{alias}|{cid}|{rid}".encode(), digest_size=8, person=b"ethen-shadow").digest()
    return int.from_bytes(h, "big") % 10_000


def oracle_gates(c: Candidate, f: ShadowFacts) -> list[str]:
    req, g, info, pol = f.requirements, f.gates, c.info, f.policy
    out = []
    if pol.allowed_providers is not None and c.provider not in pol.allowed_providers:
        out.append("provider_not_allowed")
    models = pol.allowed_models
    if models is not None and c.model not in models and c.id not in models:
        out.append("model_not_allowed")
    if req.only_providers is not None and c.provider not in req.only_providers:
        out.append("provider_not_requested")
    if g.tools and not info.supports_tools:
        out.append("alias_requires_tools")
    if g.vision and not info.supports_vision:
        out.append("alias_requires_vision")
    if info.context_window < g.min_context:
        out.append("alias_requires_context")
    if req.tools and not info.supports_tools:
        out.append("no_tool_support")
    if req.vision and not info.supports_vision:
        out.append("no_vision_support")
    if req.structured_output and not info.supports_structured_output:
        out.append("no_structured_output_support")
    if req.input_tokens + (req.max_output_tokens or 0) > info.context_window:
        out.append("context_window_too_small")
    if req.max_output_tokens is not None and req.max_output_tokens > info.max_output_tokens:
        out.append("max_output_too_small")
    return out


def oracle(rules: list[ShadowRule], f: ShadowFacts) -> list[ShadowPlan]:
    out = []
    for rule in sorted(rules, key=lambda r: r.candidate):
        if rule.alias != f.alias:
            continue
        b = oracle_bucket(f.request_id, rule.alias, rule.candidate)
        if not b < round(rule.percent * 100):
            out.append(ShadowPlan(rule, False, "not_sampled", b))
        elif rule.candidate == f.served:
            out.append(ShadowPlan(rule, False, "same_as_primary", b))
        elif rule.candidate not in f.pool:
            out.append(ShadowPlan(rule, False, "unknown_candidate", b))
        elif why := oracle_gates(f.pool[rule.candidate], f):
            out.append(ShadowPlan(rule, False, "skipped_gate", b, tuple(why)))
        elif f.in_flight.get((rule.alias, rule.candidate), 0) >= rule.max_in_flight:
            out.append(ShadowPlan(rule, False, "dropped_in_flight", b))
        else:
            out.append(ShadowPlan(rule, True, "sent", b))
    return out


IDS = ["a/m1", "b/m2", "c/m3", "d/m4"]


@st.composite
def cases(draw: Any) -> tuple[list[ShadowRule], ShadowFacts]:
    pool = {}
    for cid in draw(st.lists(st.sampled_from(IDS), unique=True)):
        p, m = cid.split("/")
        pool[cid] = cand(p, m, tools=draw(st.booleans()), vision=draw(st.booleans()),
                         structured=draw(st.booleans()), ctx=draw(st.integers(1_000, 200_000)),
                         out=draw(st.integers(100, 10_000)))
    rules = [ShadowRule(draw(st.sampled_from([ALIAS, "ethen/fast"])), cid,
                        draw(st.sampled_from([0, 0.5, 1, 5, 37.25, 50, 99.99, 100])), "shadow-evals",
                        draw(st.integers(1, 4)))
             for cid in draw(st.lists(st.sampled_from(IDS), unique=True))]
    req = Requirements(ALIAS, tools=draw(st.booleans()), vision=draw(st.booleans()),
                       structured_output=draw(st.booleans()), input_tokens=draw(st.integers(0, 150_000)),
                       max_output_tokens=draw(st.none() | st.integers(1, 20_000)),
                       only_providers=draw(st.none() | st.frozensets(st.sampled_from("abcd"))))
    gates = HardGates(draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0, 64_000])))
    policy = ProjectPolicy(draw(st.none() | st.frozensets(st.sampled_from("abcd"))),
                           draw(st.none() | st.frozensets(st.sampled_from(["m1", "b/m2", "m3"]))),
                           draw(st.none() | st.floats(0, 1)))
    in_flight = {(ALIAS, cid): draw(st.integers(0, 5)) for cid in IDS if draw(st.booleans())}
    facts = ShadowFacts(draw(st.text(min_size=1, max_size=12)), ALIAS, draw(st.sampled_from(IDS)), req, gates,
                        policy, pool, in_flight, NOW)
    return rules, facts


@settings(max_examples=500, deadline=None)
@given(cases())
def test_plan_matches_the_brute_force_oracle(case: tuple[list[ShadowRule], ShadowFacts]) -> None:
    rules, facts = case
    assert list(plan_shadows(rules, facts)) == oracle(rules, facts)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40), st.floats(0, 100), st.floats(0, 100))
def test_sampling_is_deterministic_and_monotone_in_percent(rid: str, p: float, q: float) -> None:
    lo, hi = sorted((p, q))
    a = ShadowRule(ALIAS, "a/m1", lo, "x")
    b = ShadowRule(ALIAS, "a/m1", hi, "x")
    assert sampled(a, rid) == sampled(a, rid)  # pure: same id, same answer
    if sampled(a, rid)[0]:
        assert sampled(b, rid)[0]  # a request sampled at lo % is sampled at any higher percent
    assert not sampled(ShadowRule(ALIAS, "a/m1", 0, "x"), rid)[0]
    assert sampled(ShadowRule(ALIAS, "a/m1", 100, "x"), rid)[0]


def test_sampled_fraction_is_close_to_percent() -> None:
    rule = ShadowRule(ALIAS, "a/m1", 5, "x")
    hits = sum(sampled(rule, f"req-{i}")[0] for i in range(20_000))
    assert 0.04 < hits / 20_000 < 0.06


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 100), st.none() | st.floats(0, 1), st.integers(0, 50), st.floats(0, 1))
def test_promotion_verdict_matches_its_definition(n: int, rate: float | None, min_n: int,
                                                  min_rate: float) -> None:
    rule = ShadowRule(ALIAS, "a/m1", 5, "x", min_samples=min_n, min_success_rate=min_rate)
    ok, why = promotion_verdict(n, rate, rule)
    assert ok == (n >= min_n and rate is not None and rate >= min_rate)
    if not ok:
        assert ("min_samples" in why) == (n < min_n)


def test_examples() -> None:
    tools_less = cand("b", "m2", tools=False, vision=False, structured=False, ctx=100_000, out=1_000)
    req = Requirements(ALIAS, tools=True, input_tokens=10)
    facts = ShadowFacts("r1", ALIAS, "a/m1", req, HardGates(), ProjectPolicy(), {"b/m2": tools_less}, {}, NOW)
    (plan,) = plan_shadows([ShadowRule(ALIAS, "b/m2", 100, "x")], facts)
    assert plan.reason == "skipped_gate" and plan.gate_reasons == ("no_tool_support",) and not plan.send
    assert plan.to_dict()["gate_reasons"] == ["no_tool_support"]
    ok = ShadowFacts("r1", ALIAS, "a/m1", req._replace(tools=False), HardGates(),
                     ProjectPolicy(remaining_budget_usd=0.0), {"b/m2": tools_less}, {}, NOW)
    assert plan_shadows([ShadowRule(ALIAS, "b/m2", 100, "x")], ok)[0].send  # the client's budget never gates
    full = ShadowFacts("r1", ALIAS, "a/m1", req._replace(tools=False), HardGates(), ProjectPolicy(),
                       {"b/m2": tools_less}, {(ALIAS, "b/m2"): 2}, NOW)
    assert plan_shadows([ShadowRule(ALIAS, "b/m2", 100, "x", 2)], full)[0].reason == "dropped_in_flight"
    assert plan_shadows([ShadowRule(ALIAS, "a/m1", 100, "x")], full)[0].reason == "same_as_primary"


@pytest.mark.parametrize("kw", [{"percent": 101}, {"percent": -1}, {"max_in_flight": 0},
                                {"min_success_rate": 1.5}, {"min_samples": -1}])
def test_rule_validates(kw: dict[str, Any]) -> None:
    base: dict[str, Any] = {"alias": ALIAS, "candidate": "a/m1", "percent": 5, "project": "x"}
    with pytest.raises(ValueError):
        ShadowRule(**{**base, **kw})
