"""The core's answer when no candidate passes (issue 10, items 3 and 5): an outage is a 503
``no_healthy_candidate`` with a retry time, a request no model can serve stays 422, and a half-open circuit
admits a trial only when no healthy candidate passes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

import pytest

from ethen.gateway.errors import (
    NoHealthyCandidateError,
    NoSmartRouteCandidateError,
    http_status,
)
from ethen.gateway.routing import (
    DEFAULT_RETRY_AFTER_S,
    Candidate,
    CandidateStats,
    CircuitView,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DOWN = CandidateStats(3, 0)  # 0 successes over 3 samples: the failing gate trips


def cand(provider: str, model: str, *, tools: bool = True, price: float = 1.0) -> Candidate:
    info = ModelInfo(context_window=128_000, max_output_tokens=16_384, supports_tools=tools)
    return Candidate(provider, model, info, Prices(price, price * 4))


def ctx(
    pool: list[Candidate],
    stats: dict[tuple[str, str], CandidateStats],
    *,
    half_open: set[str] | None = None,
    retry_at: dict[str, datetime] | None = None,
) -> RoutingContext:
    view = CircuitView(frozenset(half_open or ()), MappingProxyType(dict(retry_at or {})))
    return RoutingContext(tuple(pool), ProjectPolicy(), TelemetrySnapshot(stats), (), NOW, "r1", view)


def req(model: str = "ethen/auto", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_every_candidate_failing_is_a_503_outage_with_retry_after_and_reasons() -> None:
    pool = [cand("a", "x"), cand("a", "y"), cand("b", "z")]
    stats = {("a", "x"): DOWN, ("b", "z"): DOWN}
    with pytest.raises(NoHealthyCandidateError) as info:
        decide(req(), ctx(pool, stats))
    err = info.value
    assert http_status(err) == 503 and err.code == "no_healthy_candidate"
    assert err.retry_after_s == DEFAULT_RETRY_AFTER_S  # the view knows no circuit: the default
    body = err.to_dict()["error"]
    assert body["retry_after_s"] == DEFAULT_RETRY_AFTER_S
    assert {r["candidate"]: r["reasons"] for r in body["rejections"]} == {
        "a/x": ["provider_failing", "candidate_failing"],
        "a/y": ["provider_failing"],
        "b/z": ["provider_failing", "candidate_failing"],
    }


def test_no_configured_model_can_serve_stays_422() -> None:
    pool = [cand("a", "x", tools=False), cand("b", "y", tools=False)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(NoSmartRouteCandidateError) as info:
        decide(req(tools=tools), ctx(pool, {("a", "x"): DOWN}))
    assert type(info.value) is NoSmartRouteCandidateError and http_status(info.value) == 422
    assert info.value.code == "no_smart_route_candidate"


def test_outage_when_one_servable_candidate_is_only_failing() -> None:
    # b/y cannot serve tools anyway; a/x could, were its provider healthy: an outage, not the client's fault
    pool = [cand("a", "x"), cand("b", "y", tools=False)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(NoHealthyCandidateError):
        decide(req(tools=tools), ctx(pool, {("a", "x"): DOWN}))


def test_retry_after_is_the_earliest_trial_time() -> None:
    pool = [cand("a", "x"), cand("b", "y")]
    stats = {("a", "x"): DOWN, ("b", "y"): DOWN}
    # a/x waits for both of its circuits (the later one: 7.2 s); b/y for 3.1 s -> ceil(3.1) = 4
    retry_at = {
        "a": NOW + timedelta(seconds=1), "a/x": NOW + timedelta(seconds=7.2),
        "b": NOW + timedelta(seconds=3.1), "b/y": NOW + timedelta(seconds=0.5),
    }
    with pytest.raises(NoHealthyCandidateError) as info:
        decide(req(), ctx(pool, stats, retry_at=retry_at))
    assert info.value.retry_after_s == 4
    past = {k: NOW - timedelta(seconds=5) for k in retry_at}  # trial in flight: retry soon, never 0
    with pytest.raises(NoHealthyCandidateError) as info:
        decide(req(), ctx(pool, stats, retry_at=past))
    assert info.value.retry_after_s == 1


def test_half_open_circuit_admits_a_trial_only_without_a_healthy_alternative() -> None:
    pool = [cand("a", "x", price=0.1), cand("b", "y", price=5.0)]
    stats = {("a", "x"): DOWN}
    # a healthy alternative exists: the gate holds, the half-open circuit changes nothing
    d = decide(req(), ctx(pool, stats, half_open={"a", "a/x"}))
    assert [sc.id for sc in d.chain] == ["b/y"] and d.trials is None
    assert "circuit_half_open_trial" not in d.receipt.reason_codes
    # the client names a's model exactly: no alternative, so one trial goes through the half-open circuit
    d = decide(req("x"), ctx(pool, stats, half_open={"a", "a/x"}))
    assert [sc.id for sc in d.chain] == ["a/x"]
    assert d.trials == {"a/x": ("a", "a/x")}
    assert "circuit_half_open_trial" in d.receipt.reason_codes and d.rejected == ()
    assert d.receipt.to_dict()["reason_codes"][-1] == "circuit_half_open_trial"
    assert d.to_dict()["trials"] == {"a/x": ["a", "a/x"]}
    # its score still carries the failures (reliability below the prior mean)
    assert d.chain[0].reliability < 0.9


def test_trial_needs_every_blocking_circuit_half_open() -> None:
    pool = [cand("a", "x")]
    stats = {("a", "x"): DOWN}
    for half in ({"a"}, {"a/x"}, set()):
        with pytest.raises(NoHealthyCandidateError):
            decide(req(), ctx(pool, stats, half_open=half))
    # only the candidate's own gate trips (the provider's other model works): its own circuit suffices
    pool = [cand("a", "x"), cand("a", "y", tools=False)]
    stats = {("a", "x"): DOWN, ("a", "y"): CandidateStats(5, 5)}
    d = decide(req("x"), ctx(pool, stats, half_open={"a/x"}))
    assert d.trials == {"a/x": ("a/x",)}


def test_trial_chain_ranks_every_half_open_candidate_and_keeps_other_rejections() -> None:
    pool = [cand("a", "m", price=3.0), cand("b", "m", price=0.1), cand("c", "m", tools=False)]
    stats = {("a", "m"): DOWN, ("b", "m"): DOWN, ("c", "m"): DOWN}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    d = decide(req("m", tools=tools), ctx(pool, stats, half_open={"a", "a/m", "b", "b/m", "c", "c/m"}))
    assert sorted(sc.id for sc in d.chain) == ["a/m", "b/m"]
    assert [sc.score for sc in d.chain] == sorted((sc.score for sc in d.chain), reverse=True)
    assert [r.candidate_id for r in d.rejected] == ["c/m"]  # also lacks tools: never a trial
    assert d.receipt.candidate_count + d.receipt.rejected_count == 3
