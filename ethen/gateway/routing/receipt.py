"""The routing receipt: routing facts only.

``Receipt.to_dict()`` is the ``ethen.routing`` object of the spec. Beyond the spec's fields it adds
``alias_profile`` (the profile that ranked), ``score``, ``estimated_cost_usd`` of the selection,
``hard_requirements`` (names), ``chain`` (ranked candidate ids = the fallback chain), ``rejected`` (id and
reason codes of each rejected candidate) and ``canary`` when a target exists for the requested alias.
``candidate_count`` is the number of feasible, ranked candidates (the chain length); ``rejected_count`` the
number filtered out; their sum is the pool considered.

``to_dict()`` never holds endpoints, credentials, project/tenant ids, the request id, or telemetry internals
(sample counts, success rates, latency means): only reason codes and [0, 1] score components derived from
them. (The Python object keeps the ranked ``ScoredCandidate`` s in ``ranked`` for the shell; ``chain`` gives
their ids.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import reasons as r
from .canary import CanaryEvaluation
from .candidates import ProjectPolicy
from .capacity import Spillover
from .filter import Rejection
from .policy import POLICY_VERSION, AliasProfile
from .requirements import Requirements
from .score import ScoreComponents, ScoredCandidate

__all__ = ["HIGH_RELIABILITY", "Receipt", "build_receipt", "hard_requirement_names", "refusal_receipt"]

#: ``high_recent_reliability``: smoothed reliability at least this, over at least 3 recent samples.
HIGH_RELIABILITY = 0.9
_MIN_SAMPLES_FOR_HIGH = 3


@dataclass(frozen=True, slots=True)
class Receipt:
    """Why this candidate was chosen; ``to_dict()`` is the ``ethen.routing`` JSON object.

    Stored: what is not derivable from the ranked chain. The selection, its score/components/cost and the
    counts are properties over ``ranked`` / ``rejected`` (one source of truth, fewer fields to build).
    """

    requested_model: str
    reason_codes: tuple[str, ...]
    routing_policy_version: str
    alias_profile: str
    hard_requirements: tuple[str, ...]
    ranked: tuple[ScoredCandidate, ...]
    rejected: tuple[Rejection, ...]
    canary: CanaryEvaluation | None = None
    spillover: Spillover | None = None  # issue 44: the preferred candidate was passed over for capacity

    @property
    def selected_model(self) -> str:
        return self.ranked[0].candidate.model

    @property
    def selected_provider(self) -> str:
        return self.ranked[0].candidate.provider

    @property
    def score(self) -> float:
        return self.ranked[0].score

    @property
    def score_components(self) -> ScoreComponents:
        return self.ranked[0].components

    @property
    def estimated_cost_usd(self) -> float:
        return self.ranked[0].estimated_cost_usd

    @property
    def candidate_count(self) -> int:
        return len(self.ranked)

    @property
    def rejected_count(self) -> int:
        return len(self.rejected)

    @property
    def chain(self) -> tuple[str, ...]:
        """Ranked candidate ids (``provider/model``): the fallback chain."""
        return tuple(sc.candidate.id for sc in self.ranked)

    def to_dict(self, served: str | None = None) -> dict[str, Any]:
        """The ``ethen.routing`` object. ``served`` is the id (``provider/model``) of the chain candidate that
        answered, when the shell executed the request: if a fallback answered, ``selected_*``, the score, its
        components and the cost estimate are that candidate's (the receipt accompanies its answer),
        ``primary_model`` / ``primary_provider`` name the decision's rank 1 and ``fallback_used`` is added to
        ``reason_codes``."""
        top = self.ranked[0]
        codes = list(self.reason_codes)
        primary: dict[str, str] = {}
        if served is not None and served != top.candidate.id:
            pick = next((sc for sc in self.ranked if sc.candidate.id == served), None)
            if pick is None:
                raise ValueError(f"served candidate {served!r} is not in the ranked chain")
            primary = {"primary_model": top.candidate.model, "primary_provider": top.candidate.provider}
            codes.append(r.FALLBACK_USED)
            top = pick
        out: dict[str, Any] = {
            "requested_model": self.requested_model,
            "selected_model": top.candidate.model,
            "selected_provider": top.candidate.provider,
            "reason_codes": codes,
            "routing_policy_version": self.routing_policy_version,
            "candidate_count": len(self.ranked),
            "rejected_count": len(self.rejected),
            "score_components": top.components.to_dict(),
            "score": round(top.score, 4),
            **primary,
            "alias_profile": self.alias_profile,
            "estimated_cost_usd": top.estimated_cost_usd,
            "expected_cached_tokens": top.expected_cached_tokens,
            "predicted_wait_ms": round(top.predicted_wait_ms, 1),
            "hard_requirements": list(self.hard_requirements),
            "chain": [sc.candidate.id for sc in self.ranked],
            "rejected": [rj.to_dict() for rj in self.rejected],
        }
        if self.canary is not None:
            out["canary"] = self.canary.to_dict()
        if self.spillover is not None:
            out["spillover"] = self.spillover.to_dict()
        return out


def hard_requirement_names(req: Requirements, profile: AliasProfile) -> tuple[str, ...]:
    """Names of the hard requirements in force (request + alias gates); ``context`` always applies."""
    g = profile.gates
    flags = (
        ("tools", req.tools or g.tools),
        ("vision", req.vision or g.vision),
        ("structured_output", req.structured_output),
        ("max_output", req.max_output_tokens is not None),
        ("budget_ceiling", req.budget_ceiling_usd is not None),
        ("live_certification", req.certification_live),
        ("provider_restriction", req.only_providers is not None),
    )
    return ("context", *(name for name, on in flags if on))


def build_receipt(
    req: Requirements,
    profile: AliasProfile,
    chain: tuple[ScoredCandidate, ...],
    rejections: tuple[Rejection, ...],
    canary: CanaryEvaluation | None,
    concrete: bool,
    policy: ProjectPolicy,
    trial: bool = False,
    *,
    spillover: Spillover | None = None,
    wait_unmet: bool = False,
) -> Receipt:
    """The receipt of a decision whose ranked chain (after the canary gate) is ``chain``; ``trial``: the chain
    is half-open circuits' trial candidates (:mod:`.circuits`)."""
    top = chain[0]
    codes = [r.SUPPORTS_REQUIRED_CAPABILITIES]
    if req.budget_ceiling_usd is not None or policy.remaining_budget_usd is not None:
        codes.append(r.WITHIN_BUDGET)
    if top.telemetry_samples >= _MIN_SAMPLES_FOR_HIGH and top.reliability >= HIGH_RELIABILITY:
        codes.append(r.HIGH_RECENT_RELIABILITY)
    codes.append(r.TELEMETRY_INFORMED if top.telemetry_samples > 0 else r.PRIOR_ONLY)
    codes.append(r.CANARY_PROMOTED if canary is not None and canary.promoted else r.HIGHEST_SCORE)
    if concrete:
        codes.append(r.CONCRETE_MODEL)
    if trial:
        codes.append(r.CIRCUIT_HALF_OPEN_TRIAL)
    if wait_unmet:
        codes.append(r.WAIT_TARGET_UNMET)
    return Receipt(
        requested_model=req.model,
        reason_codes=tuple(codes),
        routing_policy_version=POLICY_VERSION,
        alias_profile=profile.alias,
        hard_requirements=hard_requirement_names(req, profile),
        ranked=chain,
        rejected=rejections,
        canary=canary,
        spillover=spillover,
    )


def refusal_receipt(
    req: Requirements,
    profile: AliasProfile | None,
    rejections: tuple[Rejection, ...],
    concrete: bool = False,
) -> dict[str, Any]:
    """The receipt of a request routing refused (no candidate passed; or, with ``profile`` ``None``, an
    unknown model): what the request log keeps of its decision. The fields of :meth:`Receipt.to_dict`
    that exist without a selection (``selected_*`` ``None``, ``chain`` empty, ``candidate_count`` 0), plus
    ``requirements`` (:meth:`Requirements.to_dict`: what the request needed)."""
    return {
        "requested_model": req.model,
        "selected_model": None,
        "selected_provider": None,
        "reason_codes": [r.CONCRETE_MODEL] if concrete else [],
        "routing_policy_version": POLICY_VERSION,
        "candidate_count": 0,
        "rejected_count": len(rejections),
        "alias_profile": profile.alias if profile is not None else None,
        "hard_requirements": list(hard_requirement_names(req, profile)) if profile is not None else [],
        "requirements": req.to_dict(),
        "chain": [],
        "rejected": [rj.to_dict() for rj in rejections],
    }
