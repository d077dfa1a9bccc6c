"""Receipt: spec fields, routing facts only (no secrets, tenant ids, request id, telemetry internals)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ethen.gateway.routing import (
    POLICY_VERSION,
    REJECTION_REASONS,
    SELECTION_REASONS,
    CanaryTarget,
    Candidate,
    CandidateStats,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SPEC_FIELDS = {
    "requested_model", "selected_model", "selected_provider", "reason_codes", "routing_policy_version",
    "candidate_count", "rejected_count", "score_components",
}
EXTRA_FIELDS = {
    "score", "alias_profile", "estimated_cost_usd", "expected_cached_tokens", "hard_requirements", "chain",
    "rejected", "canary",
    "predicted_wait_ms", "spillover",  # issue 44
}
REQUEST_ID = "req_7f3a9c1e5b"
TENANT = "project-acme-4242"


def _decision() -> Any:
    pool = (
        Candidate("deepseek", "deepseek-chat", ModelInfo(128_000, 8192, supports_tools=True, quality=0.6),
                  Prices(0.27, 1.1)),
        Candidate("openai", "gpt-4o-mini", ModelInfo(128_000, 16_384, supports_tools=True, quality=0.5),
                  Prices(0.15, 0.6)),
        Candidate("mesh", "smollm2-135m-instruct", ModelInfo(8192, 8192, quality=0.1), Prices(0, 0)),
    )
    stats = {
        ("deepseek", "deepseek-chat"): CandidateStats(37, 36, 1234.5, 321.5),
        ("openai", "gpt-4o-mini"): CandidateStats(3, 0),
    }
    ctx = RoutingContext(
        pool,
        ProjectPolicy(allowed_providers=frozenset({"deepseek", "openai", "mesh"}), remaining_budget_usd=7.77),
        TelemetrySnapshot(stats),
        (CanaryTarget("ethen/auto", "openai/gpt-4o-mini", 20, 0.9, 11),),
        NOW,
        REQUEST_ID,
    )
    body = {
        "model": "ethen/auto",
        "messages": [{"role": "user", "content": "Summarize this transcript"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "user": TENANT,
        "metadata": {"routing": {"budget_ceiling_usd": 0.05, "latency_target": "balanced"}},
    }
    return decide(body, ctx)


def test_receipt_has_the_spec_fields() -> None:
    d = _decision()
    out = d.receipt.to_dict()
    assert SPEC_FIELDS <= set(out) <= SPEC_FIELDS | EXTRA_FIELDS
    assert out["requested_model"] == "ethen/auto"
    assert (out["selected_provider"], out["selected_model"]) == ("deepseek", "deepseek-chat")
    assert out["routing_policy_version"] == POLICY_VERSION
    assert out["candidate_count"] == 1 and out["rejected_count"] == 2
    assert set(out["score_components"]) == {
        "quality", "cost", "latency", "ttft", "reliability", "health", "context", "tools"
    }
    assert all(0 <= v <= 1 for v in out["score_components"].values())
    assert out["chain"] == ["deepseek/deepseek-chat"]
    assert out["rejected"] == [
        {"candidate": "mesh/smollm2-135m-instruct", "reasons": ["no_tool_support"]},
        {"candidate": "openai/gpt-4o-mini", "reasons": ["provider_failing", "candidate_failing"]},
    ]
    assert out["reason_codes"] == [
        "supports_required_capabilities", "within_budget", "high_recent_reliability", "telemetry_informed",
        "highest_score",
    ]
    assert out["canary"]["eligible"] is False and out["canary"]["acceptance_met"] is False
    json.dumps(out)  # serializable as is


def _walk(value: Any, keys: list[str], leaves: list[Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            keys.append(k)
            _walk(v, keys, leaves)
    elif isinstance(value, list):
        for v in value:
            _walk(v, keys, leaves)
    else:
        leaves.append(value)


def test_receipt_holds_no_secrets_tenant_ids_or_telemetry_internals() -> None:
    keys: list[str] = []
    leaves: list[Any] = []
    _walk(_decision().receipt.to_dict(), keys, leaves)
    text = " ".join(str(v) for v in leaves)
    for leaked in (REQUEST_ID, TENANT, "Summarize"):
        assert leaked not in text, leaked
    # telemetry internals (sample counts, latency means) and the project budget never appear as values
    for number in (37, 1234.5, 321.5, 7.77):
        assert number not in [v for v in leaves if isinstance(v, int | float) and not isinstance(v, bool)]
    forbidden = ("endpoint", "api_key", "credential", "base_url", "request_id", "project", "samples",
                 "success_rate", "latency_ms", "user")
    assert not [k for k in keys if k in forbidden]


def test_every_code_on_receipts_is_in_the_vocabulary() -> None:
    out = _decision().receipt.to_dict()
    assert set(out["reason_codes"]) <= set(SELECTION_REASONS)
    assert {c for r in out["rejected"] for c in r["reasons"]} <= set(REJECTION_REASONS)
    assert not set(SELECTION_REASONS) & set(REJECTION_REASONS)


def test_receipt_of_a_fallback_names_the_candidate_that_answered() -> None:
    pool = tuple(
        Candidate(p, m, ModelInfo(128_000, 8192, quality=q), Prices(1.0, 2.0))
        for p, m, q in (("alpha", "big", 0.9), ("beta", "small", 0.5), ("gamma", "tiny", 0.2))
    )
    ctx = RoutingContext(pool, ProjectPolicy(), TelemetrySnapshot(), (), NOW, REQUEST_ID)
    d = decide({"model": "ethen/best", "messages": [{"role": "user", "content": "hi"}]}, ctx)
    assert d.receipt.chain == ("alpha/big", "beta/small", "gamma/tiny")
    assert d.receipt.to_dict("alpha/big") == d.receipt.to_dict()  # the primary answered: nothing changes
    out = d.receipt.to_dict("beta/small")
    assert (out["selected_provider"], out["selected_model"]) == ("beta", "small")
    assert (out["primary_provider"], out["primary_model"]) == ("alpha", "big")
    assert out["reason_codes"] == [*d.receipt.reason_codes, "fallback_used"]
    assert out["score_components"] == d.chain[1].components.to_dict()
    assert out["score"] == round(d.chain[1].score, 4)
    assert out["estimated_cost_usd"] == d.chain[1].estimated_cost_usd
    assert set(out) <= SPEC_FIELDS | EXTRA_FIELDS | {"primary_model", "primary_provider"}
    assert all(code in SELECTION_REASONS for code in out["reason_codes"])
    try:
        d.receipt.to_dict("delta/other")
    except ValueError as err:
        assert "delta/other" in str(err)
    else:
        raise AssertionError("a served id outside the chain must be refused")
