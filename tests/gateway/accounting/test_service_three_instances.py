"""Three real ``ethen gateway`` processes on one Postgres database and one Redis (issue 11's first test): 300
concurrent requests of one project with a small budget, spread round-robin over the three, leave overspend
at exactly 0; every refused request is a 402 ``budget_exceeded`` in the OpenAI envelope and made no upstream
call; then a key revoked through instance A is refused by B and C within 1 s. Needs ``ETHEN_TEST_PG_URL``
and ``ETHEN_TEST_REDIS_URL`` (``.ci/run`` starts both); skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from ethen.store import Store
from ethen.store.values import to_nano
from tests.gateway.accounting.test_ratelimit import redis_url_or_skip
from tests.gateway.accounting.test_service_instances_redis import _url, instances, shared_cfg
from tests.gateway.api.test_service_cli import write_toml
from tests.gateway.budget_harness import ADMIN_KEY, ADMIN_PREFIX, store_cfg, with_store
from tests.gateway.service_harness import CLIENT_KEY, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app
from tests.pgdb import pg_or_skip

BODY = {"model": "alpha-large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
N = 300


async def _burst(ports: list[int], key: str) -> list[httpx.Response]:
    """N requests at once, request i to instance i % 3."""
    limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        return await asyncio.gather(*(
            c.post(f"{_url(ports[i % len(ports)])}/chat/completions", json=BODY,
                   headers={"authorization": f"Bearer {key}"})
            for i in range(N)
        ))  # fmt: skip


def _refused_after(ports: list[int], key: str, since: float, limit_s: float) -> list[float]:
    """Seconds from ``since`` until each instance first refuses ``key`` with 401 (polled in turn)."""
    first: dict[int, float] = {}
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=10) as c:
        while len(first) < len(ports):
            for port in ports:
                if port in first:
                    continue
                r = c.post(f"{_url(port)}/chat/completions", json=BODY, headers=auth)
                if r.status_code == 401:
                    assert r.json()["error"]["code"] == "invalid_api_key", r.text
                    first[port] = time.monotonic() - since
                else:
                    assert r.status_code == 200, r.text
            assert time.monotonic() - since < limit_s + 2, f"the revoked key is still accepted: {first}"
            time.sleep(0.02)
    return [first[p] for p in ports]


def test_three_instances_on_postgres_and_redis_never_overspend_and_share_a_revocation(tmp_path: Path) -> None:
    redis = redis_url_or_skip()
    script = Script(default=Behavior(latency_s=0.05), record=False)
    with pg_or_skip() as db, ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        write_toml(config_dict(up.url, store=store_cfg(db), shared=shared_cfg(redis),
                               timeouts={"connect_s": 5.0, "first_byte_s": 30.0, "total_s": 60.0}), cfg)
        with instances([cfg, cfg, cfg], tmp_path) as ports:
            r = httpx.post(f"{_url(ports[0])}/chat/completions", json=BODY,
                           headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=10)
            assert r.status_code == 200, r.text
            est = r.json()["ethen"]["routing"]["estimated_cost_usd"]
            budget = est * 100.5  # about a third of the burst fits

            async def setup(st: Store) -> tuple[str, str, str]:
                await st.create_project("tight", budget_usd=budget, budget_window="day")
                await st.create_project("free")
                tight, _ = await st.create_key("tight")
                free, info = await st.create_key("free")
                return tight, free, info.key_id

            tight, free, free_id = with_store(db, setup)
            behavior = script.default
            calls_before = behavior.calls
            responses = asyncio.run(_burst(ports, tight))
            upstream_calls = behavior.calls - calls_before

            async def check(st: Store) -> tuple[float, int]:
                spend = await st.spend(await st.get_project("tight"))
                rows = await st.usage(project="tight")
                return spend.settled_usd, sum(u.requests for u in rows)

            settled, entries = with_store(db, check)

            for port in ports[1:]:  # B and C know the free key (cached)
                assert httpx.post(f"{_url(port)}/chat/completions", json=BODY, timeout=10,
                                  headers={"authorization": f"Bearer {free}"}).status_code == 200
            admin = f"{_url(ports[0])[: -len('/api/gateway/v1')]}{ADMIN_PREFIX}"
            r = httpx.delete(f"{admin}/keys/{free_id}", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                             timeout=10)
            assert r.status_code == 200, r.text
            refused_after = _refused_after(ports[1:], free, time.monotonic(), 1.0)

    codes: dict[int, int] = {}
    bad: list[str] = []
    for res in responses:
        codes[res.status_code] = codes.get(res.status_code, 0) + 1
        if res.status_code == 402:
            err = res.json()["error"]
            if err["code"] != "budget_exceeded" or err.get("type") is None or "message" not in err:
                bad.append(res.text)
        elif res.status_code != 200:
            bad.append(res.text)
    served = codes.get(200, 0)
    print(f"three instances: {codes}, {upstream_calls} upstream calls, settled ${settled:.6f} of "
          f"${budget:.6f}; revoked key refused by B and C after {refused_after} s")
    assert not bad, bad[:3]
    assert codes.get(402, 0) > 0 and served >= 30  # the budget ran out; a good part of it was served
    assert upstream_calls == served  # no refused request reached the upstream
    assert entries == served  # every served request has its ledger entry
    assert to_nano(settled) <= to_nano(budget)  # overspend exactly 0
    assert max(refused_after) < 1.0, refused_after
