"""decide(): aliases and gates, concrete ids, errors, telemetry smoothing and gates, ties, latency target."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.aliases import ALIAS_NAMES
from ethen.gateway.errors import (
    HTTP_STATUS,
    GatewayConfigError,
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    NoSmartRouteCandidateError,
    http_status,
)
from ethen.gateway.routing import (
    ALIASES,
    POLICY_VERSION,
    Candidate,
    CandidateStats,
    LiveCertification,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
)
from ethen.gateway.routing.policy import LATENCY_TARGETS, weights_for
from ethen.gateway.routing.telemetry import blend, smoothed_success

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def cand(provider: str, model: str, *, price: float = 1.0, **info: Any) -> Candidate:
    base: dict[str, Any] = {"context_window": 128_000, "max_output_tokens": 16_384}
    base.update(info)
    return Candidate(provider, model, ModelInfo(**base), Prices(price, price * 4))


def ctx(pool: list[Candidate], *, stats: dict[tuple[str, str], CandidateStats] | None = None,
        policy: ProjectPolicy | None = None) -> RoutingContext:
    telemetry = TelemetrySnapshot(stats or {})
    return RoutingContext(tuple(pool), policy or ProjectPolicy(), telemetry, (), NOW, "r1")


def req(model: str = "ethen/auto", content: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def reasons_of(exc: NoSmartRouteCandidateError) -> dict[str, tuple[str, ...]]:
    return {r.candidate_id: r.reasons for r in exc.rejections}


def test_eight_aliases_with_versioned_profiles() -> None:
    assert set(ALIASES) == {
        "ethen/auto", "ethen/fast", "ethen/best", "ethen/cheap",
        "ethen/reasoning", "ethen/coding", "ethen/vision", "ethen/long-context",
    }
    assert tuple(ALIASES) == ALIAS_NAMES  # the leaf module the store checks default_alias against
    assert POLICY_VERSION == "ethen.routing-policy.v1"
    for profile in ALIASES.values():
        assert sum(profile.weights) == pytest.approx(1.0)


def test_alias_profiles_change_the_choice() -> None:
    pool = [
        cand("p", "smart", price=10.0, quality=0.95, latency_ms=8000, ttft_ms=2000),
        cand("p", "quick", price=1.0, quality=0.5, latency_ms=300, ttft_ms=80),
        cand("p", "free", price=0.0, quality=0.3, latency_ms=4000, ttft_ms=900),
    ]
    aliases = ("ethen/best", "ethen/fast", "ethen/cheap")
    pick = {a: decide(req(a), ctx(pool)).receipt.selected_model for a in aliases}
    assert pick == {"ethen/best": "smart", "ethen/fast": "quick", "ethen/cheap": "free"}


def test_reasoning_prefers_reasoning_metadata_by_score_not_gate() -> None:
    pool = [cand("p", "thinker", quality=0.7, supports_reasoning=True), cand("p", "plain", quality=0.8)]
    d = decide(req("ethen/reasoning"), ctx(pool))
    assert d.receipt.selected_model == "thinker"
    assert [sc.candidate.model for sc in d.chain] == ["thinker", "plain"]  # plain still in the chain: no gate
    assert decide(req("ethen/auto"), ctx(pool)).receipt.selected_model == "plain"


def test_coding_gate_tools_and_64k() -> None:
    pool = [
        cand("p", "tools-small", supports_tools=True, context_window=32_000),
        cand("p", "no-tools", supports_tools=False, context_window=200_000),
        cand("p", "ok", supports_tools=True, context_window=64_000),
        cand("p", "just-below", supports_tools=True, context_window=63_999),
    ]
    d = decide(req("ethen/coding"), ctx(pool))
    assert [sc.candidate.model for sc in d.chain] == ["ok"]
    why = {r.model: r.reasons for r in d.rejected}
    assert why == {
        "tools-small": ("alias_requires_context",),
        "just-below": ("alias_requires_context",),
        "no-tools": ("alias_requires_tools",),
    }


def test_vision_gate() -> None:
    pool = [cand("p", "eyes", supports_vision=True), cand("p", "blind")]
    d = decide(req("ethen/vision"), ctx(pool))
    assert [sc.candidate.model for sc in d.chain] == ["eyes"]
    assert d.rejected[0].reasons == ("alias_requires_vision",)


def test_long_context_gate_128k() -> None:
    # decimal K, as providers advertise windows: a "128K" model with 128,000 tokens (gpt-4o) qualifies
    pool = [
        cand("p", "k131072", context_window=131_072),
        cand("p", "k128000", context_window=128_000),
        cand("p", "k127999", context_window=127_999),
    ]
    d = decide(req("ethen/long-context"), ctx(pool))
    assert sorted(sc.candidate.model for sc in d.chain) == ["k128000", "k131072"]
    assert [(r.model, r.reasons) for r in d.rejected] == [("k127999", ("alias_requires_context",))]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no_tool_support"),
        ({"response_format": {"type": "json_object"}}, "no_structured_output_support"),
        ({"max_tokens": 20_000}, "max_output_too_small"),
        ({"metadata": {"routing": {"budget_ceiling_usd": 0.0001}}}, "over_budget_ceiling"),
        ({"metadata": {"routing": {"certification_level": "live"}}}, "no_live_certification"),
        ({"providerOptions": {"gateway": {"only": ["other"]}}}, "provider_not_requested"),
    ],
)
def test_each_request_requirement_filters(extra: dict[str, Any], reason: str) -> None:
    weak = cand("p", "weak", price=10.0)
    strong = Candidate(
        "q", "strong",
        ModelInfo(128_000, 32_768, supports_tools=True, supports_structured_output=True),
        Prices(0.0, 0.0),
        LiveCertification("c1", NOW - timedelta(days=1), NOW + timedelta(days=1)),
    )
    if reason == "provider_not_requested":
        extra = {"providerOptions": {"gateway": {"only": ["q"]}}}
    d = decide(req(**extra), ctx([weak, strong]))
    assert [sc.id for sc in d.chain] == ["q/strong"]
    assert d.rejected[0].candidate_id == "p/weak" and reason in d.rejected[0].reasons


def test_vision_request_requirement() -> None:
    parts = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": "https://x"}}]
    d = decide(req(content=parts), ctx([cand("p", "blind"), cand("p", "eyes", supports_vision=True)]))
    assert [sc.candidate.model for sc in d.chain] == ["eyes"]
    assert d.rejected[0].reasons == ("no_vision_support",)


def test_context_requirement_counts_input_plus_requested_output() -> None:
    text = "word " * 3000  # 15,000 bytes -> >= 5,000 tokens
    pool = [cand("p", "k4", context_window=4096), cand("p", "k8", context_window=8192)]
    d = decide(req(content=text), ctx(pool))
    assert [sc.candidate.model for sc in d.chain] == ["k8"]
    assert d.rejected[0].reasons == ("context_window_too_small",)
    with pytest.raises(NoSmartRouteCandidateError):
        decide(req(content=text, max_tokens=4000), ctx(pool))


def test_expired_or_future_certification_is_not_live() -> None:
    def certified(name: str, start: timedelta, end: timedelta) -> Candidate:
        return Candidate("p", name, ModelInfo(128_000, 4096), Prices(1, 1),
                         LiveCertification("c", NOW + start, NOW + end))

    pool = [
        certified("expired", -timedelta(days=2), -timedelta(seconds=1)),
        certified("future", timedelta(seconds=1), timedelta(days=1)),
        certified("valid", -timedelta(days=1), timedelta(seconds=1)),
    ]
    d = decide(req(metadata={"routing": {"certification_level": "live"}}), ctx(pool))
    assert [sc.candidate.model for sc in d.chain] == ["valid"]


def test_project_policy_and_remaining_budget() -> None:
    pool = [cand("a", "m1", price=0.0), cand("b", "m2", price=0.0), cand("a", "m3", price=100.0)]
    d = decide(req(), ctx(pool, policy=ProjectPolicy(allowed_providers=frozenset({"a"}))))
    assert {sc.id for sc in d.chain} == {"a/m1", "a/m3"}
    d = decide(req(), ctx(pool, policy=ProjectPolicy(allowed_models=frozenset({"m2", "a/m3"}))))
    assert {sc.id for sc in d.chain} == {"b/m2", "a/m3"}
    d = decide(req(), ctx(pool, policy=ProjectPolicy(remaining_budget_usd=0.01)))
    assert {sc.id for sc in d.chain} == {"a/m1", "b/m2"}
    assert {r.candidate_id: r.reasons for r in d.rejected} == {"a/m3": ("over_project_budget",)}
    assert "within_budget" in d.receipt.reason_codes


def test_fail_closed_with_every_reason() -> None:
    pool = [cand("p", "a"), cand("q", "b", context_window=1024)]
    with pytest.raises(NoSmartRouteCandidateError) as info:
        decide(req("ethen/coding"), ctx(pool))
    err = info.value
    assert err.code == "no_smart_route_candidate" and http_status(err) == 422
    assert reasons_of(err) == {
        "p/a": ("alias_requires_tools",),
        "q/b": ("alias_requires_tools", "alias_requires_context"),
    }
    envelope = err.to_dict()["error"]
    assert envelope["code"] == "no_smart_route_candidate"
    assert envelope["rejections"] == [
        {"candidate": "p/a", "reasons": ["alias_requires_tools"]},
        {"candidate": "q/b", "reasons": ["alias_requires_tools", "alias_requires_context"]},
    ]


def test_empty_pool_fails_closed() -> None:
    with pytest.raises(NoSmartRouteCandidateError) as info:
        decide(req(), ctx([]))
    assert info.value.rejections == ()


def test_unknown_models_and_aliases() -> None:
    pool = [cand("p", "gpt-x")]
    for model in ("ethen/turbo", "nope", "p/nope"):
        with pytest.raises(ModelNotFoundError) as info:
            decide(req(model), ctx(pool))
        assert info.value.code == "model_not_found" and info.value.param == "model"
        assert http_status(info.value) == 404


def test_concrete_model_id_pool_is_its_providers() -> None:
    pool = [
        cand("groq", "llama-8b", price=0.1),
        cand("together", "llama-8b", price=0.2),
        cand("openai", "gpt-x", price=0.0),
        cand("slow", "llama-8b", price=0.1, supports_tools=False),
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    pool[0] = cand("groq", "llama-8b", price=0.1, supports_tools=True)
    pool[1] = cand("together", "llama-8b", price=0.2, supports_tools=True)
    d = decide(req("llama-8b", tools=tools), ctx(pool))
    assert [sc.id for sc in d.chain] == ["groq/llama-8b", "together/llama-8b"]  # cheaper first, same priors
    assert [r.candidate_id for r in d.rejected] == ["slow/llama-8b"]
    assert d.receipt.alias_profile == "ethen/auto" and "concrete_model" in d.receipt.reason_codes
    assert d.receipt.candidate_count + d.receipt.rejected_count == 3  # gpt-x not considered
    # provider/model form
    assert [sc.id for sc in decide(req("together/llama-8b"), ctx(pool)).chain] == ["together/llama-8b"]


def test_ties_break_by_provider_then_model_whatever_the_order() -> None:
    pool = [cand("b", "x"), cand("a", "y"), cand("a", "x"), cand("c", "a")]
    for order in (pool, pool[::-1], pool[1:] + pool[:1]):
        d = decide(req(), ctx(order))
        assert [sc.id for sc in d.chain] == ["a/x", "a/y", "b/x", "c/a"]


def test_duplicate_candidate_ids_are_a_config_error() -> None:
    with pytest.raises(GatewayConfigError) as info:
        decide(req(), ctx([cand("a", "x"), cand("a", "x", price=2.0)]))
    assert "a/x" in info.value.message and http_status(info.value) == 500


def test_smoothing_one_sample_does_not_swing_reliability_or_latency() -> None:
    assert smoothed_success(0, 0) == pytest.approx(0.9)
    assert smoothed_success(1, 0) > 0.8
    assert smoothed_success(50, 0) < 0.2
    assert blend(1000.0, 30000.0, 1) < 6000.0  # one slow sample moves the prior by < 1/6 of the gap
    assert blend(1000.0, None, 0) == 1000.0
    assert blend(1000.0, 3000.0, 1000) == pytest.approx(3000.0, rel=0.01)


def test_telemetry_moves_ranking_and_is_reported() -> None:
    pool = [cand("a", "x"), cand("b", "x")]
    base = decide(req(), ctx(pool))
    assert base.receipt.selected_provider == "a" and "prior_only" in base.receipt.reason_codes
    stats = {
        ("a", "x"): CandidateStats(10, 5, 4000.0, 900.0),
        ("b", "x"): CandidateStats(20, 20, 800.0, 200.0),
    }
    d = decide(req(), ctx(pool, stats=stats))
    assert d.receipt.selected_provider == "b"
    assert {"telemetry_informed", "high_recent_reliability"} <= set(d.receipt.reason_codes)
    one_failure = decide(req(), ctx(pool, stats={("a", "x"): CandidateStats(1, 0)}))
    assert {sc.id for sc in one_failure.chain} == {"a/x", "b/x"}  # one failure excludes nothing


def test_failing_provider_excluded_after_three_zero_success_samples() -> None:
    pool = [cand("a", "x"), cand("a", "y"), cand("b", "x")]
    two = {("a", "x"): CandidateStats(2, 0)}
    assert len(decide(req(), ctx(pool, stats=two)).chain) == 3
    # 3 failures spread over the provider's models (and a model not in the pool) -> whole provider out
    spread = {(p, m): CandidateStats(1, 0) for p, m in (("a", "x"), ("a", "y"), ("a", "z"))}
    d = decide(req(), ctx(pool, stats=spread))
    assert [sc.id for sc in d.chain] == ["b/x"]
    assert {r.candidate_id: r.reasons for r in d.rejected} == {
        "a/x": ("provider_failing",), "a/y": ("provider_failing",),
    }
    # provider healthy overall but this model 0/3 -> only the candidate is out
    mixed = {("a", "x"): CandidateStats(3, 0), ("a", "y"): CandidateStats(10, 10)}
    d = decide(req(), ctx(pool, stats=mixed))
    assert {r.candidate_id: r.reasons for r in d.rejected} == {"a/x": ("candidate_failing",)}


def test_latency_target_shifts_weights_deterministically() -> None:
    auto = ALIASES["ethen/auto"]
    fast, relaxed = weights_for(auto, "fast"), weights_for(auto, "relaxed")
    assert sum(fast) == pytest.approx(1.0) and sum(relaxed) == pytest.approx(1.0)
    assert fast[2] > auto.weights[2] > relaxed[2] and fast[3] > auto.weights[3] > relaxed[3]
    assert weights_for(auto, None) == pytest.approx(auto.weights)
    assert set(LATENCY_TARGETS) == {"fast", "balanced", "relaxed"}
    pool = [
        cand("p", "smart", quality=0.95, latency_ms=6000, ttft_ms=1500),
        cand("p", "quick", quality=0.6, latency_ms=500, ttft_ms=100),
    ]
    picks = {
        t: decide(req(metadata={"routing": {"latency_target": t}}), ctx(pool)).receipt.selected_model
        for t in ("fast", "relaxed")
    }
    assert picks == {"fast": "quick", "relaxed": "smart"}


def test_decision_is_deterministic() -> None:
    pool = [cand("a", "x", quality=0.3), cand("b", "y", quality=0.7)]
    assert decide(req(), ctx(pool)).to_dict() == decide(req(), ctx(pool)).to_dict()


def test_error_tree_and_status_table() -> None:
    for cls in (InvalidRequestError, ModelNotFoundError, NoSmartRouteCandidateError, GatewayConfigError):
        assert issubclass(cls, GatewayError) and cls in HTTP_STATUS

    class Custom(InvalidRequestError):
        pass

    assert http_status(Custom("x")) == 400  # inherits its parent's status
    env = InvalidRequestError("bad", code="invalid_value", param="max_tokens").to_dict()
    assert env == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens",
                             "code": "invalid_value"}}


def test_context_rejects_naive_now() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        RoutingContext((), ProjectPolicy(), TelemetrySnapshot(), (), datetime(2026, 1, 1), "r")


@settings(max_examples=300, deadline=None)
@given(
    prior=st.floats(0.0, 1e6),
    mean=st.none() | st.floats(0.0, 1e6),
    samples=st.integers(0, 60),
    data=st.data(),
)
def test_precomputed_stats_terms_match_blend_and_smoothing(
    prior: float, mean: float | None, samples: int, data: st.DataObject
) -> None:
    successes = data.draw(st.integers(0, samples))
    stats = CandidateStats(samples, successes, mean, mean)
    la, lb, ta, tb, rel, failing = stats.terms
    assert prior * la + lb == pytest.approx(blend(prior, mean, successes), rel=1e-12, abs=1e-9)
    assert prior * ta + tb == pytest.approx(blend(prior, mean, successes), rel=1e-12, abs=1e-9)
    assert rel == smoothed_success(samples, successes)
    assert failing == (samples >= 3 and successes == 0)
