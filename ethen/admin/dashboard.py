"""The web dashboard at ``/ui`` (issue 14): server-served pages and a small script reading the admin API.

``GET /ui`` is the login form (``ui/login.html``) until ``POST /ui/login`` (form field ``admin_key``) checks
the admin key and sets the session cookie (``ethen.admin.sessions``: ``HttpOnly``, ``SameSite=Strict``,
``Secure`` off loopback, 8 h); then ``GET /ui`` is the app (``ui/index.html`` + ``app.js``: plain HTML and
vanilla JS, no build step, no CDN) with the session's CSRF token in a ``<meta>``. The script calls the admin
API with the cookie and sends ``x-csrf-token`` on writes; ``POST /ui/logout`` (CSRF token required) ends the
session. Without a session, the app, its script and the chart library are 401 (a wrong key sees nothing).
It shows the request log (filters, newest first, auto-refresh, a request's receipt: the chain, each rejected
candidate with its reasons, the attempts with their timings, the cost), spend per project (``/projects``,
``/usage``: a store is needed; charts of spend per project and per model over time, drawn with uPlot from the
newest 2000 rows of the request log), projects and keys (create a project, create a key shown once, revoke a
key), provider health (open circuits) and mesh nodes (``/health``). ``observe.js`` adds the Candidates tab
(success rate, latency p50 / p95 and circuit state over time per candidate or provider, uPlot), Canaries and
Mesh (nodes, layers, health, the route chosen now and its cost), from ``/api/admin/v1/observe/*``
(:mod:`ethen.admin.observe`). ``GET /favicon.ico`` (public) is the pages' icon, an ICO built here.

Axes: spend from $0 to just above the data (all-zero data, free models: $0-0.01), success rate and circuit
state 0-100%. Wide tables (the Mesh tab's) sit in a card and scroll inside it, never the page.

``GET /`` redirects to ``/ui`` (307; only when there is a dashboard: other unknown paths, and ``/`` without
one, stay the gateway's JSON 404). The request log's table fits the window (long cells wrap; the numbers,
tokens and cost among them, never do), a clicked row's request opens scrolled into view, and the charts take
their card's full width (redrawn to it when the window is resized).

``POST /ui/login`` is throttled per client address (``ethen.admin.sessions.LoginThrottle``: 5 failures in a
row, then 429 with ``Retry-After`` for 1 s, doubling per further failure up to 60 s; a success resets).

Choices where the issue is silent: data is put in the page with ``textContent`` only, and every page is served
with a Content-Security-Policy that allows scripts from the gateway alone and forms posting to it alone; no
dashboard without an admin key (``[store]`` or ``[log] admin_key_sha256``).
"""

from __future__ import annotations

import hashlib
import html
import math
import struct
import zlib
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ethen.admin.sessions import COOKIE, AdminAuth, LoginThrottle, secure_cookie
from ethen.gateway.api.connections import client_key

if TYPE_CHECKING:
    from ethen.gateway.state import Gateway

__all__ = ["favicon_route", "gateway_health", "ui_routes"]

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_MAX_LOGIN_BODY = 4096
# uPlot 1.6.32 (npm "uplot", MIT; version and license in the files' header comments): the spend charts
_ASSETS = {"app.js": "text/javascript", "observe.js": "text/javascript",  # observe.js: the observe/* tabs
           "shadows.js": "text/javascript",  # the Shadows tab (issue 27, ethen.admin.shadows)
           "uplot.iife.min.js": "text/javascript", "uplot.min.css": "text/css"}


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
    return resources.files("ethen.admin").joinpath("ui", name).read_bytes()


def _favicon() -> bytes:
    """A 32x32 ICO (one PNG inside): a light-blue "E" on the header's dark blue, corners rounded."""
    dark, blue, clear = b"\x1d\x23\x30\xff", b"\x6e\xa8\xfe\xff", b"\x00\x00\x00\x00"
    strokes = ((4, 3, 6, 13), (4, 3, 12, 5), (4, 7, 11, 9), (4, 11, 12, 13))  # x0, y0, x1, y1 on a 16 grid
    corners = {(0, 0), (1, 0), (0, 1), (14, 0), (15, 0), (15, 1), (0, 14), (0, 15), (1, 15), (15, 14),
               (14, 15), (15, 15)}

    def pixel(x: int, y: int) -> bytes:
        if (x, y) in corners:
            return clear
        return blue if any(a <= x < c and b <= y < d for a, b, c, d in strokes) else dark

    raw = b"".join(b"\x00" + b"".join(pixel(x // 2, y // 2) for x in range(32)) for y in range(32))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 32, 32, 8, 6, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    # ICONDIR (reserved, type 1 = icon, 1 image), then its entry: 32x32, 32 bpp, size, offset 6 + 16
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 32, 32, 0, 0, 1, 32, len(png), 22) + png


def favicon_route() -> Route:
    """``GET /favicon.ico``: the dashboard's icon (public, like any site's: browsers ask for it before and
    without a session; it is built once here, a few hundred bytes)."""
    body = _favicon()
    headers = {"cache-control": "public, max-age=86400", "x-content-type-options": "nosniff"}

    async def favicon(request: Request) -> Response:
        return Response(body, 200, headers, media_type="image/x-icon")

    return Route("/favicon.ico", favicon, methods=["GET"])


def ui_routes(auth: AdminAuth | None) -> list[Route]:
    """``/ui`` (login form or app), ``/ui/login``, ``/ui/logout``, the static files (read once, at build), and
    ``GET /``: a 307 to ``/ui`` (an operator opening the gateway's address finds the dashboard)."""
    if auth is None:
        return []
    app_page, login_page = _asset("index.html").decode(), _asset("login.html").decode()
    assets = {name: (_asset(name), media) for name, media in _ASSETS.items()}
    # the page names each static file with its content's hash, so the browser keeps them (private: they are
    # served to signed-in sessions only) and a new release's files get new URLs; pages stay no-store
    for name, (body, _media) in assets.items():
        version = hashlib.sha256(body).hexdigest()[:16]
        app_page = app_page.replace(f'"/ui/{name}"', f'"/ui/{name}?v={version}"')
    headers = {"content-security-policy": _CSP, "x-content-type-options": "nosniff",
               "cache-control": "no-store", "referrer-policy": "no-referrer"}
    cached = {**headers, "cache-control": "private, max-age=31536000, immutable"}

    def login_form(error: str, status: int) -> Response:
        body = login_page.replace("<!--error-->", html.escape(error))
        return Response(body, status, headers, media_type="text/html; charset=utf-8")

    async def index(request: Request) -> Response:
        s = auth.session(request)
        if s is None:
            return login_form("", 200)
        page = app_page.replace("__CSRF_TOKEN__", s.csrf)  # token_urlsafe: no HTML-special characters
        return Response(page, 200, headers, media_type="text/html; charset=utf-8")

    throttle = LoginThrottle()  # failed sign-ins per client address (ethen.admin.sessions)

    async def login(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > _MAX_LOGIN_BODY:
            return login_form("The form is too large.", 413)
        # no await from here on: the throttle's check and its record of this attempt are one step
        address = client_key((request.client.host,) if request.client else None) or ""
        wait = math.ceil(throttle.retry_after(address))
        if wait > 0:  # locked: the key is not even checked
            r = login_form(f"Too many failed sign-ins; try again in {wait} s.", 429)
            r.headers["retry-after"] = str(wait)
            return r
        key = (parse_qs(raw.decode("utf-8", "replace")).get("admin_key") or [""])[0]
        if not auth.key_ok(key):
            throttle.failed(address)
            return login_form("That is not the admin key.", 401)
        throttle.succeeded(address)
        sid, _ = auth.login()
        r = Response(None, 303, {**headers, "location": "/ui"})
        r.set_cookie(COOKIE, sid, max_age=int(auth.ttl_s), path="/", secure=secure_cookie(request),
                     httponly=True, samesite="strict")
        return r

    async def logout(request: Request) -> Response:
        s = auth.session(request)
        if s is None or not auth.csrf_ok(request, s):
            return Response('{"error":{"message":"A live session and its x-csrf-token are required.",'
                            '"type":"invalid_request_error","code":"invalid_session","param":null}}',
                            401, headers, media_type="application/json")
        auth.logout(request)
        r = Response(None, 204, headers)
        r.delete_cookie(COOKIE, path="/", secure=secure_cookie(request), httponly=True, samesite="strict")
        return r

    async def asset(request: Request) -> Response:
        if auth.session(request) is None:
            return Response("sign in at /ui", 401, headers, media_type="text/plain")
        body, media = assets[request.url.path.rsplit("/", 1)[1]]
        return Response(body, 200, cached, media_type=f"{media}; charset=utf-8")

    async def root(request: Request) -> Response:
        return Response(None, 307, {**headers, "location": "/ui"})

    return [Route("/", root, methods=["GET"]), Route("/ui", index, methods=["GET"]),
            Route("/ui/login", login, methods=["POST"]),
            Route("/ui/logout", logout, methods=["POST"])] + [
            Route(f"/ui/{name}", asset, methods=["GET"]) for name in assets]
