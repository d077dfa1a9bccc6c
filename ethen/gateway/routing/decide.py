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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter, itemgetter
from typing import Any

from ethen.gateway.errors import GatewayConfigError, ModelNotFoundError, NoSmartRouteCandidateError

from .canary import CanaryEvaluation, apply_canary
from .candidates import CAP_STRUCTURED, CAP_TOOLS, CAP_VISION, CanaryTarget, Candidate, ProjectPolicy
from .filter import Rejection, check_candidate
from .policy import ALIASES, CONCRETE_PROFILE, FAILING_MIN_SAMPLES, AliasProfile, weights_for
from .receipt import Receipt, build_receipt
from .requirements import Requirements, parse_requirements
from .score import ScoredCandidate, score_candidate
from .telemetry import EMPTY_STATS, TelemetrySnapshot

__all__ = ["ALIAS_PREFIX", "Decision", "RoutingContext", "decide", "resolve_pool"]

ALIAS_PREFIX = "ethen/"
_new = tuple.__new__
_by_score = itemgetter(1)  # ScoredCandidate.score (C-level key functions: no Python call per element)
_by_key = attrgetter("candidate.key")  # (provider, model)
_rejection_key = itemgetter(1, 2)  # Rejection (provider, model)
_ZERO = (0, 0)


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


def decide(body: Mapping[str, Any], ctx: RoutingContext) -> Decision:
    """Route one chat-completions body. Raises ``InvalidRequestError``, ``ModelNotFoundError``,
    ``NoSmartRouteCandidateError`` or ``GatewayConfigError`` (all ``GatewayError``)."""
    req = parse_requirements(body)
    profile, pool, concrete = resolve_pool(req.model, ctx.pool)
    feasible, rejected = _filter_and_score(pool, req, profile, ctx)
    rejected.sort(key=_rejection_key)
    rejections = tuple(rejected)
    if not feasible:
        raise NoSmartRouteCandidateError(
            f"no candidate for {req.model!r} satisfies the request "
            f"({len(rejections)} rejected; see 'rejections')",
            rejections,
        )
    # rank: score desc, then provider id, then model id. Two stable sorts with C-level keys are cheaper than
    # one sort building a (-score, provider, model) tuple per candidate; reverse=True keeps stability.
    feasible.sort(key=_by_key)
    feasible.sort(key=_by_score, reverse=True)
    canary = apply_canary(req.model, feasible, ctx.canaries, ctx.telemetry, ctx.request_id)
    chain = tuple(feasible)
    receipt = build_receipt(req, profile, chain, rejections, canary, concrete, ctx.policy)
    return Decision(chain, rejections, receipt, req, profile, canary)


def _filter_and_score(
    pool: tuple[Candidate, ...], req: Requirements, profile: AliasProfile, ctx: RoutingContext
) -> tuple[list[ScoredCandidate], list[Rejection]]:
    """One pass over the pool: a fast feasibility check per candidate, then either the full reason codes
    (``filter.check_candidate``, only for rejected ones) or the score (``score.score_candidate``)."""
    telemetry = ctx.telemetry
    stats_map = telemetry.stats
    totals = telemetry.provider_totals
    failing = telemetry.failing_providers
    weights = weights_for(profile, req.latency_target)
    gates = profile.gates
    qfactor = profile.non_reasoning_quality_factor
    policy = ctx.policy
    now = ctx.now

    # Request-level constants for the fast check. It must agree with filter.check_candidate, the single
    # source of reason codes; the property tests check both against an independent oracle.
    in_tok = req.input_tokens
    max_out = req.max_output_tokens
    min_window = max(gates.min_context, in_tok + (max_out or 0))
    max_out_needed = max_out or 0
    need_caps = (
        (CAP_TOOLS if req.tools or gates.tools else 0)
        | (CAP_VISION if req.vision or gates.vision else 0)
        | (CAP_STRUCTURED if req.structured_output else 0)
    )
    ceiling = min(
        math.inf if req.budget_ceiling_usd is None else req.budget_ceiling_usd,
        math.inf if policy.remaining_budget_usd is None else policy.remaining_budget_usd,
    )
    allowed_p = policy.allowed_providers
    allowed_m = policy.allowed_models
    only = req.only_providers
    live = req.certification_live
    restricted = allowed_p is not None or allowed_m is not None or only is not None or live or bool(failing)

    feasible: list[ScoredCandidate] = []
    rejected: list[Rejection] = []
    seen: set[str] = set()
    for cand in pool:
        cid = cand.id
        if cid in seen:
            raise GatewayConfigError(f"duplicate candidate id in the pool: {cid!r}")
        seen.add(cid)
        info = cand.info
        prices = cand.prices
        out_tok = cand.default_output_tokens if max_out is None else max_out
        cost = (in_tok * prices.input_per_mtok + out_tok * prices.output_per_mtok) / 1e6
        stats = stats_map.get(cand.key, EMPTY_STATS) if stats_map else EMPTY_STATS
        ok = (
            info.context_window >= min_window
            and info.max_output_tokens >= max_out_needed
            and cost <= ceiling
            and cand.caps & need_caps == need_caps
            and (stats.samples < FAILING_MIN_SAMPLES or stats.successes > 0)
        )
        if ok and restricted:
            ok = (
                (allowed_p is None or cand.provider in allowed_p)
                and (allowed_m is None or cand.model in allowed_m or cid in allowed_m)
                and (only is None or cand.provider in only)
                and cand.provider not in failing
                and (not live or (cand.certification is not None and cand.certification.valid_at(now)))
            )
        if not ok:
            why = check_candidate(cand, req, gates, policy, cost, stats, failing, now)
            rejected.append(_new(Rejection, (cid, cand.provider, cand.model, why)))
            continue
        pn, ps = totals.get(cand.provider, _ZERO) if totals else _ZERO
        feasible.append(score_candidate(cand, qfactor, weights, cost, in_tok + out_tok, stats, pn, ps))
    return feasible, rejected
