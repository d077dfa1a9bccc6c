"""The routing receipt: routing facts only.

``Receipt.to_dict()`` is the ``ethen.routing`` object of the spec. Beyond the spec's fields it adds
``alias_profile`` (the profile that ranked), ``score``, ``estimated_cost_usd`` of the selection,
``hard_requirements`` (names), ``chain`` (ranked candidate ids = the fallback chain), ``rejected`` (id and
reason codes of each rejected candidate) and ``canary`` when a target exists for the requested alias.
``candidate_count`` is the number of feasible, ranked candidates (the chain length); ``rejected_count`` the
number filtered out; their sum is the pool considered.

It never holds endpoints, credentials, project/tenant ids, the request id, or telemetry internals (sample
counts, success rates, latency means): only reason codes and [0, 1] score components derived from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .canary import CanaryEvaluation
from .filter import Rejection
from .score import ScoreComponents

__all__ = ["Receipt"]


@dataclass(frozen=True, slots=True)
class Receipt:
    requested_model: str
    selected_model: str
    selected_provider: str
    reason_codes: tuple[str, ...]
    routing_policy_version: str
    candidate_count: int
    rejected_count: int
    score_components: ScoreComponents
    score: float
    alias_profile: str
    estimated_cost_usd: float
    hard_requirements: tuple[str, ...]
    chain: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    canary: CanaryEvaluation | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requested_model": self.requested_model,
            "selected_model": self.selected_model,
            "selected_provider": self.selected_provider,
            "reason_codes": list(self.reason_codes),
            "routing_policy_version": self.routing_policy_version,
            "candidate_count": self.candidate_count,
            "rejected_count": self.rejected_count,
            "score_components": self.score_components.to_dict(),
            "score": round(self.score, 4),
            "alias_profile": self.alias_profile,
            "estimated_cost_usd": self.estimated_cost_usd,
            "hard_requirements": list(self.hard_requirements),
            "chain": list(self.chain),
            "rejected": [rj.to_dict() for rj in self.rejected],
        }
        if self.canary is not None:
            out["canary"] = self.canary.to_dict()
        return out
