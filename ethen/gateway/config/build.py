"""Turning a parsed config into the routing core's inputs: the candidate pool, the policy, the canaries."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from functools import lru_cache
from typing import Any

from ethen.gateway.catalog import Catalog
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.routing import CanaryTarget, Candidate, ProjectPolicy

from .routes import RouteConfig
from .schema import GatewayConfig

__all__ = [
    "build_canaries",
    "build_candidate",
    "build_policy",
    "build_pool",
    "cache_read_ratio",
]


#: a provider kind -> its genai-prices provider id (the exact price of an answer:
# ``ethen.gateway.accounting.pricing``)
PRICE_PROVIDER = {"anthropic": "anthropic", "gemini": "google", "azure_openai": "azure"}


@lru_cache(maxsize=512)
def cache_read_ratio(price_ref: tuple[tuple[str, ...], str]) -> float:
    """genai-prices' cache-read price over its input price for the model (base tier), for the first provider
    id that knows it; 1.0 (no discount) when none does or it lists no cache-read price."""
    from genai_prices import data_snapshot  # heavy: loaded once, when a config is built

    providers, model_ref = price_ref
    snapshot = data_snapshot.get_snapshot()
    for provider in providers:
        try:
            _, model = snapshot.find_provider_model(model_ref, None, provider, None)
        except LookupError:
            continue
        price = model.get_prices(datetime.now(UTC))
        read, inp = _base(getattr(price, "cache_read_mtok", None)), _base(getattr(price, "input_mtok", None))
        if read is None or inp is None or inp <= 0:
            return 1.0
        return min(1.0, max(0.0, read / inp))
    return 1.0


def _base(price: object) -> float | None:
    """A genai-prices per-Mtok price (a number or tiered prices: the base tier) as a float."""
    base = getattr(price, "base", price)
    return float(base) if isinstance(base, int | float | Decimal) else None


def build_candidate(
    i: int, route: RouteConfig, catalog: Catalog, catalog_provider: str | None = None, kind: str | None = None
) -> Candidate:
    """Join one route profile with the catalog's model intelligence and prices; config overrides win.
    The catalog provider is the route's ``catalog_provider``, else ``catalog_provider``, else its provider."""
    overrides: dict[str, Any] = {k: v for k, v in route.info.model_dump().items() if v is not None}
    overrides.update({k: v for k, v in route.prices.model_dump().items() if v is not None})
    try:
        entry = catalog.entry(
            route.catalog_provider or catalog_provider or route.provider,
            route.model,
            lookup_model=route.catalog_id,
            overrides=overrides,
        )
        tried = [p for p in (route.catalog_provider, route.provider, PRICE_PROVIDER.get(kind or "")) if p]
        price_ref = None if kind == "mesh" else (tuple(dict.fromkeys(tried)), route.catalog_id)
        ratio = cache_read_ratio(price_ref) if price_ref is not None else 1.0
        return Candidate(route.provider, route.model, entry.info, entry.prices, price_ref=price_ref,
                         cache_read_ratio=ratio)
    except (GatewayConfigError, ValueError) as exc:
        msg = exc.message if isinstance(exc, GatewayConfigError) else str(exc)
        raise GatewayConfigError(f"routes[{i}] ({route.provider}/{route.model}): {msg}") from None


def build_pool(cfg: GatewayConfig, catalog: Catalog | None = None) -> tuple[Candidate, ...]:
    """The candidate pool of every configured route. Without a catalog, every route must set its limits and
    prices in ``[routes.info]`` / ``[routes.prices]`` (the tests do that to stay hermetic)."""
    cat = catalog if catalog is not None else Catalog({}, use_genai_prices=False)
    kinds = {p.id: p.kind for p in cfg.providers}
    return tuple(
        build_candidate(i, r, cat, "mesh" if kinds.get(r.provider) == "mesh" else None, kinds.get(r.provider))
        for i, r in enumerate(cfg.routes)
        if r.endpoint == "chat"  # an embeddings route never serves a chat request
    )


def build_policy(cfg: GatewayConfig) -> ProjectPolicy:
    p = cfg.policy
    return ProjectPolicy(
        allowed_providers=frozenset(p.allowed_providers) if p.allowed_providers is not None else None,
        allowed_models=frozenset(p.allowed_models) if p.allowed_models is not None else None,
        remaining_budget_usd=p.remaining_budget_usd,
    )


def build_canaries(cfg: GatewayConfig) -> tuple[CanaryTarget, ...]:
    return tuple(
        CanaryTarget(c.alias, c.candidate, c.percent, c.min_success_rate, c.min_samples) for c in cfg.canaries
    )
