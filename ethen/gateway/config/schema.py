"""The gateway config's root model: :class:`GatewayConfig`, one field per TOML section (see
:mod:`ethen.gateway.config` for the file's shape). The sections' models are in :mod:`.server`,
:mod:`.providers`, :mod:`.routes`, :mod:`.accounts` and :mod:`.services`; parsing, cross-checks and secrets
are in :mod:`.load`; turning the config into the routing core's inputs in :mod:`.build`."""

from __future__ import annotations

from pydantic import Field

from .accounts import ApiKeyConfig, PolicyConfig, RateLimitsConfig, StoreConfig
from .base import _NonEmpty, _Strict
from .providers import AnyProviderConfig, MeshProviderConfig, ProviderConfig
from .routes import CanaryConfig, HedgeConfig, RouteConfig, ShadowConfig, WaitTargetConfig
from .server import ServerConfig
from .services import (
    CacheConfig,
    CircuitConfig,
    CompatConfig,
    LogConfig,
    OtelConfig,
    PromptCacheConfig,
    SharedConfig,
)

__all__ = ["GatewayConfig"]


class GatewayConfig(_Strict):
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    providers: list[AnyProviderConfig] = Field(min_length=1)
    routes: list[RouteConfig] = Field(min_length=1)
    api_keys: list[ApiKeyConfig]
    canaries: list[CanaryConfig] = Field(default_factory=list)
    hedges: list[HedgeConfig] = Field(default_factory=list)  # issue 27
    wait_targets: list[WaitTargetConfig] = Field(default_factory=list)  # issue 44
    shadows: list[ShadowConfig] = Field(default_factory=list)  # issue 27: shadow evaluation
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig())
    store: StoreConfig | None = None
    circuit: CircuitConfig = Field(default_factory=lambda: CircuitConfig())
    shared: SharedConfig | None = None
    rate_limits: RateLimitsConfig = Field(default_factory=lambda: RateLimitsConfig())
    log: LogConfig = Field(default_factory=lambda: LogConfig())
    otel: OtelConfig = Field(default_factory=lambda: OtelConfig())
    #: model name glob (fnmatch) -> alias or route, first match in file order (ethen.gateway.api.messages)
    model_map: dict[_NonEmpty, _NonEmpty] = Field(default_factory=dict)
    compat: CompatConfig = Field(default_factory=lambda: CompatConfig())
    cache: CacheConfig = Field(default_factory=lambda: CacheConfig())  # issue 27: ethen.gateway.cache
    prompt_cache: PromptCacheConfig = Field(default_factory=lambda: PromptCacheConfig())  # issue 45

    def provider(self, provider_id: str) -> ProviderConfig | MeshProviderConfig:
        for p in self.providers:
            if p.id == provider_id:
                return p
        raise KeyError(provider_id)
