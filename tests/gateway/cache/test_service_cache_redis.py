"""The response cache's Redis backend (issue 27): two gateway instances sharing the ``[shared]`` Redis serve
each other's entries; entries expire with ``ttl_s``; an unreachable Redis is a miss, never a failure. Needs
``ETHEN_TEST_REDIS_URL`` (``bash .ci/redis.sh`` starts a local server and prints the URL)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import redis

from ethen.app import PREFIX, create_app
from ethen.gateway.config import parse_config
from tests.gateway.accounting.test_ratelimit import redis_url_or_skip
from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

BODY = {"model": "beta-small", "messages": [{"role": "user", "content": "2 + 2?"}], "temperature": 0}
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


@contextmanager
def instances(url: str, n: int, prefix: str, **cache: Any) -> Iterator[tuple[Script, list[str]]]:
    script = Script()
    with ExitStack() as stack:
        up = stack.enter_context(ServerThread(make_upstream_app(script)))
        cfg = parse_config(config_dict(up.url, shared={"redis_url": url, "key_prefix": prefix},
                                       cache={"enabled": True, "backend": "redis", **cache}))
        gws = [stack.enter_context(ServerThread(create_app(cfg, env=ENV))) for _ in range(n)]
        yield script, [f"{g.url}{PREFIX}" for g in gws]


def post(base: str, body: dict[str, Any] = BODY) -> httpx.Response:
    r = httpx.post(f"{base}/chat/completions", json=body, headers=AUTH, timeout=15)
    assert r.status_code == 200, r.text
    return r


def wait_keys(url: str, prefix: str, n: int) -> None:
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 5
    while len(list(r.scan_iter(match=f"{prefix}:cache:*"))) < n:
        assert time.monotonic() < deadline, "the entry never reached Redis"
        time.sleep(0.01)


def test_two_instances_share_entries_and_streams() -> None:
    url = redis_url_or_skip()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    with instances(url, 2, prefix) as (script, (a, b)):
        assert post(a).headers["x-ethen-cache"] == "miss"
        wait_keys(url, prefix, 1)
        r = post(b)
        assert r.headers["x-ethen-cache"] == "hit"  # stored by a, served by b
        assert r.json()["choices"][0]["message"]["content"] == "Hello from upstream"
        assert r.json()["ethen"]["routing"]["cache"]["hit"] is True
        assert post(a).headers["x-ethen-cache"] == "hit"
        stream = {**BODY, "stream": True}
        assert post(b, stream).headers["x-ethen-cache"] == "miss"
        wait_keys(url, prefix, 2)
        s = post(a, stream)
        assert s.headers["x-ethen-cache"] == "hit"
        assert s.text.endswith("data: [DONE]\n\n") and "Hello" in s.text
        assert len(script.calls) == 2
        rd = redis.Redis.from_url(url)
        ttl = rd.pttl(next(rd.scan_iter(match=f"{prefix}:cache:*")))
        assert 0 < ttl <= 300_000  # SET ... PX ttl_s
        # the gauges are measured from Redis (SCAN + STRLEN) when an instance first reads, then every 10 s:
        # b's first lookup saw a's entry
        assert gauge(b, "ethen_gateway_cache_entries") >= 1 and gauge(b, "ethen_gateway_cache_bytes") > 100


def gauge(base: str, name: str) -> float:
    deadline = time.monotonic() + 5
    while True:
        for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " ") and float(line.split()[1]) > 0:
                return float(line.split()[1])
        assert time.monotonic() < deadline, f"{name} stayed 0"
        time.sleep(0.05)


def test_redis_entries_expire_with_ttl() -> None:
    url = redis_url_or_skip()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    with instances(url, 1, prefix, ttl_s=0.5) as (script, (a,)):
        post(a)
        wait_keys(url, prefix, 1)
        assert post(a).headers["x-ethen-cache"] == "hit"
        time.sleep(0.8)
        assert post(a).headers["x-ethen-cache"] == "miss"
        assert len(script.calls) == 2


def test_unreachable_redis_is_a_miss_not_a_failure() -> None:
    with instances("redis://127.0.0.1:1/0", 1, "down") as (script, (a,)):
        for _ in range(2):
            assert post(a).headers["x-ethen-cache"] == "miss"
        assert len(script.calls) == 2
