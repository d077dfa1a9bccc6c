"""Dashboard sessions across gateway processes (issue 14): a login made through instance A is honoured by
instance B (two real ``ethen gateway`` processes on one store), and by ``--workers 2`` processes replaced
after the login; a tampered, expired or foreign cookie is refused; a sign-out reaches the other instance
within a second; a changed admin key refuses the old cookies. SQLite, and Postgres when ``ETHEN_TEST_PG_URL``
is set."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.admin.sessions import COOKIE, SECRET_FILE, AdminAuth
from ethen.store import Store
from tests.gateway.accounting.test_service_instances_redis import instances, start, wait_for
from tests.gateway.api.test_service_cli import free_port, write_toml
from tests.gateway.budget_harness import ADMIN_KEY, db_url, store_cfg, with_store
from tests.gateway.service_harness import config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

__all__ = ["db_url"]  # the fixture, imported for pytest
NEW_ADMIN_KEY = "admin-rotated-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


@pytest.fixture(autouse=True)
def _data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_DATA_DIR", str(tmp_path / "data"))  # the gateways' data dir: never the home


def _login(url: str, key: str = ADMIN_KEY) -> str:
    r = httpx.post(f"{url}/ui/login", data={"admin_key": key}, timeout=10)
    assert r.status_code == 303, r.text
    return r.cookies[COOKIE]


def _page(url: str, cookie: str) -> str | None:
    """The CSRF token of the dashboard page this cookie opens, or ``None`` (the login form)."""
    r = httpx.get(f"{url}/ui", headers={"cookie": f"{COOKIE}={cookie}"}, timeout=10)
    assert r.status_code == 200, r.text
    m = re.search(r'<meta name="csrf-token" content="([A-Za-z0-9_-]+)">', r.text)
    assert (m is None) == ('name="admin_key"' in r.text)
    return m.group(1) if m else None


def _api(url: str, cookie: str, method: str = "GET", path: str = "/projects", **kw: Any) -> int:
    headers = {"cookie": f"{COOKIE}={cookie}", **kw.pop("headers", {})}
    return httpx.request(method, f"{url}/api/admin/v1{path}", headers=headers, timeout=10, **kw).status_code


def _cfg(path: Path, upstream: str, db: str, admin_key: str = ADMIN_KEY) -> Path:
    store = {**store_cfg(db), "admin_key_sha256": hashlib.sha256(admin_key.encode()).hexdigest()}
    write_toml(config_dict(upstream, store=store), path)
    return path


def test_a_login_through_one_instance_is_a_session_on_the_other(db_url: str, tmp_path: Path) -> None:
    with ServerThread(make_upstream_app(Script(record=False))) as up:
        cfg = _cfg(tmp_path / "gw.toml", up.url, db_url)
        with instances([cfg, cfg], tmp_path) as (pa, pb):
            a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
            cookie = _login(a)
            csrf = _page(b, cookie)  # B never saw this login
            assert csrf is not None and csrf == _page(a, cookie)
            assert _api(b, cookie) == 200
            assert _api(b, cookie, "POST", json={"name": "from-b"}) == 401  # a write needs the CSRF token
            assert _api(b, cookie, "POST", json={"name": "from-b"}, headers={"x-csrf-token": csrf}) == 201
            assert _api(a, _login(b)) == 200  # and the other way round

            # tampered: signature, expiry or session id changed; a cookie of another database's secret
            expires, sid, mac = cookie.split(".")
            flipped = mac[:-2] + ("A" if mac[-2] != "A" else "B") + mac[-1]
            later = str(int(expires) + 3600)
            secret = with_store(db_url, lambda st: st.session_secret())
            admin_sha = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
            foreign, _ = AdminAuth(admin_sha, secret=b"\x01" * 32).login()
            for bad in (f"{expires}.{sid}.{flipped}", f"{later}.{sid}.{mac}", f"{expires}.{sid[:-1]}x.{mac}",
                        foreign, cookie + "x", "1.2.3", ""):  # fmt: skip
                assert _api(b, bad) == 401 and _page(b, bad) is None, bad

            # expired: signed with the right key (the same forge at the present time is accepted)
            now, _ = AdminAuth(admin_sha, secret=secret).login()
            assert _api(b, now) == 200
            old, _ = AdminAuth(admin_sha, secret=secret, clock=lambda: time.time() - 8 * 3600 - 5).login()
            assert _api(b, old) == 401 and _page(b, old) is None

            # a sign-out through A: refused at once by A, within a second by B
            out = httpx.post(f"{a}/ui/logout", headers={"cookie": f"{COOKIE}={cookie}", "x-csrf-token": csrf})
            assert out.status_code == 204
            assert _api(a, cookie) == 401
            waited = wait_for(lambda: _api(b, cookie) == 401, 1.5)
            print(f"sign-out through A refused by B after {waited:.3f} s")
            assert _api(b, now) == 200  # other sessions go on

        # the admin key changes (both restarted with the new one, same store): old cookies are refused
        fresh = _cfg(tmp_path / "rotated.toml", up.url, db_url, NEW_ADMIN_KEY)
        with instances([cfg, fresh], tmp_path) as (pa, pb):
            a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
            old_key_cookie = _login(a)
            assert _api(a, old_key_cookie) == 200
            assert _api(b, old_key_cookie) == 401 and _page(b, old_key_cookie) is None
            assert _api(b, now) == 401
            new_key_cookie = _login(b, NEW_ADMIN_KEY)
            assert _api(b, new_key_cookie) == 200 and _api(a, new_key_cookie) == 401


def test_workers_2_keep_a_session_across_their_processes_and_restarts(tmp_path: Path) -> None:
    """``--workers 2`` without a store (``[log] admin_key_sha256``): the secret is the data dir's file, so a
    session made by one worker is valid in the other, and in workers started after it (both killed)."""
    with ServerThread(make_upstream_app(Script(record=False))) as up:
        cfg = tmp_path / "gw.toml"
        log = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
        write_toml(config_dict(up.url, log=log), cfg)
        port = free_port()
        parent = start(cfg, port, tmp_path / "workers.log", "--workers", "2", timeout_s=90)
        url = f"http://127.0.0.1:{port}"
        try:
            children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
            wait_for(lambda: len(children.read_text().split()) == 2, 30.0)
            cookie = _login(url)
            assert [_api(url, cookie, path="/requests") for _ in range(10)] == [200] * 10
            secret = tmp_path / "data" / SECRET_FILE
            assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text()) == 64
            for pid in children.read_text().split():  # every process that saw the login is replaced
                old = set(children.read_text().split())
                os.kill(int(pid), signal.SIGKILL)
                wait_for(lambda o=old: len(set(children.read_text().split()) - o) == 1, 15.0)  # type: ignore[misc]
            deadline = time.monotonic() + 60
            while True:  # bounded: the restarted workers start serving
                try:
                    if httpx.get(f"{url}/api/gateway/v1/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert [_api(url, cookie, path="/requests") for _ in range(10)] == [200] * 10
            assert _page(url, cookie) is not None
        finally:
            parent.send_signal(signal.SIGTERM)
            parent.wait(30)


def test_the_session_secret_is_made_once_per_database(db_url: str) -> None:
    async def twice(st: Store) -> tuple[bytes, bytes]:
        return await st.session_secret(), await st.session_secret()

    first, second = with_store(db_url, twice)
    assert first == second and len(first) == 32
    assert with_store(db_url, lambda st: st.session_secret()) == first  # another connection, same bytes
