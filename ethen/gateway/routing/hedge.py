"""When and whether to hedge a request (issue 27): a pure function of the hedge rule, the chain, recent TTFT
samples, the client's opt-out and the budget. No I/O, no clock; the shell (``ethen.gateway.api.hedging``)
races the attempts.

A hedge is a second attempt of the same request on the next candidate of the decision's ranked chain, sent
when the attempt in flight has produced no first byte (stream: no content chunk; buffered: no answer) after
a delay. :func:`plan_hedge` returns a :class:`HedgePlan`:

- ``delays[i]``: the delay (ms) behind an attempt on ``chain[i]``, or ``None`` (never hedge behind it).
  ``after_ms`` gives the same delay everywhere (but the last position, which has no next candidate).
  ``after_percentile = p`` gives the p-th percentile (nearest rank: the smallest sample ``v`` with at least
  ``p`` % of the samples ``<= v``) of ``chain[i]``'s recent TTFT samples, when it has at least
  ``min_samples`` of them; below that, ``None``: no hedge behind that candidate (reason ``min_samples``),
  since a delay guessed from a handful of samples would hedge too often or never.
- ``blocked``: why a hedge must not fire even when the delay passes: ``"budget"`` when the project's
  remaining budget cannot cover two attempts (``remaining < 2 x reserve``; the shell still reserves the
  second attempt for real when the delay passes, and skips it if that fails). ``None``: may fire.
- ``enabled``: false when no hedge can fire for this request at all: the client's ``x-ethen-hedge: off``
  (``opt_out``), a chain of one candidate (``no_next_candidate``), or no position with a delay
  (``min_samples``).
- ``max_extra``: at most that many hedges per request (0 disables hedging: ``max_extra``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HedgeFacts", "HedgePlan", "HedgeRule", "nearest_rank", "plan_hedge"]

#: reasons on a plan (also the ``skipped_*`` metric outcomes' suffixes)
OPT_OUT = "opt_out"
NO_NEXT = "no_next_candidate"
MIN_SAMPLES = "min_samples"
BUDGET = "budget"
MAX_EXTRA = "max_extra"
AFTER_MS = "after_ms"
AFTER_PERCENTILE = "after_percentile"


@dataclass(frozen=True, slots=True)
class HedgeRule:
    """One ``[[hedges]]`` entry: exactly one of ``after_ms`` / ``after_percentile`` is set."""

    alias: str
    after_ms: float | None = None
    after_percentile: int | None = None  # 1..100
    min_samples: int = 20
    max_extra: int = 1

    def __post_init__(self) -> None:
        if (self.after_ms is None) == (self.after_percentile is None):
            raise ValueError("set exactly one of after_ms and after_percentile")


@dataclass(frozen=True, slots=True)
class HedgeFacts:
    """What one request brings: its chain (candidate ids, ranked), the recent TTFT samples (ms) of those
    candidates, the client's opt-out, and the budget (``remaining_usd`` None: no budget applies)."""

    chain: tuple[str, ...]
    ttft_samples: Mapping[str, Sequence[float]]
    opt_out: bool = False
    remaining_usd: float | None = None
    reserve_usd: float = 0.0  # what one attempt reserves


@dataclass(frozen=True, slots=True)
class HedgePlan:
    """The decision: see the module docstring."""

    enabled: bool
    delays: tuple[float | None, ...]
    max_extra: int
    blocked: str | None
    reasons: tuple[str, ...]

    @property
    def after_ms(self) -> float | None:
        """The delay behind the first attempt (the receipt's ``after_ms``)."""
        return self.delays[0] if self.delays else None


def nearest_rank(samples: Sequence[float], p: int) -> float:
    """The p-th percentile (1 <= p <= 100) of non-empty ``samples`` by nearest rank: the sorted samples'
    element at rank ``ceil(p * n / 100)`` (integer arithmetic, no float rounding at the edges)."""
    if not samples or not 1 <= p <= 100:
        raise ValueError("need samples and 1 <= p <= 100")
    s = sorted(samples)
    rank = -(-p * len(s) // 100)
    return s[max(rank, 1) - 1]


def _delay(rule: HedgeRule, samples: Sequence[float]) -> float | None:
    if rule.after_ms is not None:
        return rule.after_ms
    assert rule.after_percentile is not None
    if len(samples) < max(rule.min_samples, 1):
        return None
    return nearest_rank(samples, rule.after_percentile)


def plan_hedge(rule: HedgeRule, facts: HedgeFacts) -> HedgePlan:
    """The hedge plan of one request (module docstring)."""
    chain = facts.chain
    n = len(chain)
    delays = tuple(
        _delay(rule, facts.ttft_samples.get(cid, ())) if i + 1 < n else None for i, cid in enumerate(chain)
    )
    reasons: list[str] = [AFTER_MS if rule.after_ms is not None else AFTER_PERCENTILE]
    enabled = True
    if facts.opt_out:
        reasons.append(OPT_OUT)
        enabled = False
    if rule.max_extra <= 0:
        reasons.append(MAX_EXTRA)
        enabled = False
    if n < 2:
        reasons.append(NO_NEXT)
        enabled = False
    elif all(d is None for d in delays):
        reasons.append(MIN_SAMPLES)
        enabled = False
    blocked = None
    if facts.remaining_usd is not None and facts.remaining_usd < 2 * facts.reserve_usd:
        blocked = BUDGET
        reasons.append(BUDGET)
    return HedgePlan(enabled, delays, max(rule.max_extra, 0), blocked, tuple(reasons))
