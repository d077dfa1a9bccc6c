"""Rate limits kept in the store (issue 11): ``rpm`` / ``tpm`` in a project's policy and on a key, set
through the admin API and the CLI, applied by a live gateway (429 ``rate_limit_exceeded``, ``Retry-After``, no
upstream call) and by a second gateway process within a second of a change; the store's value overrides the
config file's; bad values are a 400 naming the field (API) or an error naming the flag (CLI). SQLite, and
Postgres / Redis when ``ETHEN_TEST_PG_URL`` / ``ETHEN_TEST_REDIS_URL`` are set."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from ethen.cli import app as ethen_app
from ethen.store import Store
from tests.gateway.accounting.test_ratelimit import redis_url_or_skip
from tests.gateway.accounting.test_service_instances_redis import instances
from tests.gateway.api.test_service_cli import write_toml
from tests.gateway.budget_harness import (
    ADMIN_KEY,
    ADMIN_PREFIX,
    admin,
    db_url,
    live_store,
    store_cfg,
    with_store,
)
from tests.gateway.service_harness import config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

__all__ = ["db_url"]  # the fixture, imported for pytest
USER = [{"role": "user", "content": "hi"}]


def chat(url: str, key: str) -> httpx.Response:
    body = {"model": "beta-small", "messages": USER, "max_tokens": 5}
    auth = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/chat/completions", json=body, headers=auth, timeout=10)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


def test_project_and_key_limits_set_through_the_admin_api(db_url: str) -> None:
    # the config file limits project 'acme' to 1 rpm and 100000 tpm: the store's rpm overrides the first
    limits = {"projects": {"acme": {"rpm": 1, "tpm": 100_000}}}
    with live_store(db_url, rate_limits=limits) as lv, admin(lv) as a:
        r = a.post("/projects", json={"name": "acme", "rpm": 2})
        assert r.status_code == 201 and r.json()["rpm"] == 2 and r.json()["tpm"] is None, r.text
        key = a.post("/projects/acme/keys", json={"name": "k"}).json()["key"]
        calls = len(lv.script.calls)
        assert [chat(lv.base_url, key).status_code for _ in range(2)] == [200, 200]
        err = _error(r := chat(lv.base_url, key), 429)
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert "project 'acme'" in err["message"] and "limit 2" in err["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert len(lv.script.calls) == calls + 2  # the refused request reached no upstream

        # raised through the API: applied at once by the instance that made the change
        p = a.patch("/projects/acme", json={"rpm": 3})
        assert p.status_code == 200 and p.json()["rpm"] == 3 and p.json()["window"]["remaining_usd"] is None
        assert [chat(lv.base_url, key).status_code for _ in range(2)] == [200, 429]
        # cleared in the store: the config file's 1 rpm applies again (3 already in the window)
        assert a.patch("/projects/acme", json={"rpm": None}).json()["rpm"] is None
        assert "limit 1" in _error(chat(lv.base_url, key), 429)["message"]
        # tpm from the store, the config file's tpm overridden: a request estimated above it is refused
        assert a.patch("/projects/acme", json={"rpm": 100, "tpm": 3}).json()["tpm"] == 3
        err = _error(chat(lv.base_url, key), 429)
        assert err["type"] == "tokens" and "limit of 3 tokens" in err["message"]
        assert a.get("/projects/acme").json()["tpm"] == 3

        # a key's own limit, set at creation and changed through PATCH /keys/{key_id}
        assert a.patch("/projects/acme", json={"tpm": None}).status_code == 200
        created = a.post("/projects/acme/keys", json={"name": "slow", "rpm": 1}).json()
        assert created["rpm"] == 1 and created["tpm"] is None
        slow, slow_id = created["key"], created["key_id"]
        assert chat(lv.base_url, slow).status_code == 200
        assert f"key {slow_id!r}" in _error(chat(lv.base_url, slow), 429)["message"]
        changed = a.patch(f"/keys/{slow_id}", json={"rpm": 2, "tpm": 50_000})
        assert changed.status_code == 200 and (changed.json()["rpm"], changed.json()["tpm"]) == (2, 50_000)
        assert [chat(lv.base_url, slow).status_code for _ in range(2)] == [200, 429]
        listed = {k["key_id"]: k for k in a.get("/projects/acme/keys").json()["data"]}
        assert (listed[slow_id]["rpm"], listed[slow_id]["tpm"]) == (2, 50_000)
        assert _error(a.patch("/keys/000000000000", json={"rpm": 1}), 404)["code"] == "not_found"


BAD = [(-1, "invalid_value"), (0, "invalid_value"), (10**13, "invalid_value"), (1.5, "invalid_type"),
       ("10", "invalid_type"), (True, "invalid_type"), ([5], "invalid_type")]


def test_bad_rate_limits_are_400_naming_the_field(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'bad.db'}") as lv, admin(lv) as a:
        assert a.post("/projects", json={"name": "acme"}).status_code == 201
        key_id = a.post("/projects/acme/keys", json={}).json()["key_id"]
        for (value, code), field in itertools.product(BAD, ("rpm", "tpm")):
            for method, path, body in (("POST", "/projects", {"name": "other", field: value}),
                                       ("PATCH", "/projects/acme", {field: value}),
                                       ("POST", "/projects/acme/keys", {field: value}),
                                       ("PATCH", f"/keys/{key_id}", {field: value})):  # fmt: skip
                err = _error(a.request(method, path, json=body), 400)
                assert (err["code"], err["param"]) == (code, field), (method, path, err)
                assert field in err["message"] and repr(value) in err["message"]
        # nothing was changed or created by a refused call
        assert [p["name"] for p in a.get("/projects").json()["data"]] == ["acme"]
        assert a.get("/projects/acme").json()["rpm"] is None
        assert len(a.get("/projects/acme/keys").json()["data"]) == 1


@pytest.fixture(params=["memory", "redis"])
def shared(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "memory":
        return {}
    return {"shared": {"redis_url": redis_url_or_skip(), "key_prefix": f"t{uuid.uuid4().hex[:10]}"}}


def _within(check: Any, limit_s: float) -> float:
    """When (seconds from now) the first request for which ``check()`` held was sent; fails past limit_s."""
    t0 = time.monotonic()
    while True:
        sent = time.monotonic() - t0
        assert sent < limit_s, f"not within {limit_s} s"
        if check():
            return sent
        time.sleep(0.02)


def test_a_limit_changed_through_one_instance_applies_on_the_other_within_a_second(
    db_url: str, shared: dict[str, Any], tmp_path: Path
) -> None:
    script = Script()
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        write_toml(config_dict(up.url, store=store_cfg(db_url), **shared), cfg)
        with instances([cfg, cfg], tmp_path) as (pa, pb), httpx.Client(
            base_url=f"http://127.0.0.1:{pa}{ADMIN_PREFIX}", headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        ) as a:  # fmt: skip
            urls = [f"http://127.0.0.1:{p}/api/gateway/v1" for p in (pa, pb)]
            assert a.post("/projects", json={"name": "p", "rpm": 100}).status_code == 201
            key = a.post("/projects/p/keys", json={}).json()["key"]
            for url in urls:  # both cache the key with its project (rpm 100): 3 requests each, logged
                assert [chat(url, key).status_code for _ in range(3)] == [200, 200, 200]

            # tightened through A below what B's window holds: B's first request after it applies is a 429
            assert a.patch("/projects/p", json={"rpm": 2}).status_code == 200
            calls = len(script.calls)
            codes: list[int] = []

            def refused() -> bool:
                codes.append(chat(urls[1], key).status_code)
                return codes[-1] == 429

            waited = _within(refused, 1.0)
            r = chat(urls[1], key)
            assert _error(r, 429)["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
            assert "limit 2" in r.json()["error"]["message"]
            assert len(script.calls) == calls + codes.count(200)  # no upstream call for a 429
            print(f"rpm 100 -> 2 applied on instance B for a request sent {waited:.3f} s after ({codes})")

            # cleared through A: B's first request after it applies is served (and no longer counted)
            assert a.patch("/projects/p", json={"rpm": None}).status_code == 200
            waited = _within(lambda: chat(urls[1], key).status_code == 200, 1.0)
            print(f"rpm 2 -> none applied on instance B for a request sent {waited:.3f} s after")
            if shared:  # one window for both instances: room for exactly 2 more, wherever they arrive
                held = 6 + codes.count(200)  # 3 + 3 at rpm 100, and B's before rpm 2 applied
                assert a.patch("/projects/p", json={"rpm": held + 2}).status_code == 200
                time.sleep(1.2)  # B applies it within a second
                results = [chat(urls[i % 2], key).status_code for i in range(6)]
                assert results.count(200) == 2 and results.count(429) == 4, results


def _cli(*args: str) -> Any:
    return CliRunner().invoke(ethen_app, list(args))


def test_cli_sets_project_and_key_limits_and_names_the_flag_of_a_bad_value(db_url: str) -> None:
    r = _cli("projects", "create", "acme", "--rpm", "60", "--tpm", "100000", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["rpm"], json.loads(r.stdout)["tpm"]) == (60, 100_000)
    r = _cli("projects", "set", "acme", "--rpm", "none", "--tpm", "5000", "--budget", "3", "--db", db_url)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["rpm"], out["tpm"], out["budget_usd"]) == (None, 5000, 3.0)
    r = _cli("keys", "create", "--project", "acme", "--rpm", "2", "--db", db_url)
    assert r.exit_code == 0, r.output
    key = r.stdout.strip()
    r = _cli("keys", "set", key.split("_")[1], "--tpm", "700", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["rpm"], json.loads(r.stdout)["tpm"]) == (2, 700)

    async def read(st: Store) -> Any:
        return await st.authenticate(key)

    principal = with_store(db_url, read)
    assert (principal.rpm, principal.tpm) == (2, 700)
    assert (principal.project.rpm, principal.project.tpm) == (None, 5000)

    for args, flag in ((("projects", "create", "b", "--rpm", "-5"), "--rpm"),
                       (("projects", "create", "b", "--tpm", "1.5"), "--tpm"),
                       (("projects", "set", "acme", "--rpm", "0"), "--rpm"),
                       (("projects", "set", "acme", "--tpm", "many"), "--tpm"),
                       (("keys", "create", "--project", "acme", "--rpm", "none"), "--rpm"),
                       (("keys", "set", key.split("_")[1], "--tpm", "-1"), "--tpm")):  # fmt: skip
        r = _cli(*args, "--db", db_url)
        assert r.exit_code == 2 and f"error: {flag} = " in r.stderr, (args, r.output)
    assert _cli("projects", "set", "acme", "--db", db_url).exit_code == 2  # nothing to change
    assert json.loads(_cli("projects", "list", "--db", db_url).stdout)[0]["rpm"] is None
    assert [p["name"] for p in json.loads(_cli("projects", "list", "--db", db_url).stdout)] == ["acme"]


def test_migration_adds_the_columns_to_an_older_database(db_url: str) -> None:
    """A database migrated before 0005 (no rpm/tpm columns) gets them; its rows read as unlimited."""

    async def run(st: Store) -> list[str]:
        await st.create_project("old")
        async with st.writer.begin() as conn:
            for table in ("projects", "api_keys"):
                for col in ("rpm", "tpm"):
                    await conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {col}"))
            await conn.execute(text("DELETE FROM ethen_migrations WHERE name = '0005_rate_limits'"))
        ran = await st.migrate()
        assert (await st.get_project("old")).rpm is None
        assert (await st.update_project("old", rpm=7)).rpm == 7
        return ran

    assert with_store(db_url, run) == ["0005_rate_limits"]
