"""Telemetry snapshot types (built by the shell, only read here) and the smoothing the scorer applies.

What "recent" means: the shell's in-memory store keeps, per (provider, model), the outcomes of the last
:data:`RECENT_MAX_OUTCOMES` (50) attempts that finished within the last :data:`RECENT_WINDOW_SECONDS` (300 s)
before the snapshot; :class:`CandidateStats` summarizes exactly those outcomes. The core never looks at the
clock: it trusts the snapshot's counts (``window_seconds`` / ``max_outcomes`` on the snapshot record what the
shell used).

Smoothing, so that one sample does not swing a score:

* reliability: the posterior mean of a Beta prior ``Beta(9, 1)`` (mean 0.9, strength 10 samples) updated
  with the recent successes/failures: ``(successes + 9) / (samples + 10)``. One failure on a fresh candidate
  moves it from 0.90 to 0.82, not to 0.
* health (per provider): the same Beta posterior over the provider's outcomes summed over its models.
* latency and TTFT: a prior-weighted blend ``(k * prior + n * observed_mean) / (k + n)`` with ``k = 5``: the
  catalog prior counts as five observations.

Failing gate: a provider whose recent outcomes, summed over all its models, show 0 successes over at least 3
samples is excluded (reason ``provider_failing``), for every one of its candidates. The spec says "providers";
we also exclude a single candidate with 0 successes over at least 3 of its own samples
(``candidate_failing``): a model that always fails at one provider must not stay primary just because the
provider's other models work.

Run of failures (issue 42): a candidate whose :data:`~.policy.FAILING_STREAK` (3) most recent outcomes all
failed is excluded too (``candidate_failing``), whatever came before them. Before, a provider that had been
serving and then went down kept its earlier successes in the window, so the gate never tripped, no circuit
opened, nothing probed it, and its smoothed reliability (e.g. 10 successes + 17 failures: 19/37) ranked it
below its alternative for the rest of the 300 s window. ``CandidateStats.streak`` is that run: the failures
that finished after the candidate's most recent success in the window (all of its samples when it has none,
so "0 successes over >= 3 samples" is the special case of a run of 3 with nothing before it). The
provider-wide gate keeps its rule: the snapshot has no order across a provider's models, and each model's own
run already opens that model's circuit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from .policy import FAILING_MIN_SAMPLES, FAILING_STREAK

__all__ = [
    "EMPTY_STATS",
    "LATENCY_PRIOR_WEIGHT",
    "RECENT_MAX_OUTCOMES",
    "RECENT_WINDOW_SECONDS",
    "RELIABILITY_PRIOR",
    "CandidateStats",
    "TelemetrySnapshot",
    "blend",
    "is_failing",
    "smoothed_success",
]

RECENT_WINDOW_SECONDS: Final = 300.0
RECENT_MAX_OUTCOMES: Final = 50
#: Beta prior (alpha = successes, beta = failures) for reliability and health.
RELIABILITY_PRIOR: Final = (9.0, 1.0)
#: Weight of the catalog latency/TTFT prior, in observations.
LATENCY_PRIOR_WEIGHT: Final = 5.0


def smoothed_success(samples: int, successes: int) -> float:
    """Beta-posterior mean success rate."""
    a, b = RELIABILITY_PRIOR
    return (successes + a) / (samples + a + b)


def is_failing(samples: int, successes: int, streak: int) -> bool:
    """The candidate gate: 0 successes over >= FAILING_MIN_SAMPLES recent samples, or a run of
    >= FAILING_STREAK failures after the most recent success (``streak``)."""
    return (successes == 0 and samples >= FAILING_MIN_SAMPLES) or streak >= FAILING_STREAK


def _blend_terms(observed_mean: float | None, n: int) -> tuple[float, float]:
    """``(a, b)`` with ``blend(prior, observed_mean, n) == prior * a + b`` (up to rounding)."""
    if observed_mean is None or n <= 0:
        return 1.0, 0.0
    k = LATENCY_PRIOR_WEIGHT
    return k / (k + n), n * observed_mean / (k + n)


def blend(prior: float, observed_mean: float | None, n: int) -> float:
    """Prior-weighted blend of a catalog prior with an observed mean over ``n`` observations."""
    if observed_mean is None or n <= 0:
        return prior
    k = LATENCY_PRIOR_WEIGHT
    return (k * prior + n * observed_mean) / (k + n)


@dataclass(frozen=True, slots=True)
class CandidateStats:
    """Recent outcomes of one (provider, model). Means are over the successful attempts that measured them;
    ``None`` when there is none.

    ``terms`` holds what the scorer needs from these stats, computed once here (the shell's store rebuilds a
    key's stats only when that key gets a new outcome) instead of once per candidate per request:
    ``(latency_a, latency_b, ttft_a, ttft_b, reliability, failing)``, where the blended latency is
    ``prior * latency_a + latency_b`` (:func:`blend`, factored into one multiply-add), ``reliability`` is
    :func:`smoothed_success` and ``failing`` is "0 successes over >= FAILING_MIN_SAMPLES samples, or the
    last FAILING_STREAK outcomes failed" (``streak``: the failures after the most recent success).
    """

    samples: int = 0
    successes: int = 0
    latency_ms_mean: float | None = None
    ttft_ms_mean: float | None = None
    streak: int = 0
    terms: tuple[float, float, float, float, float, bool] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.successes <= self.samples):
            raise ValueError(f"need 0 <= successes <= samples, got {self.successes}/{self.samples}")
        if not (0 <= self.streak <= self.samples - self.successes):
            failures = self.samples - self.successes
            raise ValueError(f"need 0 <= streak <= failures, got {self.streak} of {failures}")
        n = self.successes
        la, lb = _blend_terms(self.latency_ms_mean, n)
        ta, tb = _blend_terms(self.ttft_ms_mean, n)
        failing = is_failing(self.samples, n, self.streak)
        object.__setattr__(self, "terms", (la, lb, ta, tb, smoothed_success(self.samples, n), failing))

    def without_gate(self) -> CandidateStats:
        """The same stats with the failing flag off (``terms[5]``): scoring a half-open circuit's trial
        candidate (:mod:`.circuits`), whose reliability still counts."""
        out = CandidateStats(
            self.samples, self.successes, self.latency_ms_mean, self.ttft_ms_mean, self.streak
        )
        object.__setattr__(out, "terms", (*self.terms[:5], False))
        return out

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.samples if self.samples else None


EMPTY_STATS: Final = CandidateStats()


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    """Per (provider, model) recent stats. Missing keys mean "no recent evidence".

    ``provider_totals`` (provider -> (samples, successes) summed over all its models), ``failing_providers``
    (0 successes over >= 3 samples), ``failing_candidates`` and ``provider_health`` are computed once when
    the snapshot is built, so each decision reads them instead of re-summing. Build a new snapshot when the
    telemetry changes; do not mutate ``stats`` afterwards.
    """

    stats: Mapping[tuple[str, str], CandidateStats] = field(default_factory=lambda: MappingProxyType({}))
    window_seconds: float = RECENT_WINDOW_SECONDS
    max_outcomes: int = RECENT_MAX_OUTCOMES
    provider_totals: Mapping[str, tuple[int, int]] = field(init=False, compare=False, repr=False)
    failing_providers: frozenset[str] = field(init=False, compare=False, repr=False)
    #: (provider, model) keys with 0 successes over >= 3 samples of their own, or whose last 3 outcomes
    #: failed (``candidate_failing``, :func:`is_failing`)
    failing_candidates: frozenset[tuple[str, str]] = field(init=False, compare=False, repr=False)
    #: provider -> health component (Beta-smoothed success rate over all its models); absent -> prior mean
    provider_health: Mapping[str, float] = field(init=False, compare=False, repr=False)
    #: the same values as ``provider_health`` in a plain dict, read on the scorer's hot path (``dict.get`` is
    #: cheaper than ``mappingproxy.get``); not to be mutated
    health: dict[str, float] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        totals: dict[str, tuple[int, int]] = {}
        failing_keys: list[tuple[str, str]] = []
        for key, st in self.stats.items():
            provider = key[0]
            n, s = totals.get(provider, (0, 0))
            totals[provider] = (n + st.samples, s + st.successes)
            if st.terms[5]:
                failing_keys.append(key)
        object.__setattr__(self, "failing_candidates", frozenset(failing_keys))
        object.__setattr__(self, "provider_totals", MappingProxyType(totals))
        failing = frozenset(p for p, (n, s) in totals.items() if n >= FAILING_MIN_SAMPLES and s == 0)
        object.__setattr__(self, "failing_providers", failing)
        health = {p: smoothed_success(n, s) for p, (n, s) in totals.items()}
        object.__setattr__(self, "provider_health", MappingProxyType(health))
        object.__setattr__(self, "health", health)

    def get(self, provider: str, model: str) -> CandidateStats:
        return self.stats.get((provider, model), EMPTY_STATS)
