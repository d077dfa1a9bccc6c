"""Several real ``ethen gateway`` processes sharing one Redis (issue 11, N instances): telemetry (the failing
gate, a successful trial, canary acceptance) reaches every instance within 1 s; an RPM limit is exact across
three instances; Redis stopped mid-run and restarted; ``--workers 2``. Needs ``ETHEN_TEST_REDIS_URL`` (``bash
.ci/redis.sh``); the Redis-outage test starts its own ``redis-server`` (skipped when it is not installed)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.store import Store
from ethen.store import schema as s
from tests.gateway.accounting.test_ratelimit import LIMITED_KEY, keys, redis_url_or_skip
from tests.gateway.api.test_service_cli import free_port, write_toml
from tests.gateway.budget_harness import with_store
from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

USER = [{"role": "user", "content": "hi"}]
NO_TRIALS = {"probe": False, "cooldown_s": 300, "max_cooldown_s": 300}


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api/gateway/v1"


def start(cfg: Path, port: int, log: Path, *extra: str, timeout_s: float = 120) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ethen", "gateway", "--config", str(cfg), "--port", str(port), *extra],
        env={**os.environ, **ENV},
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                if httpx.get(f"{_url(port)}/healthz", timeout=1).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise


@contextmanager
def instances(cfgs: list[Path], tmp_path: Path) -> Iterator[list[int]]:
    ports = [free_port() for _ in cfgs]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, (cfg, port) in enumerate(zip(cfgs, ports, strict=True)):
            procs.append(start(cfg, port, tmp_path / f"gw{i}.log"))
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)


def shared_cfg(url: str) -> dict[str, Any]:
    return {"redis_url": url, "key_prefix": f"t{uuid.uuid4().hex[:10]}", "timeout_s": 0.3}


def post(port: int, path: str, key: str = CLIENT_KEY, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{_url(port)}{path}", json={"messages": USER, **body}, headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )  # fmt: skip


def wait_for(check: Any, limit_s: float) -> float:
    """Seconds until ``check()`` holds (polled every 20 ms), failing after ``limit_s``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < limit_s, f"not within {limit_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def excluded(port: int) -> bool:
    r = post(port, "/routing/explain", model="beta-small")
    return r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_candidate"


def test_failures_trials_and_canary_samples_reach_every_instance_within_a_second(tmp_path: Path) -> None:
    url = redis_url_or_skip()
    script = Script(behaviors={"up-beta-small": Behavior(fail_status=500)})
    canary = {"alias": "ethen/auto", "candidate": "gamma/gamma-claude", "percent": 0, "min_samples": 3,
              "min_success_rate": 1.0}  # fmt: skip
    with ServerThread(make_upstream_app(script)) as up:
        sh = shared_cfg(url)
        cfgs = []
        for name, circuit in (("a", {"probe": False, "cooldown_s": 1.0, "max_cooldown_s": 1.0}),
                              ("b", NO_TRIALS), ("c", NO_TRIALS)):  # fmt: skip
            cfgs.append(tmp_path / f"{name}.toml")
            write_toml(config_dict(up.url, shared=sh, circuit=circuit, canaries=[canary]), cfgs[-1])
        with instances(cfgs, tmp_path) as (a, b, c):
            assert not excluded(b) and not excluded(c)
            for _ in range(3):  # three failures through A
                assert post(a, "/chat/completions", model="beta-small").status_code == 502
            waited = [wait_for(lambda p=p: excluded(p), 1.0) for p in (b, c)]  # type: ignore[misc]
            assert script.models_called().count("up-beta-small") == 3  # B, C: no call
            print(f"excluded on B and C after {waited[0]:.3f} s / {waited[0] + waited[1]:.3f} s")

            # canary acceptance (3 successful samples, all through A) is met on B
            def acceptance(port: int) -> bool:
                r = post(port, "/routing/explain", model="ethen/auto")
                return bool(r.json()["receipt"]["canary"]["acceptance_met"])

            assert not acceptance(b)
            for _ in range(3):
                assert post(a, "/chat/completions", model="gamma-claude").status_code == 200
            wait_for(lambda: acceptance(b), 1.0)

            # the upstream recovers; A's trial (its cool-down is 1 s) succeeds: B and C (whose own circuits
            # wait 300 s and never probe) route to it again within 1 s of that success
            script.behaviors["up-beta-small"].fail_status = None
            wait_for(lambda: post(a, "/chat/completions", model="beta-small").status_code == 200, 5.0)
            for p in (b, c):
                wait_for(lambda p=p: not excluded(p), 1.0)  # type: ignore[misc]


def test_a_run_of_failures_after_successes_opens_and_a_trial_closes_on_every_instance(tmp_path: Path) -> None:
    """Issue 42 item 1 with [shared]: a provider that had served (5 successes, through A) then fails 3 times
    (through A) is excluded on B too (the run of failures is counted over every instance's records), and
    A's successful trial drops the outage's failures on B as well (the shared "forget"): B, whose own circuit
    never trials, routes to it again and ranks it as before the outage (reliability over 6 successes, the 3
    failures gone)."""
    url = redis_url_or_skip()
    beta = Behavior()
    script = Script(behaviors={"up-beta-small": beta})
    with ServerThread(make_upstream_app(script)) as up:
        sh = shared_cfg(url)
        cfgs = []
        for name, circuit in (("a", {"probe": False, "cooldown_s": 1.0, "max_cooldown_s": 1.0}),
                              ("b", NO_TRIALS)):  # fmt: skip
            cfgs.append(tmp_path / f"{name}.toml")
            write_toml(config_dict(up.url, shared=sh, circuit=circuit), cfgs[-1])
        with instances(cfgs, tmp_path) as (a, b):
            for _ in range(5):
                assert post(a, "/chat/completions", model="beta-small").status_code == 200
            beta.fail_status = 500
            for _ in range(3):
                assert post(a, "/chat/completions", model="beta-small").status_code == 502
            wait_for(lambda: excluded(b), 1.0)  # before: never (5 successes in the window)
            beta.fail_status = None
            wait_for(lambda: post(a, "/chat/completions", model="beta-small").status_code == 200, 5.0)

            def reliability(port: int) -> float | None:
                r = post(port, "/routing/explain", model="beta-small")
                if r.status_code != 200:
                    return None
                return float(r.json()["receipt"]["score_components"]["reliability"])

            wait_for(lambda: reliability(b) == round((6 + 9) / (6 + 10), 4), 1.0)  # Beta(9, 1) over 6/6


def test_rpm_limit_is_exact_across_three_instances(tmp_path: Path) -> None:
    url = redis_url_or_skip()
    script = Script()
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        limits = {"window_s": 60}
        data = config_dict(up.url, shared=shared_cfg(url), api_keys=keys(rpm=60), rate_limits=limits)
        write_toml(data, cfg)
        with instances([cfg, cfg, cfg], tmp_path) as ports:
            codes: list[int] = []
            bad: list[str] = []
            lock = threading.Lock()

            def worker(w: int) -> None:
                with httpx.Client(timeout=10) as client:
                    for i in range(10):  # 9 threads x 10 = 90 requests, round-robin over the instances
                        r = client.post(
                            f"{_url(ports[(w + i) % 3])}/chat/completions",
                            json={"model": "beta-small", "messages": USER},
                            headers={"authorization": f"Bearer {LIMITED_KEY}"},
                        )
                        with lock:
                            codes.append(r.status_code)
                            if (r.status_code == 429 and (
                                r.json()["error"]["code"] != "rate_limit_exceeded"
                                or int(r.headers["retry-after"]) < 1
                            )) or r.status_code not in (200, 429):
                                bad.append(r.text)

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(9)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    assert not bad, bad[:3]
    assert codes.count(200) == 60 and codes.count(429) == 30  # all 90 within one minute: exactly the limit
    assert len(script.calls) == 60  # a refused request never reached the upstream


@contextmanager
def redis_server(port: int, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (bash .ci/redis.sh installs it)")
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    try:
        wait_for(lambda: _pings(client), 10.0)
        yield proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def _pings(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def test_redis_stopped_mid_run_then_back(tmp_path: Path) -> None:
    if not os.environ.get("ETHEN_TEST_REDIS_URL"):
        redis_url_or_skip()
    rport = free_port()
    script = Script()
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        sh = {"redis_url": f"redis://127.0.0.1:{rport}/0", "timeout_s": 0.3}
        write_toml(config_dict(up.url, shared=sh, api_keys=keys(rpm=10_000), circuit=NO_TRIALS), cfg)
        seen: list[int] = []

        def both(port: int) -> tuple[int, int]:
            lim = post(port, "/chat/completions", LIMITED_KEY, model="beta-tools")
            free = post(port, "/chat/completions", model="beta-tools")
            seen.extend((lim.status_code, free.status_code))
            if lim.status_code == 503:
                assert lim.json()["error"]["code"] == "rate_limiter_unavailable"
                assert lim.headers["retry-after"] == "1"
            return lim.status_code, free.status_code

        with redis_server(rport, tmp_path) as first, instances([cfg, cfg], tmp_path) as (a, b):
            assert both(a) == both(b) == (200, 200)
            first.terminate()
            first.wait(10)
            for _ in range(5):  # Redis gone: limited keys fail closed, keys without a limit are served
                assert both(a) == both(b) == (503, 200)
            with redis_server(rport, tmp_path):
                took = wait_for(lambda: both(a) == both(b) == (200, 200), 5.0)  # no restart needed
                print(f"rate limits back {took:.2f} s after Redis")
                # shared telemetry is back too: failures through A exclude the candidate on B
                script.behaviors["up-beta-small"] = Behavior(fail_status=500)
                deadline = time.monotonic() + 10
                while not excluded(b):  # the reader reconnects within its 2 s back-off
                    assert time.monotonic() < deadline
                    assert post(a, "/chat/completions", model="beta-small").status_code in (502, 503)
                    time.sleep(0.3)
    assert 500 not in seen


def test_workers_2_serve_as_two_instances(tmp_path: Path) -> None:
    url = redis_url_or_skip()
    db = f"sqlite:///{tmp_path / 'gw.db'}"
    script = Script()
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        store = {"url": db, "instance_id": "gw", "admin_key_sha256": hashlib.sha256(b"x").hexdigest()}
        data = config_dict(up.url, shared=shared_cfg(url), api_keys=keys(rpm=10), store=store,
                           rate_limits={"window_s": 60})  # fmt: skip
        write_toml(data, cfg)
        port = free_port()
        parent = start(cfg, port, tmp_path / "workers.log", "--workers", "2", timeout_s=90)  # 2 start at once
        try:
            children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
            wait_for(lambda: len(children.read_text().split()) == 2, 30.0)
            pids = children.read_text().split()
            codes = [post(port, "/chat/completions", LIMITED_KEY, model="beta-small").status_code
                     for _ in range(16)]  # fmt: skip  (a new connection each: either worker may accept)
            assert codes.count(200) == 10 and codes.count(429) == 6  # one limit across the two workers

            async def live_instances(st: Store) -> list[str]:
                from sqlalchemy import select

                async with st.engine.connect() as conn:
                    rows = await conn.execute(select(s.gateway_instances.c.instance_id))
                    return sorted(r[0] for r in rows)

            wait_for(lambda: with_store(db, live_instances) == ["gw-w0", "gw-w1"], 10.0)  # two leases
            os.kill(int(pids[0]), signal.SIGKILL)  # a worker dies: the other serves, the parent restarts it
            assert post(port, "/chat/completions", model="beta-small").status_code == 200
            wait_for(lambda: len(set(children.read_text().split()) - set(pids)) == 1, 10.0)
        finally:
            parent.send_signal(signal.SIGTERM)
            parent.wait(30)
        assert parent.returncode == 0
        assert not children.exists() or not children.read_text().split()
