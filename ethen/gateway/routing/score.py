"""Scoring: eight components, each in [0, 1], weighted by the alias profile (weights sum to 1).

* quality: the catalog prior (times the profile's ``non_reasoning_quality_factor`` for a model without
  reasoning metadata).
* cost: ``ref / (ref + usd_per_mtok)`` where ``usd_per_mtok`` is the request's estimated cost divided by its
  estimated tokens (so the request's own input/output mix decides), ``ref = 1 USD / Mtok``. Free -> 1.
* latency, ttft: ``ref / (ref + ms)`` of the prior blended with recent observations (:mod:`.telemetry`).
* reliability: Beta-smoothed recent success rate of this (provider, model).
* health: Beta-smoothed recent success rate of the provider over all its models.
* context: log-scaled window, 4K -> 0, 1M -> 1 (precomputed on the candidate).
* tools: mean of tool support and structured-output support (tool-use readiness; precomputed).

``ScoreComponents`` and ``ScoredCandidate`` are ``NamedTuple`` s: immutable like frozen dataclasses, and
cheap to build on the hot path (one per feasible candidate per request).
"""

from __future__ import annotations

from typing import NamedTuple

from .candidates import Candidate
from .policy import COMPONENTS, COST_REF_USD_PER_MTOK, LATENCY_REF_MS, TTFT_REF_MS
from .telemetry import LATENCY_PRIOR_WEIGHT, RELIABILITY_PRIOR, CandidateStats

__all__ = ["ScoreComponents", "ScoredCandidate", "score_candidate"]

_A, _B = RELIABILITY_PRIOR
_AB = _A + _B
_K = LATENCY_PRIOR_WEIGHT
_COST_REF = COST_REF_USD_PER_MTOK
_LAT_REF = LATENCY_REF_MS
_TTFT_REF = TTFT_REF_MS
_new = tuple.__new__


class ScoreComponents(NamedTuple):
    quality: float
    cost: float
    latency: float
    ttft: float
    reliability: float
    health: float
    context: float
    tools: float

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(self)

    def to_dict(self, digits: int = 4) -> dict[str, float]:
        return {name: round(v, digits) for name, v in zip(COMPONENTS, self, strict=True)}


class ScoredCandidate(NamedTuple):
    """A feasible candidate with its total score, estimated request cost and the eight components (flat
    fields, so one tuple per candidate is built on the hot path; :attr:`components` groups them)."""

    candidate: Candidate
    score: float
    estimated_cost_usd: float
    telemetry_samples: int
    quality: float
    cost: float
    latency: float
    ttft: float
    reliability: float
    health: float
    context: float
    tools: float

    @property
    def id(self) -> str:
        return self.candidate.id

    @property
    def components(self) -> ScoreComponents:
        return _new(ScoreComponents, self[4:])


def score_candidate(
    cand: Candidate,
    non_reasoning_quality_factor: float,
    weights: tuple[float, ...],
    cost_usd: float,
    total_tokens: int,
    stats: CandidateStats,
    provider_samples: int,
    provider_successes: int,
) -> ScoredCandidate:
    info = cand.info
    quality = info.quality if info.supports_reasoning else info.quality * non_reasoning_quality_factor
    c_cost = _COST_REF / (_COST_REF + cost_usd * 1e6 / total_tokens) if total_tokens > 0 else 1.0
    n = stats.successes
    latency = info.latency_ms
    ttft = info.ttft_ms
    if n > 0:  # prior-weighted blend (telemetry.blend), inlined
        mean = stats.latency_ms_mean
        if mean is not None:
            latency = (_K * latency + n * mean) / (_K + n)
        mean = stats.ttft_ms_mean
        if mean is not None:
            ttft = (_K * ttft + n * mean) / (_K + n)
    c_lat = _LAT_REF / (_LAT_REF + latency)
    c_ttft = _TTFT_REF / (_TTFT_REF + ttft)
    c_rel = (n + _A) / (stats.samples + _AB)  # telemetry.smoothed_success, inlined
    c_health = (provider_successes + _A) / (provider_samples + _AB)
    c_ctx = cand.context_score
    c_tools = cand.tools_score
    w0, w1, w2, w3, w4, w5, w6, w7 = weights
    total = (
        w0 * quality + w1 * c_cost + w2 * c_lat + w3 * c_ttft
        + w4 * c_rel + w5 * c_health + w6 * c_ctx + w7 * c_tools
    )
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (same object, cheaper on the hot path)
    return _new(
        ScoredCandidate,
        (cand, total, cost_usd, stats.samples, quality, c_cost, c_lat, c_ttft, c_rel, c_health, c_ctx,
         c_tools),
    )
