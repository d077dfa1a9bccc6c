"""The sections of the services around the request path: ``[circuit]`` (half-open recovery), ``[shared]``
(Redis shared by instances), ``[log]`` (the request log), ``[otel]`` (traces), ``[compat]``, ``[cache]`` (the
response cache) and ``[prompt_cache]`` (provider prompt caching)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .base import _float, _NonEmpty, _Strict

__all__ = [
    "CacheConfig",
    "CircuitConfig",
    "CompatConfig",
    "LogConfig",
    "OtelConfig",
    "PromptCacheConfig",
    "SharedConfig",
]


class CircuitConfig(_Strict):
    """Half-open recovery (``ethen.gateway.circuit``): the first trial ``cooldown_s`` after a circuit opens,
    the cool-down doubling on each failed trial up to ``max_cooldown_s``; ``probe``: send 1-token probes
    through half-open circuits (else only live requests with no healthy alternative are trials)."""

    cooldown_s: float = Field(default=2.0, gt=0, le=300)
    max_cooldown_s: float = Field(default=10.0, gt=0, le=300)
    probe: bool = True

    @field_validator("cooldown_s", "max_cooldown_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class SharedConfig(_Strict):
    """Redis for the state several gateway instances share (``ethen.gateway.shared``): ``redis_url``
    (``redis://``, ``rediss://`` or ``unix://``) or ``redis_url_env`` naming the variable that holds it (use
    it when the URL has a password). ``key_prefix`` namespaces the keys (gateways of separate deployments may
    share one Redis); ``timeout_s`` bounds each Redis call (a rate-limited request waits at most that long
    when Redis hangs, then gets 503)."""

    redis_url: str | None = Field(default=None, pattern=r"^(rediss?|unix)://\S+$")
    redis_url_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    key_prefix: str = Field(default="ethen", pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    timeout_s: float = Field(default=0.5, gt=0, le=30)

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)

class LogConfig(_Strict):
    """The request log (``ethen.gateway.observation.requestlog``): kept in the store (``retention_days``,
    ``max_rows``;
    pruned at start and every ``prune_interval_s``), else in a memory ring of the last ``memory_rows``.
    ``queue_size`` bounds the records waiting for the writer (past it a record is dropped and counted).
    ``admin_key_sha256`` opens ``/api/admin/v1/requests`` on a gateway without a ``[store]``."""

    retention_days: float = Field(default=30.0, gt=0, le=36_500)
    max_rows: int | None = Field(default=1_000_000, ge=1)
    memory_rows: int = Field(default=10_000, ge=1, le=10_000_000)
    queue_size: int = Field(default=10_000, ge=1, le=10_000_000)
    prune_interval_s: float = Field(default=600.0, gt=0)
    admin_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("retention_days", "prune_interval_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class OtelConfig(_Strict):
    """OpenTelemetry traces (``ethen.gateway.observation.tracing``), exported over OTLP/HTTP to ``endpoint``
    (e.g. ``http://localhost:4318/v1/traces``); unset: no tracing at all."""

    endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$")
    service_name: str = Field(default="ethen-gateway", min_length=1, max_length=200)

class CompatConfig(_Strict):
    """What the gateway does with client requests it can only serve in part. ``drop_unsupported_tools``
    (true): a Responses request's hosted tools no candidate can run (``web_search``, ``file_search``...) are
    left out and named in the answer (``x-ethen-dropped-tools``, ``ethen.routing.dropped_tools``); false: such
    a request is a 400 ``unsupported_value`` naming the tool (``ethen.gateway.api.responses_tools``)."""

    drop_unsupported_tools: bool = True


class CacheConfig(_Strict):
    """The response cache (issue 27, ``ethen.gateway.cache``): off unless ``enabled``. ``ttl_s``: how long an
    answer is served; ``max_entries``: the memory backend's LRU bound; ``backend``: ``"memory"`` (per
    process) or ``"redis"`` (the ``[shared]`` Redis, shared by every instance). Opt-in: ``aliases`` (alias
    names) and ``routes`` (route models or ``provider/model`` ids, as clients name them); with neither set
    every model is cached. ``cache_nondeterministic``: cache requests without ``temperature = 0`` or a
    ``seed`` too."""

    enabled: bool = False
    ttl_s: float = Field(default=300.0, gt=0, le=30 * 86_400)
    max_entries: int = Field(default=10_000, ge=1, le=10_000_000)
    backend: Literal["memory", "redis"] = "memory"
    cache_nondeterministic: bool = False
    aliases: list[_NonEmpty] | None = None
    routes: list[_NonEmpty] | None = None

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class PromptCacheConfig(_Strict):
    """Provider prompt caching (issue 45, ``ethen.gateway.providers.prompt_cache``). ``auto_breakpoints``
    (true): a request to a ``kind = "anthropic"`` provider that carries no ``cache_control`` gets breakpoints
    where Anthropic's guide puts them, and a request to an OpenAI-compatible provider without a
    ``prompt_cache_key`` gets one derived from its leading messages, and a request to a ``kind = "gemini"``
    provider carrying the client's breakpoints gets its prefix in a context cache
    (``ethen.gateway.providers.gemini_cache``); false: requests go as the client sent them.
    ``cache_aware_routing`` (true): the cost component prices a candidate's expected cached prompt
    tokens at its cache-read price (``ethen.gateway.api.prompt_memory``); false: every candidate uncached."""

    auto_breakpoints: bool = True
    cache_aware_routing: bool = True
