"""The hedge plan (issue 27, ``ethen.gateway.routing.hedge``): hypothesis properties against a brute-force
oracle written from the module's docstring, plus examples."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.routing.hedge import HedgeFacts, HedgePlan, HedgeRule, nearest_rank, plan_hedge

IDS = ["a/1", "b/2", "c/3", "d/4"]


def oracle_percentile(samples: list[float], p: int) -> float:
    """The smallest sample v such that at least p % of the samples are <= v (tried one by one)."""
    n = len(samples)
    for v in sorted(set(samples)):
        if 100 * sum(1 for x in samples if x <= v) >= p * n:
            return v
    raise AssertionError("unreachable: the largest sample always qualifies")


def oracle(rule: HedgeRule, facts: HedgeFacts) -> HedgePlan:
    n = len(facts.chain)
    delays: list[float | None] = []
    for i, cid in enumerate(facts.chain):
        if i == n - 1:
            delays.append(None)
        elif rule.after_ms is not None:
            delays.append(rule.after_ms)
        else:
            s = list(facts.ttft_samples.get(cid, ()))
            assert rule.after_percentile is not None
            delays.append(oracle_percentile(s, rule.after_percentile) if len(s) >= rule.min_samples else None)
    reasons = ["after_ms" if rule.after_ms is not None else "after_percentile"]
    if facts.opt_out:
        reasons.append("opt_out")
    if rule.max_extra == 0:
        reasons.append("max_extra")
    if n < 2:
        reasons.append("no_next_candidate")
    elif all(d is None for d in delays):
        reasons.append("min_samples")
    enabled = not facts.opt_out and rule.max_extra > 0 and n >= 2 and any(d is not None for d in delays)
    over = facts.remaining_usd is not None and facts.remaining_usd < 2 * facts.reserve_usd
    if over:
        reasons.append("budget")
    return HedgePlan(enabled, tuple(delays), rule.max_extra, "budget" if over else None, tuple(reasons))


samples_st = st.lists(st.floats(min_value=0, max_value=10_000, allow_nan=False), max_size=40)


@st.composite
def cases(draw: Any) -> tuple[HedgeRule, HedgeFacts]:
    if draw(st.booleans()):
        rule = HedgeRule("ethen/fast", after_ms=draw(st.floats(min_value=1, max_value=5_000)),
                         max_extra=draw(st.integers(0, 3)))
    else:
        rule = HedgeRule("ethen/fast", after_percentile=draw(st.integers(1, 100)),
                         min_samples=draw(st.integers(1, 30)), max_extra=draw(st.integers(0, 3)))
    chain = tuple(IDS[: draw(st.integers(1, len(IDS)))])
    samples = {cid: draw(samples_st) for cid in chain if draw(st.booleans())}
    remaining = draw(st.none() | st.floats(min_value=0, max_value=1.0))
    reserve = draw(st.floats(min_value=0, max_value=0.5))
    return rule, HedgeFacts(chain, samples, draw(st.booleans()), remaining, reserve)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_plan_matches_the_brute_force_oracle(case: tuple[HedgeRule, HedgeFacts]) -> None:
    rule, facts = case
    assert plan_hedge(rule, facts) == oracle(rule, facts)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.integers(1, 100))
def test_nearest_rank_matches_the_oracle_and_is_a_sample(samples: list[float], p: int) -> None:
    v = nearest_rank(samples, p)
    assert v == oracle_percentile(samples, p) and v in samples


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.integers(1, 99))
def test_nearest_rank_is_monotone_in_p(samples: list[float], p: int) -> None:
    assert nearest_rank(samples, p) <= nearest_rank(samples, p + 1)


def test_examples() -> None:
    s = [float(x) for x in range(1, 21)]  # 1..20 ms
    assert nearest_rank(s, 95) == 19.0 and nearest_rank(s, 100) == 20.0 and nearest_rank(s, 1) == 1.0
    rule = HedgeRule("ethen/fast", after_percentile=95, min_samples=20)
    plan = plan_hedge(rule, HedgeFacts(("a/1", "b/2"), {"a/1": s}))
    assert plan.enabled and plan.delays == (19.0, None) and plan.after_ms == 19.0
    few = plan_hedge(rule, HedgeFacts(("a/1", "b/2"), {"a/1": s[:19]}))  # below min_samples: no hedge
    assert not few.enabled and few.delays == (None, None) and "min_samples" in few.reasons
    fixed = HedgeRule("ethen/fast", after_ms=400)
    assert plan_hedge(fixed, HedgeFacts(("a/1",), {})).reasons == ("after_ms", "no_next_candidate")
    out = plan_hedge(fixed, HedgeFacts(("a/1", "b/2"), {}, remaining_usd=0.019, reserve_usd=0.01))
    assert out.enabled and out.blocked == "budget"  # 1.9x the reservation: cannot cover both attempts
    ok = plan_hedge(fixed, HedgeFacts(("a/1", "b/2"), {}, remaining_usd=0.02, reserve_usd=0.01))
    assert ok.blocked is None
    assert not plan_hedge(fixed, HedgeFacts(("a/1", "b/2"), {}, opt_out=True)).enabled


def test_rule_needs_exactly_one_delay() -> None:
    with pytest.raises(ValueError):
        HedgeRule("ethen/fast")
    with pytest.raises(ValueError):
        HedgeRule("ethen/fast", after_ms=1, after_percentile=9)
