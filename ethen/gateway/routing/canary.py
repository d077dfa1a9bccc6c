"""Canary gate: deterministic bucketing and promotion to rank 1.

* bucket = ``int.from_bytes(blake2b("alias|candidate|request_id", digest_size=8)) % 100`` - stable across
  processes and Python versions (never the salted built-in ``hash()``).
* A target whose ``alias`` equals the requested model is *hit* when ``bucket < percent``; it is promoted
  to rank 1 only if its candidate is in the filtered chain (it passed every hard requirement); otherwise the
  chain is unchanged and the receipt says ``eligible: false``.
* Several targets for one alias are evaluated in candidate-id order; the first hit-and-eligible one is
  promoted. The receipt reports that target, or else the first evaluated one.
* Acceptance (``samples >= min_samples`` and raw recent success rate ``>= min_success_rate``) is computed
  from the snapshot and reported; it does not gate promotion (the rollout needs traffic to gather samples -
  the operator or the shell moves the percent).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

from .candidates import CanaryTarget
from .score import ScoredCandidate
from .telemetry import TelemetrySnapshot

__all__ = ["CanaryEvaluation", "apply_canary", "bucket", "canary_acceptance"]


_chain_id = attrgetter("candidate.id")
_by_candidate = attrgetter("candidate")


def bucket(alias: str, candidate_id: str, request_id: str) -> int:
    digest = hashlib.blake2b(f"{alias}|{candidate_id}|{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


class CanaryEvaluation(NamedTuple):
    """The canary gate's outcome for one target (immutable)."""

    target: CanaryTarget
    bucket: int
    hit: bool
    eligible: bool
    promoted: bool
    acceptance_met: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.target.candidate,
            "percent": self.target.percent,
            "bucket": self.bucket,
            "hit": self.hit,
            "eligible": self.eligible,
            "promoted": self.promoted,
            "acceptance_met": self.acceptance_met,
        }


def canary_acceptance(target: CanaryTarget, telemetry: TelemetrySnapshot) -> bool:
    provider, _, model = target.candidate.partition("/")
    st = telemetry.get(provider, model)
    if st.samples < target.min_samples:
        return False
    rate = st.successes / st.samples if st.samples else 0.0
    return rate >= target.min_success_rate


def apply_canary(
    alias: str,
    chain: list[ScoredCandidate],
    targets: Sequence[CanaryTarget],
    telemetry: TelemetrySnapshot,
    request_id: str,
) -> CanaryEvaluation | None:
    """Evaluate the alias's targets; promote in place (``chain`` is reordered). Return the reported one."""
    if not targets:
        return None
    mine = sorted((t for t in targets if t.alias == alias), key=_by_candidate)
    if not mine:
        return None
    reported: CanaryEvaluation | None = None
    promoted_done = False
    ids = list(map(_chain_id, chain))  # C-level scan; the chain can hold hundreds of candidates
    for t in mine:
        b = bucket(alias, t.candidate, request_id)
        hit = b < t.percent
        idx = ids.index(t.candidate) if t.candidate in ids else -1
        eligible = idx >= 0
        promote = hit and eligible and not promoted_done
        if promote:
            chain.insert(0, chain.pop(idx))
            ids.insert(0, ids.pop(idx))
            promoted_done = True
        ev = CanaryEvaluation(t, b, hit, eligible, promote, canary_acceptance(t, telemetry))
        if promote or reported is None:
            reported = ev
    return reported
