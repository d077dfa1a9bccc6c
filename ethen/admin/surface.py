"""The operator's surfaces of one gateway, as one mountable piece: the admin API (``/api/admin/v1``:
projects, keys, usage, certifications; shadows), the request-log API and ``/health``, the ``/ui`` dashboard
with its ``/favicon.ico`` and the ``observe/*`` data, and the dashboard sessions they share
(:class:`AdminAuth`).

:func:`admin_surface` builds it from a built :class:`~ethen.gateway.state.Gateway`; the composition module
(:func:`ethen.app.create_app`) hands it to :func:`ethen.gateway.api.app.gateway_app`, which mounts the routes
after its own and starts / closes the sessions in its lifespan (after the accounts start, before they
close). No admin key (``[store] admin_key_sha256`` or ``[log] admin_key_sha256``): the routes answer 403 and
there are no sessions.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute

from ethen.admin.dashboard import favicon_route, gateway_health, ui_routes
from ethen.admin.http import admin_routes, request_routes
from ethen.admin.observe import observe_routes
from ethen.admin.sessions import AdminAuth
from ethen.admin.shadows import shadow_routes
from ethen.gateway.accounting.accounts import Accounts
from ethen.gateway.state import Gateway

__all__ = ["AdminSurface", "admin_surface"]


class AdminSurface:
    """The admin routes of one gateway and the dashboard sessions behind them."""

    def __init__(self, routes: Sequence[BaseRoute], auth: AdminAuth | None, accounts: Accounts) -> None:
        self.routes = routes
        self.auth = auth
        self._accounts = accounts

    async def start(self) -> None:
        if self.auth is not None:  # dashboard sessions: the store's (else the data dir's) shared secret
            await self.auth.start(self._accounts.store)

    async def aclose(self) -> None:
        if self.auth is not None:
            await self.auth.aclose()


def admin_surface(gw: Gateway) -> AdminSurface:
    cfg, acc = gw.cfg, gw.accounts
    admin_key = cfg.store.admin_key_sha256 if cfg.store else cfg.log.admin_key_sha256
    auth = AdminAuth(admin_key) if admin_key else None  # admin key or dashboard session
    routes: list[BaseRoute] = [
        *admin_routes(acc, auth if cfg.store else None),
        *request_routes(gw.requestlog, auth, lambda: gateway_health(gw)),
        *ui_routes(auth),  # the dashboard (ethen.admin.dashboard): pages reading the admin API
        favicon_route(),  # GET /favicon.ico, the dashboard's icon (public)
        *observe_routes(gw, auth),  # its providers / canaries / mesh data (ethen.admin.observe)
        *shadow_routes(gw, auth if cfg.store else None),  # issue 27: pairs, promotion (ethen.admin.shadows)
    ]
    return AdminSurface(routes, auth, acc)
