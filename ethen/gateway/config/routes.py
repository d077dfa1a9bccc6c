"""The ``[[routes]]``, ``[[canaries]]``, ``[[hedges]]``, ``[[wait_targets]]`` and ``[[shadows]]`` sections:
which provider model a gateway model name is (with catalog overrides), and how an alias's traffic is tried
on candidates (canary split, hedging, wait target, shadow evaluation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from .base import _float, _Strict

__all__ = [
    "CanaryConfig",
    "HedgeConfig",
    "InfoOverrides",
    "PricesOverrides",
    "RouteConfig",
    "ShadowConfig",
    "WaitTargetConfig",
]


class InfoOverrides(_Strict):
    """Any :class:`~ethen.gateway.routing.ModelInfo` field; unset fields come from the catalog."""

    context_window: int | None = Field(default=None, gt=0)
    max_output_tokens: int | None = Field(default=None, gt=0)
    supports_tools: bool | None = None
    supports_vision: bool | None = None
    supports_structured_output: bool | None = None
    supports_reasoning: bool | None = None
    quality: float | None = Field(default=None, ge=0, le=1)
    latency_ms: float | None = Field(default=None, ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)

    @field_validator("quality", "latency_ms", "ttft_ms", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class PricesOverrides(_Strict):
    input_per_mtok: float | None = Field(default=None, ge=0)
    output_per_mtok: float | None = Field(default=None, ge=0)

    @field_validator("input_per_mtok", "output_per_mtok", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class RouteConfig(_Strict):
    model: str = Field(min_length=1, max_length=200, pattern=r"^[^\s]+$")
    provider: str
    upstream_model: str | None = None
    catalog_model: str | None = None
    catalog_provider: str | None = None
    endpoint: Literal["chat", "embeddings"] = "chat"  # embeddings routes: ethen.gateway.api.embeddings only
    info: InfoOverrides = Field(default_factory=lambda: InfoOverrides())
    prices: PricesOverrides = Field(default_factory=lambda: PricesOverrides())

    @property
    def upstream(self) -> str:
        return self.upstream_model or self.model

    @property
    def catalog_id(self) -> str:
        return self.catalog_model or self.upstream

class CanaryConfig(_Strict):
    alias: str = Field(pattern=r"^ethen/")
    candidate: str = Field(pattern=r"^[^/]+/.+$")
    percent: int
    # The spec spells these minSuccessRate / minSamples; TOML style is snake_case. Both are accepted.
    min_success_rate: float = Field(
        default=0.95, ge=0, le=1, validation_alias=AliasChoices("min_success_rate", "minSuccessRate")
    )
    min_samples: int = Field(default=20, ge=0, validation_alias=AliasChoices("min_samples", "minSamples"))

    @field_validator("min_success_rate", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("percent")
    @classmethod
    def _percent(cls, v: int) -> int:
        if v not in (0, 1, 5, 20, 50, 100):
            raise ValueError("must be one of 0, 1, 5, 20, 50, 100")
        return v


class HedgeConfig(_Strict):
    """``[[hedges]]`` (issue 27): hedge requests to ``alias`` after a delay (``ethen.gateway.routing.hedge``,
    ``ethen.gateway.api.hedging``)."""

    alias: str = Field(pattern=r"^ethen/")
    after_ms: float | None = Field(default=None, gt=0, le=600_000)
    after_percentile: int | None = Field(default=None, ge=1, le=100)
    min_samples: int = Field(default=20, ge=1, le=10_000)
    max_extra: int = Field(default=1, ge=0, le=4)

    @model_validator(mode="after")
    def _one_delay(self) -> HedgeConfig:
        if (self.after_ms is None) == (self.after_percentile is None):
            raise ValueError("set exactly one of after_ms and after_percentile")
        return self


class WaitTargetConfig(_Strict):
    """``[[wait_targets]]`` (issue 44): requests to ``alias`` want their first token within ``max_wait_ms``;
    a candidate whose predicted wait exceeds it is rejected (``ethen.gateway.routing.capacity``)."""

    alias: str = Field(pattern=r"^ethen/")
    max_wait_ms: float = Field(gt=0, le=600_000)

    @field_validator("max_wait_ms", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class ShadowConfig(_Strict):
    """``[[shadows]]`` (issue 27): send ``percent`` % of the requests to ``alias`` also to ``candidate``
    (``provider/model``), paid by ``project``'s budget, at most ``max_in_flight`` at once; the recorded pairs
    (``ethen.store.shadows``) gate its promotion to a canary by ``min_success_rate`` / ``min_samples``
    (``ethen.gateway.routing.shadow``, ``ethen.gateway.api.shadow``)."""

    alias: str = Field(pattern=r"^ethen/")
    candidate: str = Field(pattern=r"^[^/]+/.+$")
    percent: float = Field(ge=0, le=100)
    project: str = Field(min_length=1, max_length=100)
    max_in_flight: int = Field(default=8, ge=1, le=10_000)
    min_success_rate: float = Field(default=0.95, ge=0, le=1)
    min_samples: int = Field(default=20, ge=0, le=10_000_000)

    @field_validator("percent", "min_success_rate", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)
