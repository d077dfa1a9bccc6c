"""Capability, policy, budget, certification and health filtering: each candidate either passes or collects
every reason code that applies (from :mod:`.reasons`). A rejected candidate never reaches scoring.

Rules where the spec is silent:

* context: ``estimated input tokens + requested max output (if any) <= context_window`` (the upstream rejects
  a request whose input plus ``max_tokens`` exceeds the window); without a requested max output only the input
  must fit.
* cost estimate: ``input_tokens * input_price + output_tokens * output_price`` where ``output_tokens`` is the
  requested max output, else ``min(DEFAULT_MAX_OUTPUT_TOKENS, model max output)``. A candidate is over budget
  when the estimate is strictly greater than the ceiling.
* provider health counts every telemetry entry of the provider, including models not in the current pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, NamedTuple

from . import reasons as r
from .candidates import Candidate, ProjectPolicy
from .policy import FAILING_MIN_SAMPLES, HardGates
from .requirements import Requirements
from .telemetry import CandidateStats

__all__ = [
    "Rejection",
    "check_candidate",
    "estimate_cost_usd",
    "failing_providers",
    "output_tokens_for",
]


class Rejection(NamedTuple):
    """A filtered-out candidate and all of its reason codes (immutable; a NamedTuple because one is built
    per rejected candidate on the hot path)."""

    candidate_id: str
    provider: str
    model: str
    reasons: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate_id, "reasons": list(self.reasons)}


def output_tokens_for(req: Requirements, cand: Candidate) -> int:
    """Requested max output, else ``min(DEFAULT_MAX_OUTPUT_TOKENS, model max output)`` (precomputed)."""
    if req.max_output_tokens is not None:
        return req.max_output_tokens
    return cand.default_output_tokens


def estimate_cost_usd(req: Requirements, cand: Candidate) -> float:
    p = cand.prices
    return (req.input_tokens * p.input_per_mtok + output_tokens_for(req, cand) * p.output_per_mtok) / 1e6


def failing_providers(totals: Mapping[str, tuple[int, int]]) -> frozenset[str]:
    """Providers with 0 successes over >= FAILING_MIN_SAMPLES recent samples (``provider_totals``)."""
    return frozenset(p for p, (n, s) in totals.items() if n >= FAILING_MIN_SAMPLES and s == 0)


def check_candidate(
    cand: Candidate,
    req: Requirements,
    gates: HardGates,
    policy: ProjectPolicy,
    cost: float,
    stats: CandidateStats,
    failing: Iterable[str] | frozenset[str],
    now: datetime,
    wait_ms: float = 0.0,
    max_wait_ms: float | None = None,
) -> tuple[str, ...]:
    """Every rejection reason for ``cand`` (empty tuple = feasible), in :data:`REJECTION_REASONS` order."""
    info = cand.info
    out: list[str] = []
    if policy.allowed_providers is not None and cand.provider not in policy.allowed_providers:
        out.append(r.PROVIDER_NOT_ALLOWED)
    if policy.allowed_models is not None and not (
        cand.model in policy.allowed_models or cand.id in policy.allowed_models
    ):
        out.append(r.MODEL_NOT_ALLOWED)
    if req.only_providers is not None and cand.provider not in req.only_providers:
        out.append(r.PROVIDER_NOT_REQUESTED)
    if gates.tools and not info.supports_tools:
        out.append(r.ALIAS_REQUIRES_TOOLS)
    if gates.vision and not info.supports_vision:
        out.append(r.ALIAS_REQUIRES_VISION)
    if info.context_window < gates.min_context:
        out.append(r.ALIAS_REQUIRES_CONTEXT)
    if req.tools and not info.supports_tools:
        out.append(r.NO_TOOLS)
    if req.vision and not info.supports_vision:
        out.append(r.NO_VISION)
    if req.structured_output and not info.supports_structured_output:
        out.append(r.NO_STRUCTURED_OUTPUT)
    if req.input_tokens + (req.max_output_tokens or 0) > info.context_window:
        out.append(r.CONTEXT_WINDOW_TOO_SMALL)
    if req.max_output_tokens is not None and req.max_output_tokens > info.max_output_tokens:
        out.append(r.MAX_OUTPUT_TOO_SMALL)
    if req.certification_live and (cand.certification is None or not cand.certification.valid_at(now)):
        out.append(r.NO_LIVE_CERTIFICATION)
    if req.budget_ceiling_usd is not None and cost > req.budget_ceiling_usd:
        out.append(r.OVER_BUDGET_CEILING)
    if policy.remaining_budget_usd is not None and cost > policy.remaining_budget_usd:
        out.append(r.OVER_PROJECT_BUDGET)
    if cand.provider in failing:
        out.append(r.PROVIDER_FAILING)
    if stats.terms[5]:  # telemetry.is_failing: 0 successes over >= 3 samples, or the last 3 outcomes failed
        out.append(r.CANDIDATE_FAILING)
    if max_wait_ms is not None and wait_ms > max_wait_ms:  # issue 44: .capacity
        out.append(r.PREDICTED_WAIT_EXCEEDS_TARGET)
    return tuple(out)
