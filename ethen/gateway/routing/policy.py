"""The versioned routing policy ``ethen.routing-policy.v1``, kept as data.

Each ``ethen/*`` alias maps to an :class:`AliasProfile`: a weight per score component and the alias's hard
gates. Nothing in the pipeline branches on an alias name; it reads these records.

Choices where the spec is silent (all part of v1, change them only with a new version):

* Weights of each profile sum to 1 (checked at import), so a total score is in [0, 1].
* ``ethen/reasoning`` prefers reasoning models through its score: its quality component is multiplied by
  ``non_reasoning_quality_factor`` (0.6) for a model without reasoning metadata; no gate.
* ``ethen/cheap`` is "cost dominant, subject to minimum quality/reliability": cost carries the largest
  weight and quality/reliability still weigh 0.15/0.15, so a cheap but unreliable model loses to a cheap
  reliable one. There is no hard quality floor (the spec lists no gate for it).
* ``metadata.routing.latency_target`` accepts ``"fast"``, ``"balanced"`` (the default, no change) and
  ``"relaxed"``. It multiplies the latency and TTFT weights by the factor in :data:`LATENCY_TARGETS` (2.0,
  1.0, 0.5) and renormalizes all weights to sum 1. Deterministic: same profile and target, same weights.
* "64K" and "128K" in the alias gates are decimal (64,000 and 128,000 tokens): that is how providers
  advertise windows (OpenAI's "128K" models have exactly 128,000), so every model sold as 64K/128K passes,
  including the binary 65,536/131,072 ones. A stricter binary reading would drop e.g. ``gpt-4o`` from
  ``ethen/long-context``.
* A concrete (non-alias) model id is ranked with the ``ethen/auto`` profile and no alias gate.
* Component scales (hyperbolic ``ref / (ref + x)`` maps to [0, 1]): latency ref 2,000 ms, TTFT ref 500 ms,
  cost ref 1 USD per million tokens of the request's own input/output mix; context is log-scaled between 4K
  (0) and 1M tokens (1).
* The default output length used for the cost estimate when the request gives no max output is
  ``min(DEFAULT_MAX_OUTPUT_TOKENS, candidate max output)`` with ``DEFAULT_MAX_OUTPUT_TOKENS = 4096``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from ethen.aliases import ALIAS_NAMES, AUTO_ALIAS

__all__ = [
    "ALIASES",
    "AUTO_ALIAS",
    "COMPONENTS",
    "CONCRETE_PROFILE",
    "CONTEXT_MAX_TOKENS",
    "CONTEXT_MIN_TOKENS",
    "COST_REF_USD_PER_MTOK",
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "FAILING_MIN_SAMPLES",
    "FAILING_STREAK",
    "LATENCY_REF_MS",
    "LATENCY_TARGETS",
    "POLICY_VERSION",
    "TTFT_REF_MS",
    "AliasProfile",
    "HardGates",
    "context_score",
    "weights_for",
]

POLICY_VERSION: Final = "ethen.routing-policy.v1"

#: Score components, in the order used everywhere (weights, ScoreComponents, receipts).
COMPONENTS: Final = ("quality", "cost", "latency", "ttft", "reliability", "health", "context", "tools")

DEFAULT_MAX_OUTPUT_TOKENS: Final = 4096
LATENCY_REF_MS: Final = 2000.0
TTFT_REF_MS: Final = 500.0
COST_REF_USD_PER_MTOK: Final = 1.0
CONTEXT_MIN_TOKENS: Final = 4096
CONTEXT_MAX_TOKENS: Final = 1_048_576
#: A provider (or candidate) with 0 successes over at least this many recent samples is excluded.
FAILING_MIN_SAMPLES: Final = 3
#: A candidate whose last this-many recent outcomes all failed is excluded too, whatever came before them
#: (issue 42: earlier successes no longer keep a provider that went down out of its circuit).
FAILING_STREAK: Final = 3

_LOG_CTX_MIN: Final = math.log(CONTEXT_MIN_TOKENS)
_LOG_CTX_SPAN: Final = math.log(CONTEXT_MAX_TOKENS) - _LOG_CTX_MIN


def context_score(window: int) -> float:
    """Context component: log-scaled window, CONTEXT_MIN_TOKENS -> 0, CONTEXT_MAX_TOKENS -> 1."""
    if window <= CONTEXT_MIN_TOKENS:
        return 0.0
    return min(1.0, (math.log(window) - _LOG_CTX_MIN) / _LOG_CTX_SPAN)


#: latency_target value -> multiplier of the latency and TTFT weights (then renormalized).
LATENCY_TARGETS: Final = MappingProxyType({"fast": 2.0, "balanced": 1.0, "relaxed": 0.5})


@dataclass(frozen=True, slots=True)
class HardGates:
    """Non-negotiable capabilities implied by an alias name."""

    tools: bool = False
    vision: bool = False
    min_context: int = 0


@dataclass(frozen=True, slots=True)
class AliasProfile:
    """One alias of the policy: weights in :data:`COMPONENTS` order, gates, and the reasoning preference."""

    alias: str
    weights: tuple[float, float, float, float, float, float, float, float]
    gates: HardGates = HardGates()
    non_reasoning_quality_factor: float = 1.0

    def __post_init__(self) -> None:
        if len(self.weights) != len(COMPONENTS) or any(w < 0 for w in self.weights):
            raise ValueError(f"{self.alias}: weights must be {len(COMPONENTS)} non-negative numbers")
        if not math.isclose(sum(self.weights), 1.0, abs_tol=1e-9):
            raise ValueError(f"{self.alias}: weights sum to {sum(self.weights)}, not 1")


def _p(
    alias: str,
    quality: float,
    cost: float,
    latency: float,
    ttft: float,
    reliability: float,
    health: float,
    context: float,
    tools: float,
    gates: HardGates = HardGates(),
    non_reasoning_quality_factor: float = 1.0,
) -> AliasProfile:
    return AliasProfile(
        alias,
        (quality, cost, latency, ttft, reliability, health, context, tools),
        gates,
        non_reasoning_quality_factor,
    )


#: alias -> profile. The eight aliases of the spec.
#                     quality cost  lat   ttft  rel   health ctx  tools
ALIASES: Final = MappingProxyType(
    {
        "ethen/auto": _p("ethen/auto", 0.25, 0.20, 0.15, 0.10, 0.15, 0.10, 0.025, 0.025),
        "ethen/fast": _p("ethen/fast", 0.10, 0.05, 0.30, 0.30, 0.10, 0.10, 0.025, 0.025),
        "ethen/best": _p("ethen/best", 0.50, 0.00, 0.05, 0.05, 0.20, 0.15, 0.025, 0.025),
        "ethen/cheap": _p("ethen/cheap", 0.15, 0.50, 0.05, 0.05, 0.15, 0.10, 0.00, 0.00),
        "ethen/reasoning": _p(
            "ethen/reasoning", 0.50, 0.05, 0.05, 0.00, 0.20, 0.15, 0.05, 0.00,
            non_reasoning_quality_factor=0.6,
        ),
        "ethen/coding": _p(
            "ethen/coding", 0.35, 0.10, 0.10, 0.05, 0.15, 0.10, 0.05, 0.10,
            gates=HardGates(tools=True, min_context=64_000),
        ),
        "ethen/vision": _p(
            "ethen/vision", 0.30, 0.15, 0.15, 0.10, 0.15, 0.10, 0.05, 0.00, gates=HardGates(vision=True)
        ),
        "ethen/long-context": _p(
            "ethen/long-context", 0.25, 0.15, 0.10, 0.05, 0.15, 0.10, 0.20, 0.00,
            gates=HardGates(min_context=128_000),
        ),
    }
)

assert tuple(ALIASES) == ALIAS_NAMES, "ethen.aliases.ALIAS_NAMES names the profiles, in order"
#: Profile used for a concrete model id: the ``ethen/auto`` weights, no alias gate.
CONCRETE_PROFILE: Final = ALIASES[AUTO_ALIAS]

_WEIGHTS_CACHE: dict[tuple[str, str | None], tuple[AliasProfile, tuple[float, ...]]] = {}


def weights_for(profile: AliasProfile, latency_target: str | None) -> tuple[float, ...]:
    """The profile's weights shifted by ``latency_target`` (validated by the requirements parser)."""
    key = (profile.alias, latency_target)  # str keys hash fast; the identity check guards other profiles
    cached = _WEIGHTS_CACHE.get(key)
    if cached is not None and cached[0] is profile:
        return cached[1]
    factor = 1.0 if latency_target is None else LATENCY_TARGETS[latency_target]
    raw = [
        w * factor if name in ("latency", "ttft") else w
        for name, w in zip(COMPONENTS, profile.weights, strict=True)
    ]
    total = sum(raw)
    shifted = tuple(w / total for w in raw) if total > 0 else tuple(profile.weights)
    _WEIGHTS_CACHE[key] = (profile, shifted)
    return shifted
