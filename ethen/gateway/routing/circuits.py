"""Half-open circuits as the core sees them: which telemetry-excluded candidates may get a trial request.

The failing gate (:mod:`.telemetry`: 0 successes over >= 3 recent samples, per provider and per
provider/model; per provider/model also a run of 3 failures after its last success) excludes a candidate
for as long as its failures stay in the window (300 s). The shell keeps a *circuit* per gate key
(``ethen.gateway.circuit``): a provider id (``"alpha"``, for ``provider_failing``) or a candidate id
(``"alpha/m"``, for ``candidate_failing``; provider ids never hold ``/``, so the two never collide).
A circuit is open while its gate trips; after a cool-down it is *half-open*: one trial may go through. The
shell passes the half-open keys and each open circuit's next trial time in a :class:`CircuitView` on the
:class:`~ethen.gateway.routing.RoutingContext`; the core decides with them:

* a rejected candidate is *blocked only by telemetry* when every reason it has is ``provider_failing`` or
  ``candidate_failing`` (it would have been served had the provider been healthy); its blocking circuits
  are the keys of those reasons (:func:`circuit_keys`);
* when no candidate passes every gate and some blocked-only-by-telemetry candidates have every blocking
  circuit half-open, those become the chain (ranked like any chain, reason code
  ``circuit_half_open_trial`` on the receipt, ``Decision.trials`` naming the circuits each one tries). A
  request with a healthy alternative never goes to a failing candidate: the spec's gate holds for it;
* when none of them is half-open, the answer is ``NoHealthyCandidateError`` (HTTP 503, an outage, not the
  client's fault) with ``retry_after_s`` = time until the earliest of them may get a trial
  (:func:`retry_after`), at least 1 s, :data:`DEFAULT_RETRY_AFTER_S` when the view does not know;
* when no rejected candidate is blocked only by telemetry, it stays ``NoSmartRouteCandidateError`` (422).

Off the hot path: all of this runs only when no candidate passes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Final

from . import reasons as r
from .filter import Rejection

__all__ = [
    "DEFAULT_RETRY_AFTER_S",
    "EMPTY_CIRCUITS",
    "TELEMETRY_REASONS",
    "CircuitView",
    "circuit_keys",
    "retry_after",
]

#: Retry-After (seconds) of a 503 whose circuits the view does not know (e.g. no shell circuit yet).
DEFAULT_RETRY_AFTER_S: Final = 2
TELEMETRY_REASONS: Final = frozenset({r.PROVIDER_FAILING, r.CANDIDATE_FAILING})


@dataclass(frozen=True, slots=True)
class CircuitView:
    """The shell's circuits at decision time. ``half_open``: keys where one trial may go now. ``retry_at``:
    open circuits' next trial time (timezone-aware; same clock as ``RoutingContext.now``)."""

    half_open: frozenset[str] = frozenset()
    retry_at: Mapping[str, datetime] = field(default_factory=lambda: MappingProxyType({}))


EMPTY_CIRCUITS: Final = CircuitView()


def circuit_keys(rj: Rejection) -> tuple[str, ...] | None:
    """The circuits blocking a candidate rejected only for telemetry reasons; ``None`` if any other reason
    applies (or it has none)."""
    keys: list[str] = []
    for code in rj.reasons:
        if code == r.PROVIDER_FAILING:
            keys.append(rj.provider)
        elif code == r.CANDIDATE_FAILING:
            keys.append(rj.candidate_id)
        else:
            return None
    return tuple(keys) if keys else None


def retry_after(blocked: Iterable[tuple[str, ...]], view: CircuitView, now: datetime) -> int:
    """Whole seconds until the earliest blocked candidate may get a trial (a candidate waits for the latest
    of its circuits). At least 1; :data:`DEFAULT_RETRY_AFTER_S` when a circuit's time is unknown."""
    best = math.inf
    for keys in blocked:
        wait = 0.0
        for k in keys:
            at = view.retry_at.get(k)
            wait = max(wait, DEFAULT_RETRY_AFTER_S if at is None else (at - now).total_seconds())
        best = min(best, wait)
    if best == math.inf:
        return DEFAULT_RETRY_AFTER_S
    return max(1, math.ceil(best))
