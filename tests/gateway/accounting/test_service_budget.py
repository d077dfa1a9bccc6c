"""Store-backed gateway (issue 6) through real HTTP: project keys, isolation, window budgets under a race of
100 concurrent requests, default alias, live certification, admin API, usage, no key material leaked."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ethen.store import Store, parse_key
from tests.gateway.api.test_service_cli import write_toml
from tests.gateway.budget_harness import (
    ADMIN_KEY,
    admin,
    db_url,
    held_reserved,
    live_store,
    new_project_key,
    with_store,
)
from tests.gateway.service_harness import CLIENT_KEY, ENV, PROVIDER_KEY, config_dict
from tests.gateway.upstream import Behavior

__all__ = ["db_url"]  # the fixture, imported from budget_harness
MSG = [{"role": "user", "content": "hi"}]


def _secret(key: str) -> str:
    parsed = parse_key(key)
    assert parsed is not None
    return parsed.secret


def _post(lv: Any, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{lv.base_url}/chat/completions", json=body, headers=headers, timeout=15)


def test_project_keys_authenticate_and_401s(db_url: str) -> None:
    with live_store(db_url) as lv:
        key = new_project_key(lv, "acme")
        assert key.startswith("ethen_")
        r = lv.client(key).chat.completions.create(model="beta-small", messages=MSG)  # type: ignore[arg-type]
        assert r.choices[0].message.content == "Hello from upstream"
        # config keys keep working next to store keys
        lv.client(CLIENT_KEY).chat.completions.create(model="beta-small", messages=MSG)  # type: ignore[arg-type]
        key_id = key.split("_")[1]
        with admin(lv) as a:
            (info,) = a.get("/projects/acme/keys").json()["data"]
            assert info["key_id"] == key_id and info["last_used_at"] is not None
            wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
            for bad in (None, wrong, "ethen_000000000000_" + "x" * 43, "sk-not-ours"):
                resp = _post(lv, bad, {"model": "beta-small", "messages": MSG})
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
                assert (bad or "") not in resp.text or bad is None
            assert a.delete(f"/keys/{key_id}").json()["revoked_at"] is not None
        resp = _post(lv, key, {"model": "beta-small", "messages": MSG})
        assert resp.status_code == 401 and key not in resp.text
        with pytest.raises(openai.AuthenticationError):
            lv.client(key).models.list()


def test_project_policy_and_default_alias(db_url: str) -> None:
    with live_store(db_url) as lv:
        key = new_project_key(lv, "p", allowed_providers=["beta"], default_alias="ethen/cheap")
        # no model: the project's default alias routes it, within its allowed providers
        r = _post(lv, key, {"messages": MSG})
        assert r.status_code == 200, r.text
        routing = r.json()["ethen"]["routing"]
        assert routing["requested_model"] == "ethen/cheap" and routing["selected_provider"] == "beta"
        ids = [m.id for m in lv.client(key).models.list().data]
        assert "beta-small" in ids and "ethen/cheap" in ids and "alpha-large" not in ids
        assert "alpha-large" in [m.id for m in lv.client(CLIENT_KEY).models.list().data]
        r = _post(lv, key, {"model": "alpha-large", "messages": MSG})
        assert r.status_code == 422
        reasons = {x["candidate"]: x["reasons"] for x in r.json()["error"]["rejections"]}
        assert "provider_not_allowed" in reasons["alpha/alpha-large"]


def _tight(lv: Any, body: dict[str, Any]) -> float:
    """The estimate for ``body`` (a concrete model, max_tokens 3); the upstream then reports exactly it."""
    r = httpx.post(
        f"{lv.base_url}/routing/explain", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"}
    ).json()
    lv.script.behaviors["up-alpha-large"] = Behavior(
        latency_s=0.05, prompt_tokens=r["requirements"]["estimated_input_tokens"]
    )
    est: float = r["chain"][0]["estimated_cost_usd"]
    return est


def test_one_project_cannot_spend_or_read_another_projects_budget(db_url: str) -> None:
    with live_store(db_url) as lv:
        body = {"model": "alpha-large", "messages": MSG, "max_tokens": 3}
        est = _tight(lv, body)
        key_a = new_project_key(lv, "a", budget_usd=est * 2.5, budget_window="day")
        key_b = new_project_key(lv, "b", budget_usd=est * 2.5, budget_window="day")
        codes = [_post(lv, key_a, body).status_code for _ in range(2)]
        assert codes == [200, 200]
        last = _post(lv, key_a, body)
        assert last.status_code == 402 and last.json()["error"]["code"] == "budget_exceeded"
        assert "over_project_budget" in last.text
        # b's budget is untouched by a's spend
        assert _post(lv, key_b, body).status_code == 200
        with admin(lv) as a:
            pa, pb = a.get("/projects/a").json(), a.get("/projects/b").json()
            assert pa["window"]["settled_usd"] > pb["window"]["settled_usd"] > 0
            assert pa["window"]["reserved_usd"] == 0 == pb["window"]["reserved_usd"]
            usage = a.get("/usage", params={"project": "b"}).json()["data"]
            assert [(u["project"], u["requests"]) for u in usage] == [("b", 1)]
        # a project key is not an admin key: it cannot read any project's budget or usage
        with admin(lv, key=key_a) as a:
            for path in ("/projects/b", "/projects/a", "/usage", "/projects"):
                assert a.get(path).status_code == 401
        # raising a's budget through the admin API lets it spend again
        with admin(lv) as a:
            assert a.patch("/projects/a", json={"budget_usd": est * 10}).status_code == 200
        assert _post(lv, key_a, body).status_code == 200


def test_100_concurrent_requests_never_overspend(db_url: str) -> None:
    body = {"model": "alpha-large", "messages": MSG, "max_tokens": 3}
    with live_store(db_url) as lv:
        est = _tight(lv, body)
        budget = est * 10.5
        key = new_project_key(lv, "race", budget_usd=budget, budget_window="month")

        async def fire() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(timeout=30, limits=limits) as c:
                return list(
                    await asyncio.gather(
                        *(
                            c.post(
                                f"{lv.base_url}/chat/completions",
                                json=body,
                                headers={"authorization": f"Bearer {key}", "x-request-id": f"race-{i}"},
                            )
                            for i in range(100)
                        )
                    )
                )

        responses = asyncio.run(fire())
        ok = [x for x in responses if x.status_code == 200]
        rejected = [x for x in responses if x.status_code == 402]
        assert len(ok) + len(rejected) == 100, {x.status_code for x in responses}
        assert all(x.json()["error"]["code"] == "budget_exceeded" for x in rejected)
        assert 1 <= len(ok) <= 10

        async def check(st: Store) -> tuple[float, int]:
            p = await st.get_project("race")
            spend = await st.spend(p)
            rows = await st.usage(project="race")
            return spend.settled_usd, sum(u.requests for u in rows)

        settled, entries = with_store(db_url, check)
        left = held_reserved(lv, "race")  # every hold settled or released
        print(f"race: {len(ok)}/100 admitted, settled ${settled:.6f} of a ${budget:.6f} budget")
        assert settled <= budget
        assert entries == len(ok) and left == 0
        assert settled == pytest.approx(len(ok) * est, rel=1e-6)


def test_stream_settles_before_done(db_url: str) -> None:
    with live_store(db_url) as lv:
        key = new_project_key(lv, "s", budget_usd=1.0)
        chunks = list(
            lv.client(key).chat.completions.create(
                model="beta-small",
                messages=MSG,
                stream=True,  # type: ignore[arg-type]
            )
        )
        assert chunks
        rows = with_store(lv.cfg.store.url, lambda st: st.usage(project="s"))  # type: ignore[union-attr]
        assert [(r.model, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [
            ("beta-small", 1, 11, 3)
        ]


def test_live_certification_flow(db_url: str, tmp_path: Path) -> None:
    body = {"model": "ethen/cheap", "messages": MSG, "metadata": {"routing": {"certification_level": "live"}}}
    with live_store(db_url) as lv:
        key = new_project_key(lv, "c")
        r = _post(lv, key, body)
        assert r.status_code == 422
        assert all("no_live_certification" in x["reasons"] for x in r.json()["error"]["rejections"])
        cfg = tmp_path / "gw.toml"
        write_toml(config_dict(lv.upstream.url), cfg)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ethen",
                "certify",
                "alpha/alpha-large",
                "--config",
                str(cfg),
                "--db",
                db_url,
                "--valid-for",
                "1h",
            ],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr
        assert PROVIDER_KEY not in out.stdout + out.stderr
        assert lv.script.calls[-1]["body"]["model"] == "up-alpha-large"  # the probe went upstream
        r = _post(lv, key, body)
        assert r.status_code == 200, r.text
        routing = r.json()["ethen"]["routing"]
        assert routing["selected_model"] == "alpha-large"
        with admin(lv) as a:
            (receipt,) = a.get("/certifications").json()["data"]
        assert receipt["provider"] == "alpha" and receipt["probe"]["status"] == "ok"
        assert PROVIDER_KEY not in str(receipt)
        # an unknown target and a failing probe store nothing and exit non-zero
        bad = subprocess.run(
            [sys.executable, "-m", "ethen", "certify", "alpha/nope", "--config", str(cfg), "--db", db_url],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert bad.returncode == 2 and "alpha/nope" in bad.stderr
        lv.script.behaviors["up-beta-small"] = Behavior(fail_status=500)
        failed = subprocess.run(
            [
                sys.executable,
                "-m",
                "ethen",
                "certify",
                "beta/beta-small",
                "--config",
                str(cfg),
                "--db",
                db_url,
            ],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert failed.returncode == 1 and "probe failed" in failed.stderr
        assert len(with_store(db_url, lambda st: st.certifications())) == 1


def test_admin_api_validation_and_auth(db_url: str) -> None:
    with live_store(db_url) as lv:
        with admin(lv) as a:
            assert a.post("/projects", json={"name": "x", "budget_window": "week"}).status_code == 400
            r = a.post("/projects", json={"name": "x", "budget_usd": "ten"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "budget_usd"
            r = a.post("/projects", json={"name": "x", "colour": "red"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
            for huge in (b"1" + b"0" * 400, b"1e300"):  # beyond the float range / the BIGINT of nano-USD
                r = a.post("/projects", content=b'{"name": "x", "budget_usd": ' + huge + b"}")
                assert r.status_code == 400, r.text
            assert a.post("/projects", json={"name": "x"}).status_code == 201
            assert a.post("/projects", json={"name": "x"}).status_code == 409
            assert a.get("/projects/ghost").status_code == 404
            assert a.get("/usage", params={"since": "yesterday"}).status_code == 400
            assert a.get("/usage", params={"since": "2026-01-01", "until": "2027-01-01"}).status_code == 200
        with admin(lv, key="wrong-admin-key") as a:
            r = a.get("/projects")
            assert r.status_code == 401 and "wrong-admin-key" not in r.text
        assert httpx.get(f"{lv.gateway.url}/api/admin/v1/projects").status_code == 401


def test_no_key_material_in_logs_receipts_or_errors(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with live_store(db_url) as lv:
        key = new_project_key(lv, "sec", budget_usd=0.0)
        texts = [
            _post(lv, key, {"model": "beta-small", "messages": MSG}).text,  # 402
            _post(lv, key[:-2] + "zz", {"model": "beta-small", "messages": MSG}).text,  # 401
        ]
        with admin(lv) as a:
            texts += [a.get("/projects/sec/keys").text, a.get("/projects").text]
            key2 = a.post("/projects", json={"name": "sec2"}).status_code and new_project_key(lv, "sec3")
        texts.append(_post(lv, key2, {"model": "beta-small", "messages": MSG}).text)  # receipt
        rows = with_store(db_url, lambda st: st.list_keys())
    blob = "\n".join(texts) + caplog.text + str(rows)
    for secret in (key, _secret(key), _secret(key2), ADMIN_KEY, PROVIDER_KEY):
        assert secret not in blob
    assert "budget_exceeded" in texts[0] and "invalid_api_key" in texts[1]


def test_bad_store_config_names_the_key(tmp_path: Path) -> None:
    from ethen.app import create_app
    from ethen.gateway.config import parse_config
    from ethen.gateway.errors import GatewayConfigError

    base = config_dict("http://127.0.0.1:9")
    with pytest.raises(GatewayConfigError, match=r"store\.url: .*unsupported backend 'mysql'"):
        create_app(parse_config({**base, "store": {"url": "mysql://u:pw@h/db"}}), env=ENV)
    with pytest.raises(GatewayConfigError, match=r"store: set exactly one of store\.url and store\.url_env"):
        parse_config({**base, "store": {}})
    with pytest.raises(GatewayConfigError, match="'NO_SUCH_VAR': variable is not set"):
        create_app(parse_config({**base, "store": {"url_env": "NO_SUCH_VAR"}}), env=ENV)
    with pytest.raises(GatewayConfigError, match="api_keys = \\[\\]"):
        parse_config({**base, "api_keys": []})
    sq = {"url": f"sqlite:///{tmp_path}/x.db"}
    with pytest.raises(GatewayConfigError, match=r"store\.lease_s = 0\.5: .*greater than or equal to 1"):
        parse_config({**base, "store": {**sq, "lease_s": 0.5}})
    with pytest.raises(GatewayConfigError, match=r"store\.lease_s = 'abc': .*valid number"):
        parse_config({**base, "store": {**sq, "lease_s": "abc"}})
    with pytest.raises(GatewayConfigError, match=r"store\.instance_id = 'bad id!': .*pattern"):
        parse_config({**base, "store": {**sq, "instance_id": "bad id!"}})
    with pytest.raises(GatewayConfigError,
                       match=r"store\.sqlite_synchronous = 'OFF': .*'FULL', 'NORMAL' or 'EXTRA'"):
        parse_config({**base, "store": {**sq, "sqlite_synchronous": "OFF"}})
    full = parse_config({**base, "store": {**sq, "sqlite_synchronous": "FULL"}}).store
    assert full is not None and full.sqlite_synchronous == "FULL"
    with pytest.raises(GatewayConfigError,
                       match=r"store\.postgres_synchronous_commit = 'local': .*'on' or 'off'"):
        parse_config({**base, "store": {**sq, "postgres_synchronous_commit": "local"}})
    on = parse_config({**base, "store": {**sq, "postgres_synchronous_commit": "on"}}).store
    assert on is not None and on.postgres_synchronous_commit == "on"
    default = parse_config({**base, "store": sq}).store  # off by default, like SQLite's NORMAL
    assert default is not None and default.postgres_synchronous_commit == "off"
    from ethen.gateway.accounting.accounts import accounts_for
    from ethen.gateway.accounting.auth import KeyRing

    built = accounts_for(parse_config({**base, "store": {**sq, "postgres_synchronous_commit": "on"}}),
                         KeyRing([]), ENV)
    assert built.postgres_synchronous_commit == "on"  # what Accounts.start opens the store with
    by_default = accounts_for(parse_config({**base, "store": sq}), KeyRing([]), ENV)
    assert by_default.postgres_synchronous_commit == "off"
    # with a store, config keys are optional (project keys come from the database)
    cfg = parse_config({**base, "api_keys": [], "store": {"url": f"sqlite:///{tmp_path}/x.db"}})
    assert cfg.store is not None and cfg.api_keys == []
    assert cfg.store.sqlite_synchronous == "NORMAL"  # the default (ethen.store.sqlite_writer)


def test_client_gone_mid_stream_settles_the_estimate_and_releases(db_url: str) -> None:
    with live_store(db_url, {"up-beta-small": Behavior(chunk_delay_s=0.3, pieces=("a",) * 20)}) as lv:
        key = new_project_key(lv, "gone", budget_usd=1.0)
        body = {"model": "beta-small", "messages": MSG, "stream": True}
        with (
            httpx.Client(timeout=10) as c,
            c.stream(
                "POST",
                f"{lv.base_url}/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
            ) as r,
        ):
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk, then hang up

        deadline = time.monotonic() + 10
        while True:
            rows = with_store(db_url, lambda st: st.usage(project="gone"))
            left = held_reserved(lv, "gone")
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(x.model, x.requests) for x in rows] == [("beta-small", 1)] and rows[0].cost_usd > 0
        assert left == 0


def test_incredible_upstream_usage_settles_the_estimate(db_url: str) -> None:
    """An upstream reporting 10^14 tokens (beyond twice the model's window) is answered, not a 500; the ledger
    gets the request's estimate, as when no usage is reported."""
    body = {"model": "alpha-large", "messages": MSG, "max_tokens": 3}
    with live_store(db_url, {"up-alpha-large": Behavior(prompt_tokens=10**14)}) as lv:
        key = new_project_key(lv, "liar", budget_usd=1.0)
        est = _post(lv, CLIENT_KEY, body).json()["ethen"]["routing"]["estimated_cost_usd"]
        r = _post(lv, key, body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 10**14  # the upstream's answer is passed on as it is
        rows = with_store(db_url, lambda st: st.usage(project="liar"))
        assert [(x.requests, x.prompt_tokens, x.completion_tokens) for x in rows] == [(1, 0, 0)]
        assert rows[0].cost_usd == pytest.approx(est, rel=1e-6)


def test_client_gone_before_the_first_byte_settles_and_releases(db_url: str) -> None:
    """The client hangs up while the gateway still waits for the upstream's first chunk: once the upstream
    answers, the request is settled (estimate) and its reservation released, not held until it expires."""
    with live_store(db_url, {"up-beta-small": Behavior(ttft_s=1.0, pieces=("a",) * 5)}) as lv:
        key = new_project_key(lv, "early", budget_usd=1.0)
        body = {"model": "beta-small", "messages": MSG, "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{lv.base_url}/chat/completions", json=body,
                       headers={"authorization": f"Bearer {key}"}, timeout=0.3)

        deadline = time.monotonic() + 10
        while True:
            rows = with_store(db_url, lambda st: st.usage(project="early"))
            left = held_reserved(lv, "early")
            if (rows and left == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(x.model, x.requests) for x in rows] == [("beta-small", 1)] and rows[0].cost_usd > 0
        assert left == 0
