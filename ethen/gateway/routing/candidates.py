"""Candidate pool types: what the shell hands the core about each routable (provider, model).

A :class:`Candidate` is a route profile joined with model intelligence (:class:`ModelInfo`) and per-token
prices (:class:`Prices`). Endpoints and credentials stay in the shell's route profile: the core never sees
them, so no decision or receipt can leak them.

Also here: the effective :class:`ProjectPolicy` and the :class:`CanaryTarget` records. All are frozen and
validated on construction (a bad value raises ``ValueError`` naming the field), so the hot path does not
re-check them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from .policy import DEFAULT_MAX_OUTPUT_TOKENS, context_score

__all__ = [
    "CANARY_PERCENTS",
    "CAP_STRUCTURED",
    "CAP_TOOLS",
    "CAP_VISION",
    "CanaryTarget",
    "Candidate",
    "LiveCertification",
    "ModelInfo",
    "Prices",
    "ProjectPolicy",
]

#: Capability bits of ``Candidate.caps`` (a request's needs are checked with one mask test).
CAP_TOOLS = 1
CAP_VISION = 2
CAP_STRUCTURED = 4

#: The rollout steps the spec allows for a canary target.
CANARY_PERCENTS = (0, 1, 5, 20, 50, 100)


def _unit(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _nonneg(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _posint(name: str, value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Model intelligence: capabilities, limits and priors (quality in [0, 1], latencies in ms)."""

    context_window: int
    max_output_tokens: int
    supports_tools: bool = False
    supports_vision: bool = False
    supports_structured_output: bool = False
    supports_reasoning: bool = False
    quality: float = 0.5
    latency_ms: float = 2000.0
    ttft_ms: float = 500.0

    def __post_init__(self) -> None:
        _posint("context_window", self.context_window)
        _posint("max_output_tokens", self.max_output_tokens)
        _unit("quality", self.quality)
        _nonneg("latency_ms", self.latency_ms)
        _nonneg("ttft_ms", self.ttft_ms)


@dataclass(frozen=True, slots=True)
class Prices:
    """Per-token prices in USD per million tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        _nonneg("input_per_mtok", self.input_per_mtok)
        _nonneg("output_per_mtok", self.output_per_mtok)


@dataclass(frozen=True, slots=True)
class LiveCertification:
    """A dated live-certification receipt for one candidate; valid on ``[valid_from, valid_until)``.
    Datetimes must be timezone-aware."""

    receipt_id: str
    valid_from: datetime
    valid_until: datetime

    def __post_init__(self) -> None:
        if self.valid_from.tzinfo is None or self.valid_until.tzinfo is None:
            raise ValueError("LiveCertification datetimes must be timezone-aware")

    def valid_at(self, now: datetime) -> bool:
        return self.valid_from <= now < self.valid_until


@dataclass(frozen=True, slots=True)
class Candidate:
    """One routable (provider, model). ``model`` is the gateway-visible model id; ``id`` is
    ``f"{provider}/{model}"``.

    Request-independent data the scorer needs is precomputed once here (the pool is built once per config
    and reused for every request): ``default_output_tokens`` (output length used for the cost estimate when
    the request sets none), ``context_score`` and ``tools_score`` components, the telemetry ``key``
    ``(provider, model)`` and the capability bit mask ``caps``.
    """

    provider: str
    model: str
    info: ModelInfo
    prices: Prices
    certification: LiveCertification | None = None
    #: how an answer is priced (``ethen.gateway.accounting.pricing``): the genai-prices provider ids to try
    # and the model
    #: reference; ``None``: by ``prices`` only. Data only: routing never reads it.
    price_ref: tuple[tuple[str, ...], str] | None = field(default=None, compare=False, repr=False)
    #: the cache-read price as a share of the input price (genai-prices' ``cache_read_mtok / input_mtok``;
    #: 1.0: unknown, no discount). The scorer prices a request's expected cached tokens with it.
    cache_read_ratio: float = field(default=1.0, compare=False, repr=False)
    id: str = field(init=False, compare=False, repr=False)
    default_output_tokens: int = field(init=False, compare=False, repr=False)
    context_score: float = field(init=False, compare=False, repr=False)
    tools_score: float = field(init=False, compare=False, repr=False)
    key: tuple[str, str] = field(init=False, compare=False, repr=False)
    caps: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.provider or "/" in self.provider:
            raise ValueError(f"provider must be a non-empty id without '/', got {self.provider!r}")
        if not self.model:
            raise ValueError("model must be non-empty")
        if not 0.0 <= self.cache_read_ratio <= 1.0:
            raise ValueError(f"cache_read_ratio must be in [0, 1], got {self.cache_read_ratio!r}")
        object.__setattr__(self, "id", f"{self.provider}/{self.model}")
        info = self.info
        default_out = min(DEFAULT_MAX_OUTPUT_TOKENS, info.max_output_tokens)
        object.__setattr__(self, "default_output_tokens", default_out)
        object.__setattr__(self, "context_score", context_score(info.context_window))
        tools = (float(info.supports_tools) + float(info.supports_structured_output)) / 2.0
        object.__setattr__(self, "tools_score", tools)
        object.__setattr__(self, "key", (self.provider, self.model))
        caps = (
            (CAP_TOOLS if info.supports_tools else 0)
            | (CAP_VISION if info.supports_vision else 0)
            | (CAP_STRUCTURED if info.supports_structured_output else 0)
        )
        object.__setattr__(self, "caps", caps)


@dataclass(frozen=True, slots=True)
class ProjectPolicy:
    """The effective project policy. ``None`` means "no restriction" / "no window budget".

    ``allowed_models`` entries match either a candidate's ``model`` or its ``id`` (``provider/model``).
    ``remaining_budget_usd`` is the project's remaining window budget: a candidate whose estimated request
    cost exceeds it is rejected (``over_project_budget``).
    """

    allowed_providers: frozenset[str] | None = None
    allowed_models: frozenset[str] | None = None
    remaining_budget_usd: float | None = None

    def __post_init__(self) -> None:
        if self.remaining_budget_usd is not None:
            _nonneg("remaining_budget_usd", self.remaining_budget_usd)


@dataclass(frozen=True, slots=True)
class CanaryTarget:
    """A bounded rollout: for requests to ``alias`` whose bucket is below ``percent``, ``candidate`` (a
    candidate id, ``provider/model``) is promoted to rank 1 if it passed the filter. ``min_success_rate`` and
    ``min_samples`` are the acceptance criteria, measured from telemetry and reported on the receipt."""

    alias: str
    candidate: str
    percent: int
    min_success_rate: float = 0.95
    min_samples: int = 20

    def __post_init__(self) -> None:
        if self.percent not in CANARY_PERCENTS or isinstance(self.percent, bool):
            raise ValueError(f"percent must be one of {CANARY_PERCENTS}, got {self.percent!r}")
        _unit("min_success_rate", self.min_success_rate)
        n = self.min_samples
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"min_samples must be an integer >= 0, got {self.min_samples!r}")
