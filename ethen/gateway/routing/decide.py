"""The single entry point: ``decide(body, ctx) -> Decision``.

Pipeline (pure; ``now`` and ``request_id`` come in ``ctx``): parse requirements once -> resolve the alias
profile (or the concrete model's pool) -> filter every candidate (reasons recorded) -> score the feasible ones
-> rank (score desc, then provider id, then model id: order-independent) -> canary gate -> receipt.

Concrete (non ``ethen/*``) model ids: the pool is the candidates whose ``model`` equals the id (several
providers become the fallback chain); if none, candidates whose ``id`` (``provider/model``) equals it. Request
requirements still apply; ranking uses the ``ethen/auto`` profile. Unknown ids and unknown ``ethen/*`` aliases
raise ``ModelNotFoundError``. Two candidates with the same id are an operator error (``GatewayConfigError``).

Capacity (issue 44, :mod:`.capacity`): ``ctx.capacity`` feeds the TTFT / latency components and the wait
target in force (``ctx.wait_targets`` of an alias, tightened by ``metadata.routing.max_wait_ms``) rejects
candidates (``predicted_wait_exceeds_target``). When the rank 1 without the capacity signal is not the
choice, the receipt's ``spillover`` names it (a second scoring pass, only when a snapshot or a target is in
force). When only the target stands in the way of every candidate, those candidates are the chain, the least
predicted wait first (``wait_target_unmet``).

When no candidate passes (:mod:`.circuits`, off the hot path): candidates excluded only by the failing
gates whose circuits are half-open (``ctx.circuits``) become a trial chain (receipt code
``circuit_half_open_trial``, no canary promotion: a trial is a degraded mode, not a rollout); if there are
such candidates but none is half-open, ``NoHealthyCandidateError`` (503, with ``retry_after_s``);
otherwise ``NoSmartRouteCandidateError``. Every refusal here (and ``ModelNotFoundError``) carries its
decision as ``receipt`` (:func:`.receipt.refusal_receipt`: requirements, rejections with reasons) for the
request log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter, itemgetter
from types import MappingProxyType
from typing import Any

from ethen.gateway.errors import ModelNotFoundError, NoHealthyCandidateError, NoSmartRouteCandidateError

from . import reasons as r
from .canary import CanaryEvaluation, apply_canary
from .candidates import CanaryTarget, Candidate, ProjectPolicy
from .capacity import EMPTY_CAPACITY, CapacitySnapshot, Spillover, effective_target, predicted_wait_ms
from .circuits import EMPTY_CIRCUITS, CircuitView, circuit_keys, retry_after
from .filter import Rejection
from .hints import MODELS_HINT, refusal_hints
from .policy import ALIASES, CONCRETE_PROFILE, AliasProfile
from .receipt import Receipt, build_receipt, refusal_receipt
from .requirements import Requirements, parse_requirements
from .score import ScoredCandidate, score_pool
from .telemetry import EMPTY_STATS, TelemetrySnapshot

__all__ = ["ALIAS_PREFIX", "Decision", "RoutingContext", "decide", "resolve_pool"]

ALIAS_PREFIX = "ethen/"
_by_score = itemgetter(1)  # ScoredCandidate.score (C-level key functions: no Python call per element)
_by_key = attrgetter("candidate.key")  # (provider, model)
_rejection_key = itemgetter(1, 2)  # Rejection (provider, model)
_by_wait = attrgetter("predicted_wait_ms")


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """Everything the decision depends on besides the body. ``now`` must be timezone-aware."""

    pool: tuple[Candidate, ...]
    policy: ProjectPolicy
    telemetry: TelemetrySnapshot
    canaries: tuple[CanaryTarget, ...]
    now: datetime
    request_id: str
    circuits: CircuitView = EMPTY_CIRCUITS
    #: per (provider, model): prompt tokens its prompt cache holds for this request (issue 45:
    #: :meth:`.prefix.PrefixMemory.lookup`); empty: cache-blind scoring
    cached: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: issue 44: live capacity per provider (:mod:`.capacity`) and ``[[wait_targets]]`` (alias -> max_wait_ms)
    capacity: CapacitySnapshot = EMPTY_CAPACITY
    wait_targets: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.now.tzinfo is None:
            raise ValueError("RoutingContext.now must be timezone-aware")


@dataclass(frozen=True, slots=True)
class Decision:
    """``chain`` is ranked and capability-safe: it is the fallback chain (``chain[0]`` is primary).
    ``trials``: for a half-open trial chain, candidate id -> the circuit keys its attempt tries (the shell
    lets one trial per key through); ``None`` otherwise."""

    chain: tuple[ScoredCandidate, ...]
    rejected: tuple[Rejection, ...]
    receipt: Receipt
    requirements: Requirements
    profile: AliasProfile
    canary: CanaryEvaluation | None = None
    trials: Mapping[str, tuple[str, ...]] | None = None

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
                    "expected_cached_tokens": sc.expected_cached_tokens,
                }
                for sc in self.chain
            ],
            "rejected": [rj.to_dict() for rj in self.rejected],
            **({"trials": {cid: list(keys) for cid, keys in self.trials.items()}} if self.trials else {}),
        }


def resolve_pool(model: str, pool: tuple[Candidate, ...]) -> tuple[AliasProfile, tuple[Candidate, ...], bool]:
    """(profile, pool to consider, is_concrete). Raises ``ModelNotFoundError``."""
    profile = ALIASES.get(model)
    if profile is not None:
        return profile, pool, False
    if model.startswith(ALIAS_PREFIX):
        raise ModelNotFoundError(model, MODELS_HINT)
    sub = tuple(c for c in pool if c.model == model) or tuple(c for c in pool if c.id == model)
    if not sub:
        raise ModelNotFoundError(model, MODELS_HINT)
    return CONCRETE_PROFILE, sub, True


def decide(body: Mapping[str, Any], ctx: RoutingContext) -> Decision:
    """Route one chat-completions body. Raises ``InvalidRequestError``, ``ModelNotFoundError``,
    ``NoSmartRouteCandidateError`` or ``GatewayConfigError`` (all ``GatewayError``)."""
    req = parse_requirements(body)
    try:
        profile, pool, concrete = resolve_pool(req.model, ctx.pool)
    except ModelNotFoundError as err:
        err.receipt = refusal_receipt(req, None, ())
        raise
    target = effective_target(None if concrete else ctx.wait_targets.get(req.model), req.max_wait_ms)
    caps = ctx.capacity.providers
    feasible, rejected = score_pool(pool, req, profile, ctx.policy, ctx.telemetry, ctx.now,
                                    capacity=caps, max_wait_ms=target, cached=ctx.cached)
    rejected.sort(key=_rejection_key)
    rejections = tuple(rejected)
    if not feasible:
        return _none_passes(req, profile, pool, concrete, ctx, rejections)
    # rank: score desc, then provider id, then model id. Scores rarely tie: when they are all distinct, one
    # sort by score (C-level key) is the whole order. Otherwise a stable sort by (provider, model) first; two
    # stable sorts are cheaper than one building a (-score, provider, model) tuple per candidate.
    scores = list(map(_by_score, feasible))
    if len(set(scores)) != len(scores):
        feasible.sort(key=_by_key)
    feasible.sort(key=_by_score, reverse=True)
    spill = (
        _spillover(pool, req, profile, ctx, feasible[0], feasible, rejections, target)
        if caps or target is not None else None
    )
    canary = apply_canary(req.model, feasible, ctx.canaries, ctx.telemetry, ctx.request_id)
    chain = tuple(feasible)
    receipt = build_receipt(req, profile, chain, rejections, canary, concrete, ctx.policy, spillover=spill)
    return Decision(chain, rejections, receipt, req, profile, canary)


def _ranked(scored: list[ScoredCandidate]) -> list[ScoredCandidate]:
    scored.sort(key=_by_key)
    scored.sort(key=_by_score, reverse=True)
    return scored


def _spillover(
    pool: tuple[Candidate, ...],
    req: Requirements,
    profile: AliasProfile,
    ctx: RoutingContext,
    chosen: ScoredCandidate,
    feasible: list[ScoredCandidate],
    rejections: tuple[Rejection, ...],
    target: float | None,
) -> Spillover | None:
    """The rank 1 without the capacity signal, when the capacity signal passed it over (a second scoring
    pass, only when a capacity snapshot or a wait target is in force)."""
    plain, _ = score_pool(pool, req, profile, ctx.policy, ctx.telemetry, ctx.now, cached=ctx.cached)
    if not plain:
        return None
    best = _ranked(plain)[0]
    if best.candidate.id == chosen.candidate.id:
        return None
    cand = best.candidate
    for sc in feasible:
        if sc.candidate.id == cand.id:
            return Spillover(cand.provider, cand.id, "predicted_wait", sc.predicted_wait_ms, target)
    stats = ctx.telemetry.stats.get(cand.key, EMPTY_STATS)
    _, _, ta, tb, _, _ = stats.terms
    wait = predicted_wait_ms(ctx.capacity.get(cand.provider), cand.info.ttft_ms * ta + tb, req.input_tokens)
    if any(rj.candidate_id == cand.id and r.PREDICTED_WAIT_EXCEEDS_TARGET in rj.reasons for rj in rejections):
        return Spillover(cand.provider, cand.id, r.PREDICTED_WAIT_EXCEEDS_TARGET, wait, target)
    return None


def _none_passes(
    req: Requirements,
    profile: AliasProfile,
    pool: tuple[Candidate, ...],
    concrete: bool,
    ctx: RoutingContext,
    rejections: tuple[Rejection, ...],
) -> Decision:
    """No candidate passed every gate: a half-open trial chain, else the right error (:mod:`.circuits`)."""
    waiting = {rj.candidate_id for rj in rejections if rj.reasons == (r.PREDICTED_WAIT_EXCEEDS_TARGET,)}
    if waiting:  # issue 44: only the wait target stands in the way; a full mesh refuses on its own
        sub = tuple(c for c in pool if c.id in waiting)
        scored, _ = score_pool(sub, req, profile, ctx.policy, ctx.telemetry, ctx.now,
                               capacity=ctx.capacity.providers, cached=ctx.cached)
        chain = tuple(sorted(_ranked(scored), key=_by_wait))  # the least predicted wait first (stable)
        rest = tuple(rj for rj in rejections if rj.candidate_id not in waiting)
        receipt = build_receipt(req, profile, chain, rest, None, concrete, ctx.policy, wait_unmet=True)
        return Decision(chain, rest, receipt, req, profile, None)
    blocked = {rj.candidate_id: keys for rj in rejections if (keys := circuit_keys(rj)) is not None}
    if not blocked:
        hints = refusal_hints(req, pool, rejections, ctx.policy)
        err = NoSmartRouteCandidateError(
            f"no candidate for {req.model!r} satisfies the request "
            f"({len(rejections)} rejected; see 'rejections')"
            + (f". To serve it: {' '.join(hints)}" if hints else ""),
            rejections,
        )
        err.receipt = refusal_receipt(req, profile, rejections, concrete)
        raise err
    half_open = ctx.circuits.half_open
    trials = {cid: keys for cid, keys in blocked.items() if half_open.issuperset(keys)}
    if not trials:
        wait = retry_after(blocked.values(), ctx.circuits, ctx.now)
        unhealthy = NoHealthyCandidateError(
            f"every candidate that can serve {req.model!r} is excluded by recent failures of its provider "
            f"({len(blocked)} of {len(rejections)}; see 'rejections'); retry in {wait} s",
            rejections,
            wait,
        )
        unhealthy.receipt = refusal_receipt(req, profile, rejections, concrete)
        raise unhealthy
    sub = tuple(c for c in pool if c.id in trials)
    feasible, _ = score_pool(sub, req, profile, ctx.policy, ctx.telemetry, ctx.now, gated=False,
                             cached=ctx.cached)
    feasible.sort(key=_by_key)
    feasible.sort(key=_by_score, reverse=True)
    chain = tuple(feasible)
    rest = tuple(rj for rj in rejections if rj.candidate_id not in trials)
    receipt = build_receipt(req, profile, chain, rest, None, concrete, ctx.policy, trial=True)
    return Decision(chain, rest, receipt, req, profile, None, MappingProxyType(trials))
