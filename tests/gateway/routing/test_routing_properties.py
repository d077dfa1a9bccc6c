"""Hypothesis properties of decide(), checked against the brute-force oracle (oracle.py, next to this file).

3,000 random (pool, policy, telemetry, body) scenarios; about a quarter route, the rest exercise the
fail-closed and model-not-found paths (every rejection reason code occurs; run with
``--hypothesis-show-statistics`` to see the mix). A further 1,500 outage scenarios (most candidates failing,
circuits drawn) check the half-open admission rule and the 503 outage path against the oracle (issue 10).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ethen.gateway.errors import ModelNotFoundError, NoHealthyCandidateError, NoSmartRouteCandidateError
from ethen.gateway.routing import (
    CANARY_PERCENTS,
    COMPONENTS,
    EMPTY_CIRCUITS,
    CanaryTarget,
    Candidate,
    CandidateStats,
    CircuitView,
    LiveCertification,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    bucket,
    decide,
    parse_requirements,
)
from ethen.gateway.routing.policy import weights_for


def _load_oracle() -> ModuleType:
    name = "ethen_tests_gateway_oracle"  # unique name: other test folders may have their own oracle.py
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("oracle.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


oracle = _load_oracle()

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
PROVIDERS = ["alpha", "beta", "gamma", "delta"]
MODELS = ["m-small", "m-mid", "m-large", "m-vision", "m-code"]
ALIAS_CHOICES = [
    "ethen/auto", "ethen/fast", "ethen/best", "ethen/cheap",
    "ethen/reasoning", "ethen/coding", "ethen/vision", "ethen/long-context",
]

model_infos = st.builds(
    ModelInfo,
    context_window=st.sampled_from(
        [1024, 8192, 32768, 63999, 64000, 65536, 127999, 128000, 131072, 200000, 1048576]
    ),
    max_output_tokens=st.sampled_from([256, 1024, 4096, 8192, 16384, 65536]),
    supports_tools=st.booleans(),
    supports_vision=st.booleans(),
    supports_structured_output=st.booleans(),
    supports_reasoning=st.booleans(),
    quality=st.floats(0, 1),
    latency_ms=st.floats(0, 20000),
    ttft_ms=st.floats(0, 5000),
)
prices = st.builds(
    Prices,
    input_per_mtok=st.sampled_from([0.0, 0.05, 0.15, 1.0, 3.0, 15.0, 60.0]),
    output_per_mtok=st.sampled_from([0.0, 0.08, 0.6, 4.0, 15.0, 75.0]),
)
certs = st.one_of(
    st.none(),
    st.builds(
        lambda a, d: LiveCertification("cert-1", NOW + timedelta(hours=a), NOW + timedelta(hours=a + d)),
        st.integers(-48, 2),
        st.integers(1, 72),
    ),
)


@st.composite
def pools(draw: st.DrawFn) -> tuple[Candidate, ...]:
    ids = draw(
        st.lists(
            st.tuples(st.sampled_from(PROVIDERS), st.sampled_from(MODELS)),
            min_size=1,
            max_size=12,
            unique=True,
        )
    )
    return tuple(Candidate(p, m, draw(model_infos), draw(prices), draw(certs)) for p, m in ids)


@st.composite
def telemetries(draw: st.DrawFn, pool: tuple[Candidate, ...]) -> TelemetrySnapshot:
    stats: dict[tuple[str, str], CandidateStats] = {}
    for c in pool:
        if draw(st.booleans()):
            n = draw(st.integers(0, 30))
            s = draw(st.integers(0, n))
            latency = draw(st.one_of(st.none(), st.floats(1, 10000)))
            ttft = draw(st.one_of(st.none(), st.floats(1, 5000)))
            streak = draw(st.integers(0, n - s))  # failures after the last success (issue 42's gate)
            stats[(c.provider, c.model)] = CandidateStats(n, s, latency, ttft, streak)
    return TelemetrySnapshot(stats)


text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=400)


@st.composite
def bodies(draw: st.DrawFn, pool: tuple[Candidate, ...]) -> dict[str, Any]:
    concrete = [c.model for c in pool] + [f"{c.provider}/{c.model}" for c in pool] + ["nope-model"]
    pick = draw(st.integers(0, 19))
    if pick < 14:
        model = draw(st.sampled_from(ALIAS_CHOICES))
    elif pick < 19:
        model = draw(st.sampled_from(concrete))
    else:
        model = "ethen/unknown"
    messages: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            repeat = draw(st.sampled_from([1, 1, 1, 50, 400]))
            messages.append({"role": "user", "content": draw(text) * repeat})
        else:
            parts: list[dict[str, Any]] = [{"type": "text", "text": draw(text)}]
            if draw(st.integers(0, 3)) == 0:
                parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
            messages.append({"role": "user", "content": parts})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if draw(st.integers(0, 3)) == 0:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    if draw(st.integers(0, 2)) == 0:
        body["response_format"] = {"type": draw(st.sampled_from(["text", "json_object", "json_schema"]))}
    if draw(st.integers(0, 2)) == 0:
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(
            st.one_of(st.integers(1, 100000), st.sampled_from([16, 256, 1024, 4096]))
        )
    routing: dict[str, Any] = {}
    if draw(st.integers(0, 2)) == 0:
        routing["budget_ceiling_usd"] = draw(st.sampled_from([0.0, 0.0001, 0.001, 0.01, 0.05, 1.0]))
    if draw(st.booleans()):
        routing["latency_target"] = draw(st.sampled_from(["fast", "balanced", "relaxed"]))
    if draw(st.integers(0, 2)) == 0:
        routing["certification_level"] = draw(st.sampled_from(["any", "live"]))
    if routing:
        body["metadata"] = {"routing": routing}
    if draw(st.integers(0, 3)) == 0:
        body["providerOptions"] = {
            "gateway": {"only": draw(st.lists(st.sampled_from(PROVIDERS), min_size=1, max_size=3))}
        }
    return body


@st.composite
def canaries(draw: st.DrawFn, pool: tuple[Candidate, ...], model: str) -> tuple[CanaryTarget, ...]:
    ids = [c.id for c in pool] + ["alpha/not-in-pool"]
    aliases = st.sampled_from([model, model, model, *ALIAS_CHOICES])  # mostly the requested model itself
    percents = st.sampled_from([*CANARY_PERCENTS, 50, 100, 100])  # every allowed value, high ones likelier
    return tuple(
        CanaryTarget(draw(aliases), draw(st.sampled_from(ids)), draw(percents))
        for _ in range(draw(st.integers(0, 2)))
    )


policies = st.builds(
    ProjectPolicy,
    allowed_providers=st.one_of(st.none(), st.none(), st.frozensets(st.sampled_from(PROVIDERS))),
    allowed_models=st.one_of(st.none(), st.none(), st.frozensets(st.sampled_from(MODELS), min_size=1)),
    remaining_budget_usd=st.one_of(st.none(), st.none(), st.sampled_from([0.0, 0.001, 0.05, 10.0])),
)


@st.composite
def circuit_views(draw: st.DrawFn, pool: tuple[Candidate, ...]) -> CircuitView:
    """Half-open keys and trial times over the pool's providers and candidate ids (the shell's circuits)."""
    keys = sorted({c.provider for c in pool} | {c.id for c in pool})
    half_open = frozenset(k for k in keys if draw(st.booleans()))
    retry_at = {
        k: NOW + timedelta(seconds=draw(st.floats(-5, 20))) for k in keys if draw(st.integers(0, 2)) > 0
    }
    return CircuitView(half_open, MappingProxyType(retry_at))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], RoutingContext]:
    pool = draw(pools())
    body = draw(bodies(pool))
    ctx = RoutingContext(
        pool=pool,
        policy=draw(policies),
        telemetry=draw(telemetries(pool)),
        canaries=draw(canaries(pool, body["model"])),
        now=NOW,
        request_id=draw(st.text(min_size=1, max_size=12)),
        circuits=draw(st.one_of(st.just(EMPTY_CIRCUITS), circuit_views(pool))),
    )
    return body, ctx


def _outcome(body: dict[str, Any], ctx: RoutingContext) -> Any:
    try:
        return decide(body, ctx)
    except (ModelNotFoundError, NoSmartRouteCandidateError) as exc:
        return exc


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_decision_matches_oracle(scenario: tuple[dict[str, Any], RoutingContext], rnd: random.Random) -> None:
    _check_against_oracle(*scenario, rnd)


@st.composite
def outage_scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], RoutingContext]:
    """Like :func:`scenarios`, but most candidates fail (0/3..0/6, or a run of 3-4 failures after earlier
    successes) and the circuits are always drawn: the half-open admission rule and the 503 outage path,
    which random telemetry rarely reaches."""
    pool = draw(pools())
    body = draw(bodies(pool))
    down = st.one_of(
        st.integers(3, 6).map(lambda n: CandidateStats(n, 0)),
        st.integers(3, 4).map(lambda k: CandidateStats(10 + k, 10, streak=k)),
    )
    stats = {
        c.key: draw(down) if draw(st.integers(0, 3)) else CandidateStats(4, 4)
        for c in pool
        if draw(st.integers(0, 5))
    }
    ctx = RoutingContext(
        pool, ProjectPolicy(), TelemetrySnapshot(stats), (), NOW, "r1", draw(circuit_views(pool))
    )
    return body, ctx


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outage_scenarios(), st.randoms(use_true_random=False))
def test_half_open_admission_matches_oracle(
    scenario: tuple[dict[str, Any], RoutingContext], rnd: random.Random
) -> None:
    _check_against_oracle(*scenario, rnd)


def _check_against_oracle(body: dict[str, Any], ctx: RoutingContext, rnd: random.Random) -> None:
    out = _outcome(body, ctx)
    event(type(out).__name__)
    if isinstance(out, NoSmartRouteCandidateError):
        for rj in out.rejections:
            for code in rj.reasons:
                event(code)
    considered = oracle.pool_for(body, ctx)
    if considered is None:
        assert isinstance(out, ModelNotFoundError)
        return
    # the oracle's expected outcome: route / half-open trial / outage (503) / fail closed (422)
    kind, expect = oracle.expected_outcome(body, ctx, parse_requirements(body).input_tokens)
    event(f"outcome {kind}")
    if isinstance(out, NoSmartRouteCandidateError):
        # fail closed: recompute the estimate the core would have used, then no candidate may be feasible
        tokens = parse_requirements(body).input_tokens
        assert oracle.feasible_ids(body, ctx, tokens) == set()
        assert {r.candidate_id for r in out.rejections} == {c.id for c in considered}
        assert all(r.reasons for r in out.rejections)
        if kind == "no_healthy":  # an outage: some candidate is excluded only by the failing gates
            assert isinstance(out, NoHealthyCandidateError)
            assert out.retry_after_s == oracle.expected_retry_after(body, ctx, tokens)
        else:
            assert kind == "none" and type(out) is NoSmartRouteCandidateError
        return
    assert not isinstance(out, Exception)
    assert kind in ("route", "trial")
    tokens = out.requirements.input_tokens
    assert tokens >= oracle.lower_bound_tokens(body)
    ids = [sc.id for sc in out.chain]
    # 1. no chain candidate breaks a hard requirement; every rejected one does. A half-open trial chain only
    # when no candidate passes the failing gates (a request with a healthy alternative never gets one)
    assert set(ids) == expect
    if kind == "trial":
        assert out.trials is not None and set(out.trials) == expect and out.canary is None
        assert "circuit_half_open_trial" in out.receipt.reason_codes
        by_id = {c.id: c for c in considered}
        assert all(out.trials[i] == oracle.blocking_circuits(by_id[i], ctx) for i in ids)
    else:
        assert out.trials is None and "circuit_half_open_trial" not in out.receipt.reason_codes
    assert {r.candidate_id for r in out.rejected}.isdisjoint(ids)
    assert all(r.reasons for r in out.rejected)
    assert len(ids) + len(out.rejected) == len(considered)
    # 3. budget ceiling (and project budget) respected by the whole chain
    needs = oracle.needs_of(body)
    for sc in out.chain:
        cost = oracle.cost_usd(sc.candidate, tokens, needs)
        assert cost == pytest.approx(sc.estimated_cost_usd)
        if needs.ceiling is not None:
            assert cost <= needs.ceiling
        if ctx.policy.remaining_budget_usd is not None:
            assert cost <= ctx.policy.remaining_budget_usd
    # ranking: components in [0, 1], total = weighted sum, order by (score desc, provider, model)
    weights = weights_for(out.profile, out.requirements.latency_target)
    for sc in out.chain:
        comps = sc.components.as_tuple()
        assert len(comps) == len(COMPONENTS) and all(0.0 <= v <= 1.0 for v in comps)
        assert sc.score == pytest.approx(sum(w * v for w, v in zip(weights, comps, strict=True)))
    ranked = list(out.chain)
    if out.canary is not None and out.canary.promoted:  # canary: promoted to rank 1 only if hit and feasible
        assert out.canary.hit and out.canary.eligible and ranked[0].id == out.canary.target.candidate
        assert "canary_promoted" in out.receipt.reason_codes
        event("canary promoted")
        ranked = ranked[1:]
    elif kind == "route":
        for t in ctx.canaries:
            if t.alias == body["model"]:
                hit = bucket(t.alias, t.candidate, ctx.request_id) < t.percent
                assert not (hit and t.candidate in ids)  # a hit on a feasible target must be promoted
    assert oracle.ranked_ok([(sc.score, sc.candidate.provider, sc.candidate.model) for sc in ranked])
    receipt = out.receipt
    top = out.chain[0].candidate
    assert (receipt.selected_provider, receipt.selected_model) == (top.provider, top.model)
    assert receipt.candidate_count == len(ids) and receipt.rejected_count == len(out.rejected)
    # 2. permutation invariance
    shuffled = list(ctx.pool)
    rnd.shuffle(shuffled)
    permuted = RoutingContext(
        tuple(shuffled), ctx.policy, ctx.telemetry, ctx.canaries, ctx.now, ctx.request_id, ctx.circuits
    )
    other = decide(body, permuted)
    assert [sc.id for sc in other.chain] == ids
    assert other.receipt.to_dict() == receipt.to_dict()
    assert other.rejected == out.rejected


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_infeasible_request_fails_closed(scenario: tuple[dict[str, Any], RoutingContext]) -> None:
    body, ctx = scenario
    if oracle.pool_for(body, ctx) is None:
        return
    # make the request infeasible for everyone: a budget ceiling of 0 on a pool with no free candidate
    body = {**body, "metadata": {"routing": {"budget_ceiling_usd": 0.0}}}
    paid = tuple(c for c in ctx.pool if c.prices.input_per_mtok > 0 and c.prices.output_per_mtok > 0)
    ctx = RoutingContext(paid, ctx.policy, ctx.telemetry, (), ctx.now, ctx.request_id)
    if oracle.pool_for(body, ctx) is None:
        with pytest.raises(ModelNotFoundError):
            decide(body, ctx)
        return
    with pytest.raises(NoSmartRouteCandidateError) as info:
        decide(body, ctx)
    assert all(r.reasons for r in info.value.rejections)
