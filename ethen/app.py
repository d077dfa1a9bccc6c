"""The composition module: the one place the gateway's HTTP app and the operator's surfaces meet.

:func:`create_app` builds the gateway app (:func:`ethen.gateway.api.app.gateway_app`: the OpenAI-compatible
API under ``/api/gateway/v1`` and ``/v1``, ``/healthz``, ``/metrics``) and mounts the admin's routes on it
(:func:`ethen.admin.surface.admin_surface`: ``/api/admin/v1``, ``/ui``, ``/favicon.ico``). ``ethen gateway``
(:mod:`ethen.gateway_cli`) and ``ethen up`` serve this app; nothing under ``ethen.gateway`` imports
``ethen.admin``.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.applications import Starlette

from ethen.admin.surface import admin_surface
from ethen.gateway.api.app import PREFIX, gateway_app
from ethen.gateway.catalog import Catalog
from ethen.gateway.config import GatewayConfig
from ethen.gateway.observation.telemetry_store import TelemetryStore
from ethen.gateway.providers.base import Provider

__all__ = ["PREFIX", "create_app"]


def create_app(
    cfg: GatewayConfig,
    *,
    env: Mapping[str, str] | None = None,
    catalog: Catalog | None = None,
    providers: Mapping[str, Provider] | None = None,
    store: TelemetryStore | None = None,
) -> Starlette:
    """The gateway app with the admin API and the dashboard mounted (arguments as
    :func:`~ethen.gateway.api.app.gateway_app`'s)."""
    return gateway_app(cfg, env=env, catalog=catalog, providers=providers, store=store, surface=admin_surface)
