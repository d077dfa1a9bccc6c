"""The ``/ui`` dashboard (issue 14), tested at the HTTP level (the browser test is test_browser_dashboard.py):
login and the session cookie, CSRF on cookie writes, the page, its script, and every admin API call the script
makes, checked against a live store-backed gateway after real traffic."""

from __future__ import annotations

import hashlib
import re
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request

from ethen.admin.sessions import COOKIE, AdminAuth, secure_cookie
from tests.gateway.budget_harness import ADMIN_KEY, live_store, new_project_key
from tests.gateway.service_harness import live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hello"}]


def _login(url: str, key: str = ADMIN_KEY) -> dict[str, str]:
    r = httpx.post(f"{url}/ui/login", data={"admin_key": key})
    assert r.status_code == 303 and r.headers["location"] == "/ui", r.text
    return {"cookie": f"{COOKIE}={r.cookies[COOKIE]}"}


def test_dashboard_page_and_every_api_it_reads(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'ui.db'}", {"up-beta-small": Behavior(fail_status=500)}) as lv:
        key = new_project_key(lv, "acme", budget_usd=2.0)
        for i, model in enumerate(("ethen/auto", "beta-small", "beta-small", "beta-small")):
            r = httpx.post(f"{lv.base_url}/chat/completions", timeout=15,
                           headers={"authorization": f"Bearer {key}", "x-request-id": f"ui-{i}"},
                           json={"model": model, "messages": USER, "max_tokens": 5})
            # a fallback answers the alias; beta-small alone fails until its circuit opens (then 503)
            assert r.status_code == (200 if i == 0 else 502 if i < 3 else 503), r.text

        cookie = _login(lv.gateway.url)
        page = httpx.get(f"{lv.gateway.url}/ui", headers=cookie)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # static files are named with their content's hash and kept by the browser; the page is never cached
        versions = dict(re.findall(r'"/ui/([a-z.]+)\?v=([0-9a-f]{16})"', page.text))
        assert set(versions) == {"app.js", "observe.js", "shadows.js", "uplot.iife.min.js", "uplot.min.css"}
        assert page.headers["cache-control"] == "no-store"
        assert f'<script src="/ui/app.js?v={versions["app.js"]}"></script>' in page.text
        assert 'id="req-rows"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        js = httpx.get(f"{lv.gateway.url}/ui/app.js?v={versions['app.js']}", headers=cookie)
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert js.headers["cache-control"] == "private, max-age=31536000, immutable"
        assert hashlib.sha256(js.content).hexdigest()[:16] == versions["app.js"]
        assert "x-csrf-token" in js.text and "innerHTML" not in js.text and "sessionStorage" not in js.text
        # the chart library ships in the package (no CDN): served with the session only
        assert '<script src="/ui/uplot.iife.min.js?v=' in page.text and "https://" not in page.text
        for name, kind, marker in (("uplot.iife.min.js", "text/javascript", "uPlot 1.6.32"),
                                   ("uplot.min.css", "text/css", ".uplot")):
            asset = httpx.get(f"{lv.gateway.url}/ui/{name}", headers=cookie)
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
            assert marker in asset.text and "MIT" in asset.text
            assert httpx.get(f"{lv.gateway.url}/ui/{name}").status_code == 401

        # every admin API path the script calls
        called = set(re.findall(r'api\("(/[a-z]+)', js.text))
        assert called == {"/health", "/requests", "/projects", "/usage", "/keys", "/observe"}
        assert '"/observe/spend?limit=2000"' in js.text  # the spend charts' one narrow query
        # the Candidates, Canaries and Mesh tabs: their own script, after app.js, session only
        assert page.text.index('src="/ui/app.js?v=') < page.text.index('<script src="/ui/observe.js?v=')
        for tab in ("providers", "canaries", "mesh"):
            assert f'data-tab="{tab}"' in page.text and f'<section id="{tab}">' in page.text
        obs = httpx.get(f"{lv.gateway.url}/ui/observe.js", headers=cookie)
        assert obs.status_code == 200 and obs.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in obs.text and httpx.get(f"{lv.gateway.url}/ui/observe.js").status_code == 401
        shadows = httpx.get(f"{lv.gateway.url}/ui/shadows.js", headers=cookie)  # the Shadows tab (issue 27)
        assert shadows.status_code == 200 and "innerHTML" not in shadows.text
        assert set(re.findall(r'api\("(/[a-z/]+)', shadows.text)) == {"/shadows", "/shadows/promote"}
        assert 'data-tab="shadows"' in page.text and '<section id="shadows">' in page.text
        observed = set(re.findall(r'api\([`"](/observe/[a-z]+)', obs.text + js.text))
        assert observed == {"/observe/providers", "/observe/canaries", "/observe/mesh", "/observe/spend"}
        base = f"{lv.gateway.url}/api/admin/v1"
        hdr = {"authorization": f"Bearer {ADMIN_KEY}"}
        paths = ("/health", "/requests?limit=50", "/requests/ui-0", "/projects", "/projects/acme", "/usage",
                 *sorted(observed))
        for path in paths:
            assert httpx.get(base + path.split("?")[0]).status_code == 401, path  # no key: nothing
            assert httpx.get(base + path, headers={"authorization": f"Bearer {key}"}).status_code == 401

        deadline = time.monotonic() + 10
        while True:  # bounded: the request log's writer lags by a batch
            rows: list[dict[str, Any]] = httpx.get(f"{base}/requests", headers=hdr).json()["data"]
            if len(rows) == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # the fields the table and the request view read
        for field in ("at", "request_id", "status", "outcome", "error_code", "project", "requested_model",
                      "selected_provider", "selected_model", "fallback_used", "attempts", "latency_ms",
                      "prompt_tokens", "completion_tokens", "cost_usd"):
            assert all(field in r for r in rows), field
        one = httpx.get(f"{base}/requests/ui-0", headers=hdr).json()
        rc = one["receipt"]
        assert rc["chain"][0] == "beta/beta-small" and isinstance(rc["rejected"], list)
        assert [a["outcome"] for a in one["attempts"]] == ["error", "ok"]
        health = httpx.get(f"{base}/health", headers=hdr).json()
        assert {"circuit": "beta/beta-small", "reason": "candidate_failing"}.items() <= next(
            c for c in health["circuits"] if c["circuit"] == "beta/beta-small").items()
        assert health["nodes"] == [] and "beta" in health["providers"]
        assert health["request_log"] == {"queued": 0, "store": True}
        projects = httpx.get(f"{base}/projects", headers=hdr).json()["data"]
        assert [p["name"] for p in projects] == ["acme"]
        window = httpx.get(f"{base}/projects/acme", headers=hdr).json()["window"]
        assert window["remaining_usd"] <= 2.0
        usage = httpx.get(f"{base}/usage", headers=hdr).json()["data"]
        assert usage and all({"project", "key_id", "model", "requests", "cost_usd"} <= set(u) for u in usage)


def test_login_session_cookie_csrf_and_logout(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'login.db'}", {}) as lv:
        url, base = lv.gateway.url, f"{lv.gateway.url}/api/admin/v1"
        # a wrong key: the login form again (401), no cookie, and no page, script or API
        bad = httpx.post(f"{url}/ui/login", data={"admin_key": "not-the-admin-key"})
        assert bad.status_code == 401 and "That is not the admin key." in bad.text
        assert "set-cookie" not in bad.headers
        forged = {"cookie": f"{COOKIE}=made-up-session-id"}
        for hdr in ({}, forged):
            anon = httpx.get(f"{url}/ui", headers=hdr)
            assert anon.status_code == 200 and 'name="admin_key"' in anon.text and "req-rows" not in anon.text
            assert httpx.get(f"{url}/ui/app.js", headers=hdr).status_code == 401
            assert httpx.get(f"{url}/ui/observe.js", headers=hdr).status_code == 401
            for path in ("/health", "/requests", "/projects", "/usage", "/observe/providers",
                         "/observe/canaries", "/observe/mesh"):
                assert httpx.get(base + path, headers=hdr).status_code == 401, path

        ok = httpx.post(f"{url}/ui/login", data={"admin_key": ADMIN_KEY})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui"
        set_cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in set_cookie and "samesite=strict" in set_cookie and "path=/" in set_cookie
        assert "max-age=28800" in set_cookie and "secure" not in set_cookie  # loopback: plain HTTP works
        cookie = {"cookie": f"{COOKIE}={ok.cookies[COOKIE]}"}
        page = httpx.get(f"{url}/ui", headers=cookie).text
        csrf = re.search(r'<meta name="csrf-token" content="([A-Za-z0-9_-]{40,})">', page)
        assert csrf is not None and "req-rows" in page
        for path in ("/health", "/requests", "/projects", "/usage", "/observe/providers", "/observe/canaries",
                     "/observe/mesh"):
            assert httpx.get(base + path, headers=cookie).status_code == 200, path

        # a cookie write needs the session's CSRF token (a cross-site form cannot send the header)
        body = {"name": "acme", "budget_usd": 5.0}
        assert httpx.post(f"{base}/projects", json=body, headers=cookie).status_code == 401
        wrong = {**cookie, "x-csrf-token": "x" * 43}
        assert httpx.post(f"{base}/projects", json=body, headers=wrong).status_code == 401
        good = {**cookie, "x-csrf-token": csrf.group(1)}
        assert httpx.post(f"{base}/projects", json=body, headers=good).status_code == 201
        assert httpx.post(f"{base}/projects/acme/keys", json={"name": "k"}, headers=cookie).status_code == 401
        created = httpx.post(f"{base}/projects/acme/keys", json={"name": "k"}, headers=good)
        assert created.status_code == 201 and created.json()["key"].startswith("ethen")
        assert httpx.delete(f"{base}/keys/{created.json()['key_id']}", headers=cookie).status_code == 401
        assert httpx.delete(f"{base}/keys/{created.json()['key_id']}", headers=good).status_code == 200

        # logout needs the token too; afterwards the cookie is dead
        assert httpx.post(f"{url}/ui/logout", headers=cookie).status_code == 401
        out = httpx.post(f"{url}/ui/logout", headers=good)
        assert out.status_code == 204 and f'{COOKIE}=""' in out.headers["set-cookie"]
        assert httpx.get(f"{base}/projects", headers=cookie).status_code == 401
        assert "req-rows" not in httpx.get(f"{url}/ui", headers=cookie).text


def _png_size(ico: bytes) -> tuple[int, int]:
    """The size of the one image in an ICO file that holds a PNG (the format's header, entry and IHDR)."""
    reserved, kind, count = struct.unpack_from("<HHH", ico, 0)
    assert (reserved, kind, count) == (0, 1, 1)
    w, h, _colors, _zero, _planes, _bpp, size, offset = struct.unpack_from("<BBBBHHII", ico, 6)
    png = ico[offset:offset + size]
    assert offset + size == len(ico) and png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    assert zlib.crc32(png[12:29]) == struct.unpack_from(">I", png, 29)[0]  # IHDR's checksum
    assert struct.unpack_from(">II", png, 16) == (w, h)
    return w, h


def test_favicon_served_to_anyone_and_named_by_the_pages(tmp_path: Path) -> None:
    """Issue 23: ``/favicon.ico`` was a 404. Now an ICO (a 32x32 PNG inside), public like any site's icon (a
    browser asks for it on the login page too), also from a gateway without a dashboard; both pages link
    it."""
    with live_store(f"sqlite:///{tmp_path / 'icon.db'}", {}) as lv:
        url = lv.gateway.url
        icon = httpx.get(f"{url}/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert _png_size(icon.content) == (32, 32) and len(icon.content) < 1024
        assert '<link rel="icon" href="/favicon.ico" sizes="32x32">' in httpx.get(f"{url}/ui").text  # login
        page = httpx.get(f"{url}/ui", headers=_login(url)).text
        assert '<link rel="icon" href="/favicon.ico" sizes="32x32">' in page and 'id="req-rows"' in page
    with live() as lv:  # no admin key: no dashboard, the icon all the same
        assert httpx.get(f"{lv.gateway.url}/ui").status_code == 404
        icon = httpx.get(f"{lv.gateway.url}/favicon.ico")
        assert icon.status_code == 200 and _png_size(icon.content) == (32, 32)


def _request(client: str, cookie: str = "") -> Request:
    headers = [(b"cookie", cookie.encode())] if cookie else []
    scope = {"type": "http", "method": "GET", "path": "/ui", "headers": headers, "client": (client, 5)}
    return Request(scope)


def test_session_expiry_and_secure_cookie_off_loopback() -> None:
    now = [1000.0]
    auth = AdminAuth("00" * 32, ttl_s=60, clock=lambda: now[0])
    sid, _ = auth.login()
    assert auth.session(_request("127.0.0.1", f"{COOKIE}={sid}")) is not None
    now[0] += 61
    assert auth.session(_request("127.0.0.1", f"{COOKIE}={sid}")) is None
    assert not secure_cookie(_request("127.0.0.1")) and not secure_cookie(_request("::1"))
    assert secure_cookie(_request("10.1.2.3")) and secure_cookie(_request("192.168.0.9"))


def test_root_redirects_browsers_to_the_dashboard(tmp_path: Path) -> None:
    """Issue 42 (13): ``GET /`` was a JSON 404, so an operator opening the gateway's address found nothing;
    with a dashboard it redirects to ``/ui`` (the login form, then the app). Other unknown paths stay JSON
    404s, other methods on ``/`` JSON 405s, and a gateway without a dashboard keeps ``/`` a 404."""
    with live_store(f"sqlite:///{tmp_path / 'root.db'}", {}) as lv:
        url = lv.gateway.url
        for method in ("GET", "HEAD"):
            r = httpx.request(method, f"{url}/")
            assert r.status_code == 307 and r.headers["location"] == "/ui", (method, r.status_code, r.headers)
        followed = httpx.get(f"{url}/", follow_redirects=True)
        assert followed.status_code == 200 and str(followed.url) == f"{url}/ui"
        assert 'name="admin_key"' in followed.text  # the sign-in form
        signed_in = httpx.post(f"{url}/ui/login", data={"admin_key": ADMIN_KEY}).cookies
        with httpx.Client(cookies=signed_in, follow_redirects=True) as browser:  # signed in: the app
            app = browser.get(f"{url}/")
        assert app.status_code == 200 and 'id="req-rows"' in app.text
        unknown = httpx.get(f"{url}/nope")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        post = httpx.post(f"{url}/", json={})
        assert post.status_code == 405 and post.json()["error"]["code"] == "method_not_allowed"
    with live() as lv:  # no admin key, no dashboard: nothing to send a browser to
        r = httpx.get(f"{lv.gateway.url}/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
