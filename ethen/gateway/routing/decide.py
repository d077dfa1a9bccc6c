"""The single entry point: ``decide(body, ctx) -> Decision``.

Pipeline (pure; ``now`` and ``request_id`` come in ``ctx``): parse requirements once -> resolve the alias
profile (or the concrete model's pool) -> filter every candidate (reasons recorded) -> score the feasible ones
-> rank (score desc, then provider id, then model id: order-independent) -> canary gate -> receipt.

Concrete (non ``ethen/*``) model ids: the pool is the candidates whose ``model`` equals the id (several
providers become the fallback chain); if none, candidates whose ``id`` (``provider/model``) equals it. Request
requirements still apply; ranking uses the ``ethen/auto`` profile. Unknown ids and unknown ``ethen/*`` aliases
raise ``ModelNotFoundError``. Two candidates with the same id are an operator error (``GatewayConfigError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ethen.gateway.errors import GatewayConfigError, ModelNotFoundError, NoSmartRouteCandidateError

from . import reasons as r
from .canary import CanaryEvaluation, apply_canary
from .candidates import CanaryTarget, Candidate, ProjectPolicy
from .filter import (
    Rejection,
    check_candidate,
    estimate_cost_usd,
    failing_providers,
    output_tokens_for,
    provider_totals,
)
from .policy import ALIASES, CONCRETE_PROFILE, POLICY_VERSION, AliasProfile, weights_for
from .receipt import Receipt
from .requirements import Requirements, parse_requirements
from .score import ScoredCandidate, score_candidate
from .telemetry import EMPTY_STATS, TelemetrySnapshot

__all__ = ["ALIAS_PREFIX", "Decision", "RoutingContext", "decide", "resolve_pool"]

ALIAS_PREFIX = "ethen/"
_HIGH_RELIABILITY = 0.9
_MIN_SAMPLES_FOR_HIGH = 3


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """Everything the decision depends on besides the body. ``now`` must be timezone-aware."""

    pool: tuple[Candidate, ...]
    policy: ProjectPolicy
    telemetry: TelemetrySnapshot
    canaries: tuple[CanaryTarget, ...]
    now: datetime
    request_id: str

    def __post_init__(self) -> None:
        if self.now.tzinfo is None:
            raise ValueError("RoutingContext.now must be timezone-aware")


@dataclass(frozen=True, slots=True)
class Decision:
    """``chain`` is ranked and capability-safe: it is the fallback chain (``chain[0]`` is primary)."""

    chain: tuple[ScoredCandidate, ...]
    rejected: tuple[Rejection, ...]
    receipt: Receipt
    requirements: Requirements
    profile: AliasProfile
    canary: CanaryEvaluation | None = None

    @property
    def selected(self) -> ScoredCandidate:
        return self.chain[0]

    def to_dict(self) -> dict[str, Any]:
        """Explain view: receipt, requirements, ranked chain with components, rejections."""
        return {
            "receipt": self.receipt.to_dict(),
            "requirements": self.requirements.to_dict(),
            "chain": [
                {
                    "candidate": sc.id,
                    "provider": sc.candidate.provider,
                    "model": sc.candidate.model,
                    "score": round(sc.score, 6),
                    "score_components": sc.components.to_dict(),
                    "estimated_cost_usd": sc.estimated_cost_usd,
                }
                for sc in self.chain
            ],
            "rejected": [rj.to_dict() for rj in self.rejected],
        }


def resolve_pool(model: str, pool: tuple[Candidate, ...]) -> tuple[AliasProfile, tuple[Candidate, ...], bool]:
    """(profile, pool to consider, is_concrete). Raises ``ModelNotFoundError``."""
    profile = ALIASES.get(model)
    if profile is not None:
        return profile, pool, False
    if model.startswith(ALIAS_PREFIX):
        raise ModelNotFoundError(model)
    sub = tuple(c for c in pool if c.model == model) or tuple(c for c in pool if c.id == model)
    if not sub:
        raise ModelNotFoundError(model)
    return CONCRETE_PROFILE, sub, True


def _hard_requirement_names(req: Requirements, profile: AliasProfile) -> tuple[str, ...]:
    g = profile.gates
    names = [
        name
        for name, on in (
            ("tools", req.tools or g.tools),
            ("vision", req.vision or g.vision),
            ("structured_output", req.structured_output),
            ("max_output", req.max_output_tokens is not None),
            ("budget_ceiling", req.budget_ceiling_usd is not None),
            ("live_certification", req.certification_live),
            ("provider_restriction", req.only_providers is not None),
        )
        if on
    ]
    names.insert(0, "context")
    return tuple(names)


def decide(body: Mapping[str, Any], ctx: RoutingContext) -> Decision:
    """Route one chat-completions body. Raises ``InvalidRequestError``, ``ModelNotFoundError``,
    ``NoSmartRouteCandidateError`` or ``GatewayConfigError`` (all ``GatewayError``)."""
    req = parse_requirements(body)
    profile, pool, concrete = resolve_pool(req.model, ctx.pool)
    if len({c.id for c in pool}) != len(pool):
        seen: set[str] = set()
        dup = next(c.id for c in pool if c.id in seen or seen.add(c.id))  # type: ignore[func-returns-value]
        raise GatewayConfigError(f"duplicate candidate id in the pool: {dup!r}")

    telemetry = ctx.telemetry
    stats_map = telemetry.stats
    totals = provider_totals(telemetry) if stats_map else {}
    failing = failing_providers(totals) if totals else frozenset()
    weights = weights_for(profile, req.latency_target)
    gates = profile.gates
    policy = ctx.policy
    now = ctx.now

    feasible: list[ScoredCandidate] = []
    rejected: list[Rejection] = []
    for cand in pool:
        cost = estimate_cost_usd(req, cand)
        stats = stats_map.get((cand.provider, cand.model), EMPTY_STATS) if stats_map else EMPTY_STATS
        why = check_candidate(cand, req, gates, policy, cost, stats, failing, now)
        if why:
            rejected.append(Rejection(cand.id, cand.provider, cand.model, why))
            continue
        pn, ps = totals.get(cand.provider, (0, 0))
        total_tokens = req.input_tokens + output_tokens_for(req, cand)
        feasible.append(score_candidate(cand, profile, weights, cost, total_tokens, stats, pn, ps))

    rejected.sort(key=lambda rj: (rj.provider, rj.model))
    rejections = tuple(rejected)
    if not feasible:
        raise NoSmartRouteCandidateError(
            f"no candidate for {req.model!r} satisfies the request "
            f"({len(rejections)} rejected; see 'rejections')",
            rejections,
        )
    feasible.sort(key=lambda sc: (-sc.score, sc.candidate.provider, sc.candidate.model))
    canary = apply_canary(req.model, feasible, ctx.canaries, telemetry, ctx.request_id)

    top = feasible[0]
    codes = [r.SUPPORTS_REQUIRED_CAPABILITIES]
    if req.budget_ceiling_usd is not None or policy.remaining_budget_usd is not None:
        codes.append(r.WITHIN_BUDGET)
    if top.telemetry_samples >= _MIN_SAMPLES_FOR_HIGH and top.components.reliability >= _HIGH_RELIABILITY:
        codes.append(r.HIGH_RECENT_RELIABILITY)
    codes.append(r.TELEMETRY_INFORMED if top.telemetry_samples > 0 else r.PRIOR_ONLY)
    if canary is not None and canary.promoted:
        codes.append(r.CANARY_PROMOTED)
    else:
        codes.append(r.HIGHEST_SCORE)
    if concrete:
        codes.append(r.CONCRETE_MODEL)

    chain = tuple(feasible)
    receipt = Receipt(
        requested_model=req.model,
        selected_model=top.candidate.model,
        selected_provider=top.candidate.provider,
        reason_codes=tuple(codes),
        routing_policy_version=POLICY_VERSION,
        candidate_count=len(chain),
        rejected_count=len(rejections),
        score_components=top.components,
        score=top.score,
        alias_profile=profile.alias,
        estimated_cost_usd=top.estimated_cost_usd,
        hard_requirements=_hard_requirement_names(req, profile),
        chain=tuple(sc.id for sc in chain),
        rejected=rejections,
        canary=canary,
    )
    return Decision(chain, rejections, receipt, req, profile, canary)
