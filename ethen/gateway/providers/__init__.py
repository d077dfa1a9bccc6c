"""Gateway providers: one interface (:mod:`.base`), one module per upstream API, and the one registry that
maps a config ``kind`` to the code that builds it (:data:`PROVIDER_KINDS`, :func:`build_providers`).

The mesh module (NumPy, gRPC) is imported only when a config declares a ``kind = "mesh"`` provider.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ethen.gateway.config import GatewayConfig, resolve_secret, shared_redis_url, store_url

from .anthropic import AnthropicProvider
from .anthropic_native import NativeAnthropicProvider
from .azure import AzureOpenAIProvider
from .base import Completion, Provider, ProviderStream, Timeouts, UpstreamCall, Usage
from .gemini import GeminiProvider
from .http import HttpProvider
from .openai_compat import OpenAICompatProvider

__all__ = [
    "PROVIDER_KINDS",
    "AnthropicProvider",
    "AzureOpenAIProvider",
    "Completion",
    "GeminiProvider",
    "OpenAICompatProvider",
    "Provider",
    "ProviderStream",
    "Timeouts",
    "UpstreamCall",
    "Usage",
    "build_provider",
    "build_providers",
]

#: ``(provider config, environment) -> Provider``; the config is the ``[[providers]]`` entry of that kind.
ProviderFactory = Callable[[Any, Mapping[str, str] | None], Provider]


def _timeouts(p: Any) -> Timeouts:
    t = p.timeouts
    return Timeouts(connect=t.connect_s, first_byte=t.first_byte_s, total=t.total_s)


def _openai_compat(p: Any, env: Mapping[str, str] | None) -> Provider:
    return OpenAICompatProvider(p.id, p.base_url, resolve_secret(p, env), timeouts=_timeouts(p),
                                max_connections=p.max_connections, headers=p.headers)


def _anthropic(p: Any, env: Mapping[str, str] | None) -> Provider:
    return NativeAnthropicProvider(p.id, p.base_url, resolve_secret(p, env), timeouts=_timeouts(p),
                                   max_connections=p.max_connections, headers=p.headers)  # + Messages native


def _gemini(p: Any, env: Mapping[str, str] | None) -> Provider:
    return GeminiProvider(p.id, p.base_url, resolve_secret(p, env), timeouts=_timeouts(p),
                          max_connections=p.max_connections, headers=p.headers)


def _azure_openai(p: Any, env: Mapping[str, str] | None) -> Provider:
    return AzureOpenAIProvider(p.id, p.base_url, resolve_secret(p, env), api_version=p.api_version,
                               timeouts=_timeouts(p), max_connections=p.max_connections, headers=p.headers)


def _mesh(p: Any, env: Mapping[str, str] | None, cfg: GatewayConfig | None = None) -> Provider:
    from .mesh import MeshProvider

    if cfg is None or p.join is None or (cfg.shared is None and cfg.store is None):
        return MeshProvider.from_config(p)
    if cfg.shared is None:  # no Redis: joined workers are shared through the gateway's [store]
        return MeshProvider.from_config(p, store_url=store_url(cfg, env))
    # joined workers are shared through [shared] Redis
    return MeshProvider.from_config(p, redis_url=shared_redis_url(cfg, env), key_prefix=cfg.shared.key_prefix,
                                    redis_timeout_s=cfg.shared.timeout_s)


PROVIDER_KINDS: Mapping[str, ProviderFactory] = {
    "openai_compat": _openai_compat,
    "anthropic": _anthropic,
    "gemini": _gemini,
    "azure_openai": _azure_openai,
    "mesh": _mesh,
}


def build_provider(p: Any, env: Mapping[str, str] | None = None) -> Provider:
    """The provider of one ``[[providers]]`` entry (secrets from ``env``, default ``os.environ``)."""
    return PROVIDER_KINDS[p.kind](p, env)


def build_providers(cfg: GatewayConfig, env: Mapping[str, str] | None = None) -> dict[str, Provider]:
    """One provider instance (one pooled client, or one mesh orchestrator) per configured provider. Nothing is
    connected or loaded yet: the gateway's lifespan calls :meth:`Provider.start`."""
    out = {p.id: _mesh(p, env, cfg) if p.kind == "mesh" else build_provider(p, env) for p in cfg.providers}
    for provider in out.values():
        if isinstance(provider, HttpProvider):
            provider.auto_breakpoints = cfg.prompt_cache.auto_breakpoints
    return out
