"""Shadow evaluation (issue 27): which ``[[shadows]]`` candidates one served request is also sent to, and
whether a shadow's record allows its promotion to a canary. Pure: no I/O, no clock, no randomness; the shell
(``ethen.gateway.api.shadow``) sends the calls and records the pairs.

- **Sampling** (:func:`sampled`): ``bucket = blake2b("alias|candidate|request_id") % 10_000`` (basis points,
  stable across processes; the same hash family as :mod:`.canary`, with its own key order so a shadow and a
  canary of one alias do not pick the same requests by construction). A request is sampled when
  ``bucket < round(percent * 100)``: ``percent = 5`` samples 5 % of the request ids, ``0.5`` half a percent.
- **Plan** (:func:`plan_shadows`): for each rule of the requested alias, in candidate order, one
  :class:`ShadowPlan` with ``send`` and a ``reason``:
  ``not_sampled``; ``same_as_primary`` (the candidate served the request: nothing to compare);
  ``unknown_candidate`` (not in the pool: its provider was skipped at start); ``skipped_gate`` (it fails a
  hard gate of the request or the alias, the codes in ``gate_reasons``: tools, vision, structured output,
  context, max output, live certification, the client's ``only_providers`` and its project's allow-lists);
  ``dropped_in_flight`` (``max_in_flight`` shadow calls of this rule already run); else ``sent``. Budgets
  never gate here: the client's budget does not pay for a shadow, and the shadow project's is checked by
  the shell when it reserves (``skipped_budget``). Neither do the candidate's health gates (a failing
  candidate's failures are what a shadow is there to record).
- **Promotion** (:func:`promotion_verdict`): refused when ``n < min_samples`` or
  ``success_rate < min_success_rate``, with the reason in words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from . import reasons as r
from .candidates import Candidate, ProjectPolicy
from .filter import check_candidate
from .policy import HardGates
from .requirements import Requirements
from .telemetry import CandidateStats

__all__ = [
    "BUCKETS",
    "ShadowFacts",
    "ShadowPlan",
    "ShadowRule",
    "plan_shadows",
    "promotion_verdict",
    "sampled",
    "shadow_bucket",
]

#: buckets of the sampling hash (basis points: ``percent`` has two decimals of resolution)
BUCKETS = 10_000
SENT = "sent"
NOT_SAMPLED = "not_sampled"
SAME_AS_PRIMARY = "same_as_primary"
UNKNOWN_CANDIDATE = "unknown_candidate"
SKIPPED_GATE = "skipped_gate"
DROPPED_IN_FLIGHT = "dropped_in_flight"
#: the reasons a plan can carry
REASONS = (SENT, NOT_SAMPLED, SAME_AS_PRIMARY, UNKNOWN_CANDIDATE, SKIPPED_GATE, DROPPED_IN_FLIGHT)
#: rejection codes of :func:`~.filter.check_candidate` that are no hard gate of a shadow (module docstring)
_NOT_GATES = frozenset({r.OVER_BUDGET_CEILING, r.OVER_PROJECT_BUDGET, r.PROVIDER_FAILING,
                        r.CANDIDATE_FAILING})
_NO_STATS = CandidateStats()


@dataclass(frozen=True, slots=True)
class ShadowRule:
    """One ``[[shadows]]`` entry."""

    alias: str
    candidate: str  # provider/model
    percent: float  # 0..100
    project: str  # whose budget pays for the shadow calls
    max_in_flight: int = 8
    min_success_rate: float = 0.95
    min_samples: int = 20

    def __post_init__(self) -> None:
        if not 0 <= self.percent <= 100:
            raise ValueError(f"percent must be from 0 to 100, got {self.percent!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight!r}")
        if not 0 <= self.min_success_rate <= 1:
            raise ValueError(f"min_success_rate must be from 0 to 1, got {self.min_success_rate!r}")
        if self.min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {self.min_samples!r}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.alias, self.candidate)


@dataclass(frozen=True, slots=True)
class ShadowFacts:
    """What one served request brings: its id, requested model, the candidate that served it, its
    requirements and alias gates, the client's policy (allow-lists; its budget is ignored), the pool (by
    candidate id), the shadow calls in flight per rule (``(alias, candidate) -> n``) and ``now``."""

    request_id: str
    alias: str
    served: str
    requirements: Requirements
    gates: HardGates
    policy: ProjectPolicy
    pool: Mapping[str, Candidate]
    in_flight: Mapping[tuple[str, str], int]
    now: datetime


@dataclass(frozen=True, slots=True)
class ShadowPlan:
    """The decision for one rule: send or not, why, the bucket, and the failed gates (``skipped_gate``)."""

    rule: ShadowRule
    send: bool
    reason: str
    bucket: int
    gate_reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"candidate": self.rule.candidate, "send": self.send, "reason": self.reason,
                                  "bucket": self.bucket}
        if self.gate_reasons:
            out["gate_reasons"] = list(self.gate_reasons)
        return out


def shadow_bucket(request_id: str, alias: str, candidate: str) -> int:
    """The request's bucket for one rule, in ``0 .. BUCKETS-1`` (module docstring)."""
    digest = hashlib.blake2b(f"{alias}|{candidate}|{request_id}".encode(), digest_size=8,
                             person=b"ethen-shadow").digest()
    return int.from_bytes(digest, "big") % BUCKETS


def sampled(rule: ShadowRule, request_id: str) -> tuple[bool, int]:
    """(whether the request is sampled for ``rule``, its bucket)."""
    b = shadow_bucket(request_id, rule.alias, rule.candidate)
    return b < round(rule.percent * 100), b


def _gates(cand: Candidate, facts: ShadowFacts) -> tuple[str, ...]:
    policy = ProjectPolicy(facts.policy.allowed_providers, facts.policy.allowed_models, None)
    why = check_candidate(cand, facts.requirements, facts.gates, policy, 0.0, _NO_STATS, (), facts.now)
    return tuple(w for w in why if w not in _NOT_GATES)


def plan_shadows(rules: Sequence[ShadowRule], facts: ShadowFacts) -> tuple[ShadowPlan, ...]:
    """One plan per rule of ``facts.alias`` (module docstring), in candidate order."""
    out: list[ShadowPlan] = []
    for rule in sorted((x for x in rules if x.alias == facts.alias), key=lambda x: x.candidate):
        hit, b = sampled(rule, facts.request_id)
        if not hit:
            out.append(ShadowPlan(rule, False, NOT_SAMPLED, b))
            continue
        if rule.candidate == facts.served:
            out.append(ShadowPlan(rule, False, SAME_AS_PRIMARY, b))
            continue
        cand = facts.pool.get(rule.candidate)
        if cand is None:
            out.append(ShadowPlan(rule, False, UNKNOWN_CANDIDATE, b))
            continue
        why = _gates(cand, facts)
        if why:
            out.append(ShadowPlan(rule, False, SKIPPED_GATE, b, why))
            continue
        if facts.in_flight.get(rule.key, 0) >= rule.max_in_flight:
            out.append(ShadowPlan(rule, False, DROPPED_IN_FLIGHT, b))
            continue
        out.append(ShadowPlan(rule, True, SENT, b))
    return tuple(out)


def promotion_verdict(n: int, success_rate: float | None, rule: ShadowRule) -> tuple[bool, str]:
    """(whether ``rule``'s candidate may become a canary, why): ``n`` recorded pairs with ``success_rate``
    (``None`` when ``n`` is 0) against ``min_samples`` and ``min_success_rate``."""
    if n < rule.min_samples:
        return False, f"n = {n} < min_samples = {rule.min_samples}"
    if success_rate is None or success_rate < rule.min_success_rate:
        rate = "none" if success_rate is None else f"{success_rate:.4f}"
        return False, f"success_rate = {rate} < min_success_rate = {rule.min_success_rate}"
    return True, (f"n = {n} >= min_samples = {rule.min_samples} and success_rate = {success_rate:.4f} >= "
                  f"min_success_rate = {rule.min_success_rate}")
