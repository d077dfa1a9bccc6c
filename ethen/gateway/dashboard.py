"""The web dashboard at ``/ui`` (issue 14): one static page and its script, reading the admin API.

The page (``ethen/gateway/ui/index.html`` + ``app.js``: plain HTML and vanilla JS, no build step, no CDN)
asks for the admin key in a login field and keeps it in ``sessionStorage`` (gone when the tab closes); every
call sends it as ``Authorization: Bearer``, so the page itself holds no data and needs no key. It shows the
request log (filters, newest first, auto-refresh, a request's receipt: the chain, each rejected candidate with
its reasons, the attempts with their timings, the cost), spend per project (``/projects``, ``/usage``: a
store is needed), provider health (open circuits) and mesh nodes (``/health``).

Choices where the issue is silent: read-only (no writes, so no CSRF surface; projects and keys stay with
``ethen projects`` / ``ethen keys`` and the admin API); data is put in the page with ``textContent`` only,
and the page is served with a Content-Security-Policy that allows scripts from the gateway alone.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from ethen.gateway.app import Gateway

__all__ = ["gateway_health", "ui_routes"]

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def gateway_health(gw: Gateway) -> dict[str, Any]:
    """Open circuits, mesh nodes and the request log's queue (``GET /api/admin/v1/health``)."""
    board = gw.circuits
    now = board.clock()
    circuits = [
        {"circuit": key, "reason": c.reason, "state": "half_open" if c.trial_at <= now else "open",
         "trial_in_s": round(max(0.0, c.trial_at - now), 3), "cooldown_s": c.cooldown_s}
        for key, c in sorted(board.circuits.items())
    ]
    nodes = [
        {"provider": name, "node_id": n.node_id, "alive": n.alive, "latency_ms": n.latency_ms, "load": n.load,
         "active_sessions": n.active_sessions, "sessions": n.sessions, "failovers": n.failovers}
        for name, p in sorted(gw.providers.items()) for n in p.node_stats()
    ]
    return {
        "providers": sorted({c.provider for c in gw.pool}),
        "circuits": circuits,
        "nodes": nodes,
        "request_log": {"queued": gw.requestlog.queued, "store": gw.requestlog.store() is not None},
    }


def _asset(name: str) -> bytes:
    return resources.files("ethen.gateway").joinpath("ui", name).read_bytes()


def ui_routes() -> list[Route]:
    """``GET /ui`` (the page) and ``GET /ui/app.js``; read once, at app build."""
    page, script = _asset("index.html"), _asset("app.js")
    headers = {"content-security-policy": _CSP, "x-content-type-options": "nosniff",
               "cache-control": "no-store", "referrer-policy": "no-referrer"}

    async def index(request: Request) -> Response:
        return Response(page, 200, headers, media_type="text/html; charset=utf-8")

    async def app_js(request: Request) -> Response:
        return Response(script, 200, headers, media_type="text/javascript; charset=utf-8")

    return [Route("/ui", index, methods=["GET"]), Route("/ui/app.js", app_js, methods=["GET"])]
