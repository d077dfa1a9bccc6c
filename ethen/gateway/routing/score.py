"""Scoring: eight components, each in [0, 1], weighted by the alias profile (weights sum to 1).

* quality: the catalog prior (times the profile's ``non_reasoning_quality_factor`` for a model without
  reasoning metadata).
* cost: ``ref / (ref + usd_per_mtok)`` where ``usd_per_mtok`` is the request's estimated cost divided by its
  estimated tokens (so the request's own input/output mix decides), ``ref = 1 USD / Mtok``. Free -> 1.
* latency, ttft: ``ref / (ref + ms)`` of the prior blended with recent observations (:mod:`.telemetry`).
* reliability: Beta-smoothed recent success rate of this (provider, model).
* health: Beta-smoothed recent success rate of the provider over all its models.
* context: log-scaled window, 4K -> 0, 1M -> 1.
* tools: mean of tool support and structured-output support (tool-use readiness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .candidates import Candidate
from .policy import (
    COMPONENTS,
    CONTEXT_MAX_TOKENS,
    CONTEXT_MIN_TOKENS,
    COST_REF_USD_PER_MTOK,
    LATENCY_REF_MS,
    TTFT_REF_MS,
    AliasProfile,
)
from .telemetry import CandidateStats, blend, smoothed_success

__all__ = ["ScoreComponents", "ScoredCandidate", "score_candidate"]

_LOG_CTX_MIN = math.log(CONTEXT_MIN_TOKENS)
_LOG_CTX_SPAN = math.log(CONTEXT_MAX_TOKENS) - _LOG_CTX_MIN


@dataclass(frozen=True, slots=True)
class ScoreComponents:
    quality: float
    cost: float
    latency: float
    ttft: float
    reliability: float
    health: float
    context: float
    tools: float

    def as_tuple(self) -> tuple[float, ...]:
        return (
            self.quality, self.cost, self.latency, self.ttft,
            self.reliability, self.health, self.context, self.tools,
        )

    def to_dict(self, digits: int = 4) -> dict[str, float]:
        return {name: round(v, digits) for name, v in zip(COMPONENTS, self.as_tuple(), strict=True)}


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    """A feasible candidate with its total score, components and estimated request cost."""

    candidate: Candidate
    score: float
    components: ScoreComponents
    estimated_cost_usd: float
    telemetry_samples: int

    @property
    def id(self) -> str:
        return self.candidate.id


def _context_score(window: int) -> float:
    if window <= CONTEXT_MIN_TOKENS:
        return 0.0
    return min(1.0, (math.log(window) - _LOG_CTX_MIN) / _LOG_CTX_SPAN)


def score_candidate(
    cand: Candidate,
    profile: AliasProfile,
    weights: tuple[float, ...],
    cost_usd: float,
    total_tokens: int,
    stats: CandidateStats,
    provider_samples: int,
    provider_successes: int,
) -> ScoredCandidate:
    info = cand.info
    quality = info.quality if info.supports_reasoning else info.quality * profile.non_reasoning_quality_factor
    per_mtok = cost_usd * 1e6 / total_tokens if total_tokens > 0 else 0.0
    n = stats.successes
    comps = ScoreComponents(
        quality=quality,
        cost=COST_REF_USD_PER_MTOK / (COST_REF_USD_PER_MTOK + per_mtok),
        latency=LATENCY_REF_MS / (LATENCY_REF_MS + blend(info.latency_ms, stats.latency_ms_mean, n)),
        ttft=TTFT_REF_MS / (TTFT_REF_MS + blend(info.ttft_ms, stats.ttft_ms_mean, n)),
        reliability=smoothed_success(stats.samples, stats.successes),
        health=smoothed_success(provider_samples, provider_successes),
        context=_context_score(info.context_window),
        tools=(float(info.supports_tools) + float(info.supports_structured_output)) / 2.0,
    )
    w = weights
    total = (
        w[0] * comps.quality + w[1] * comps.cost + w[2] * comps.latency + w[3] * comps.ttft
        + w[4] * comps.reliability + w[5] * comps.health + w[6] * comps.context + w[7] * comps.tools
    )
    return ScoredCandidate(cand, total, comps, cost_usd, stats.samples)
