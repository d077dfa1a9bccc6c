"""Rate limits over real HTTP (gateway and scripted upstream on 127.0.0.1): requests and tokens per window,
per config key and per store project/key, in process memory (no ``[shared]``) and in Redis
(``ETHEN_TEST_REDIS_URL``, skipped without it); 429 ``rate_limit_exceeded`` with ``Retry-After`` and no
upstream call; Redis unreachable: 503 ``rate_limiter_unavailable`` for limited keys only; config errors name
the key and the value."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.gateway.config import parse_config, shared_redis_url
from ethen.gateway.errors import GatewayConfigError
from ethen.store import Store
from tests.gateway.budget_harness import store_cfg, with_store
from tests.gateway.service_harness import CLIENT_KEY, Live, config_dict, live

LIMITED_KEY = "ethen-limited-0a1b2c3d4e5f60718293a4b5c6d7e8f9"
REDIS_ENV = "ETHEN_TEST_REDIS_URL"
USER = [{"role": "user", "content": "hi"}]


def redis_url_or_skip() -> str:
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(f"{REDIS_ENV} is not set (bash .ci/redis.sh starts a local server and prints the URL)")
    return url


def keys(**limits: int) -> list[dict[str, Any]]:
    return [
        {"name": "test", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()},
        {"name": "limited", "sha256": hashlib.sha256(LIMITED_KEY.encode()).hexdigest(), **limits},
    ]


def client(lv: Live) -> httpx.Client:
    return httpx.Client(base_url=lv.base_url, timeout=10)


def chat(c: httpx.Client, key: str, **body: Any) -> httpx.Response:
    return c.post(
        "/chat/completions",
        json={"model": "beta-small", "messages": USER, **body},
        headers={"authorization": f"Bearer {key}"},
    )


@pytest.fixture(params=["memory", "redis"])
def shared(request: pytest.FixtureRequest) -> dict[str, Any]:
    """No ``[shared]`` (per-process limits), or a Redis with a fresh key prefix."""
    if request.param == "memory":
        return {}
    return {"shared": {"redis_url": redis_url_or_skip(), "key_prefix": f"t{uuid.uuid4().hex[:10]}"}}


def test_rpm_over_the_limit_is_429_with_retry_after_and_no_upstream_call(shared: dict[str, Any]) -> None:
    with live(api_keys=keys(rpm=3), rate_limits={"window_s": 2.0}, **shared) as lv, client(lv) as c:
        t0 = time.monotonic()
        assert [chat(c, LIMITED_KEY).status_code for _ in range(3)] == [200, 200, 200]
        calls = len(lv.script.calls)
        r = chat(c, LIMITED_KEY)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert "key 'limited'" in err["message"] and "limit 3" in err["message"]
        retry = int(r.headers["retry-after"])
        assert 1 <= retry <= 2 and err["retry_after_s"] == retry
        assert len(lv.script.calls) == calls  # refused before any upstream call
        assert chat(c, CLIENT_KEY).status_code == 200  # a key without a limit is not held back
        # the window slides: the first requests leave it 2 s after they were admitted
        time.sleep(max(0.0, t0 + 2.1 - time.monotonic()))
        assert chat(c, LIMITED_KEY).status_code == 200


def test_tpm_admits_on_the_estimate_and_corrects_with_the_usage(shared: dict[str, Any]) -> None:
    # the upstream reports 11 prompt + 3 completion tokens; the estimate is the input + max_tokens (~79)
    with live(api_keys=keys(tpm=100), **shared) as lv, client(lv) as c:
        r = chat(c, LIMITED_KEY, max_tokens=70)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 14
        # two estimates (~2 x 79) would exceed 100; the first one was corrected to its 14 tokens
        deadline = time.monotonic() + 2
        while (r := chat(c, LIMITED_KEY, max_tokens=70)).status_code == 429:  # the correction is async
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert r.status_code == 200
        r = chat(c, LIMITED_KEY, max_tokens=70)
        assert r.status_code == 429, r.text  # 28 used + ~79 estimated > 100
        assert r.json()["error"]["type"] == "tokens" and int(r.headers["retry-after"]) >= 1
        big = chat(c, LIMITED_KEY, max_tokens=500)  # larger than the limit itself: no wait would do
        assert big.status_code == 429 and "Request too large" in big.json()["error"]["message"]


def test_store_project_and_key_limits(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'gw.db'}"

    async def setup(st: Store) -> tuple[str, str, str]:
        await st.create_project("acme", budget_usd=None, budget_window="day")
        k1, _ = await st.create_key("acme")
        k2, info = await st.create_key("acme")
        return k1, k2, info.key_id

    k1, k2, k2_id = with_store(db, setup)
    limits = {"window_s": 30.0, "projects": {"acme": {"rpm": 4}}, "keys": {k2_id: {"rpm": 1}}}
    with live(store=store_cfg(db), rate_limits=limits) as lv, client(lv) as c:
        assert chat(c, k2).status_code == 200
        r = chat(c, k2)  # its key's own limit (1)
        assert r.status_code == 429 and f"key {k2_id!r}" in r.json()["error"]["message"]
        assert [chat(c, k1).status_code for _ in range(4)] == [200, 200, 200, 429]  # the project's 4
        assert "project 'acme'" in chat(c, k1).json()["error"]["message"]
        assert chat(c, CLIENT_KEY).status_code == 200  # a config key acts for no project


def test_redis_unreachable_fails_closed_for_limited_keys_only() -> None:
    with socket_nobody_listens() as url, live(
        api_keys=keys(rpm=100), shared={"redis_url": url, "timeout_s": 0.3}
    ) as lv, client(lv) as c:
        r = chat(c, LIMITED_KEY)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "rate_limiter_unavailable"
        assert r.headers["retry-after"] == "1" and url not in r.text
        assert chat(c, CLIENT_KEY).status_code == 200  # no limit: served, telemetry stays local
        assert len(lv.script.calls) == 1


class socket_nobody_listens:
    """A redis:// URL on a port nothing listens on (bound, never listening: connections are refused)."""

    def __enter__(self) -> str:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"shared": {}}, "set exactly one of shared.redis_url and shared.redis_url_env"),
        ({"shared": {"redis_url": "http://x"}}, "shared.redis_url = 'http://x'"),
        ({"shared": {"redis_url": "redis://h", "timeout_s": 0}}, "shared.timeout_s = 0"),
        ({"rate_limits": {"window_s": -1}}, "rate_limits.window_s = -1"),
        ({"rate_limits": {"projects": {"p": {"rpm": 0}}}}, "rate_limits.projects.p.rpm = 0"),
        ({"api_keys": keys(rpm=-5)}, "api_keys[1].rpm = -5"),
        (
            {"api_keys": [*keys(rpm=5), {"name": "limited", "sha256": "ab" * 32}]},
            "api_keys[2].name = 'limited': duplicate name (also api_keys[1])",
        ),
    ],
)
def test_config_errors_name_the_key_and_value(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(GatewayConfigError) as ei:
        parse_config(config_dict("http://127.0.0.1:1", **patch))
    assert message in ei.value.message


def test_redis_url_env() -> None:
    cfg = parse_config(config_dict("http://127.0.0.1:1", shared={"redis_url_env": "MY_REDIS"}))
    assert shared_redis_url(cfg, {"MY_REDIS": "redis://127.0.0.1:6379/0"}) == "redis://127.0.0.1:6379/0"
    with pytest.raises(GatewayConfigError, match=r"shared\.redis_url_env = 'MY_REDIS': variable is not set"):
        shared_redis_url(cfg, {})
    with pytest.raises(GatewayConfigError) as ei:
        shared_redis_url(cfg, {"MY_REDIS": "postgres://user:pw@h/db"})
    assert "shared.redis_url_env = 'MY_REDIS'" in ei.value.message and "pw" not in ei.value.message
