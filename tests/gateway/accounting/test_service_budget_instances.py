"""Several real ``ethen gateway`` processes on one database (issue 11, without Redis): a second instance
started during load on a small budget, and a rolling restart, leave overspend at exactly 0; every refusal
is a 402 ``budget_exceeded``; a key revoked through one instance is refused by the other within 1 s."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ethen.store import Store
from ethen.store.values import to_nano
from tests.gateway.accounting.test_service_budget_crash import _start
from tests.gateway.api.test_service_cli import free_port, write_toml
from tests.gateway.budget_harness import ADMIN_KEY, ADMIN_PREFIX, db_url, store_cfg, with_store
from tests.gateway.service_harness import CLIENT_KEY, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

__all__ = ["db_url"]
BODY = {"model": "alpha-large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api/gateway/v1"


def test_second_instance_and_rolling_restart_during_load_never_overspend(db_url: str, tmp_path: Path) -> None:
    script = Script(default=Behavior(latency_s=0.25), record=False)
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        write_toml(
            config_dict(
                up.url,
                store={**store_cfg(db_url), "lease_s": 3.0},
                timeouts={"connect_s": 5.0, "first_byte_s": 20.0, "total_s": 30.0},  # a loaded machine
            ),
            cfg,
        )
        ports = [free_port(), free_port()]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        procs: list[Any] = [_start(cfg, ports[0], logs[0]), None]
        try:
            r = httpx.post(
                f"{_url(ports[0])}/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {CLIENT_KEY}"},
                timeout=10,
            )
            est = r.json()["ethen"]["routing"]["estimated_cost_usd"]
            budget = est * 600.5  # ~20 s of this load: spans the second start and the rolling restart

            async def setup(st: Store) -> str:
                await st.create_project("shared", budget_usd=budget, budget_window="day")
                key, _ = await st.create_key("shared")
                return key

            key = with_store(db_url, setup)
            codes: dict[int, int] = {}
            served_after: dict[str, int] = {"joined": 0, "restarted": 0}
            marks: dict[str, float] = {}
            bad: list[str] = []
            stop = threading.Event()
            lock = threading.Lock()

            def worker(w: int) -> None:
                refused = 0
                with httpx.Client(timeout=10) as c:
                    for i in range(400):  # bounded; a worker stops after 10 refusals in a row
                        if stop.is_set() or refused >= 10:
                            return
                        port = ports[(w + i) % 2]
                        try:
                            res = c.post(
                                f"{_url(port)}/chat/completions",
                                json=BODY,
                                headers={"authorization": f"Bearer {key}"},
                            )
                        except httpx.TransportError:
                            time.sleep(0.05)  # that instance is (re)starting
                            continue
                        refused = refused + 1 if res.status_code == 402 else 0
                        with lock:
                            codes[res.status_code] = codes.get(res.status_code, 0) + 1
                            code = res.json()["error"]["code"] if res.status_code != 200 else None
                            if res.status_code not in (200, 402) or code not in (None, "budget_exceeded"):
                                bad.append(res.text)
                            for mark in marks:
                                served_after[mark] += res.status_code == 200

            threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(8)]
            for t in threads:
                t.start()
            time.sleep(0.4)
            procs[1] = _start(cfg, ports[1], logs[1])  # a second instance joins during load
            marks["joined"] = time.monotonic()
            time.sleep(0.4)
            for i in (0, 1):  # rolling restart: one instance at a time, the other keeps its grant
                procs[i].terminate()
                procs[i].wait(15)
                procs[i] = _start(cfg, ports[i], logs[i])
                marks.setdefault("restarted", time.monotonic())  # the first instance is back
            for t in threads:
                t.join(60)
            stop.set()

            async def check(st: Store) -> tuple[float, int]:
                spend = await st.spend(await st.get_project("shared"))
                rows = await st.usage(project="shared")
                return spend.settled_usd, sum(u.requests for u in rows)

            settled, entries = with_store(db_url, check)
        finally:
            for p in procs:
                if p is not None and p.poll() is None:
                    p.terminate()
                    p.wait(15)
    print(
        f"two instances: {codes}, served after join/restart {served_after}, settled ${settled:.6f} of "
        f"${budget:.6f}"
    )
    assert not bad, bad[:3]
    assert codes.get(402, 0) > 0  # the budget ran out during the run
    assert entries == codes.get(200, 0) >= 100
    assert served_after["joined"] > 0 and served_after["restarted"] > 0  # load spanned both events
    assert to_nano(settled) <= to_nano(budget)  # overspend exactly 0


def test_key_revoked_through_one_instance_is_refused_by_the_other_within_a_second(
    db_url: str, tmp_path: Path
) -> None:
    with ServerThread(make_upstream_app(Script(record=False))) as up:
        cfg = tmp_path / "gw.toml"
        write_toml(config_dict(up.url, store=store_cfg(db_url)), cfg)
        ports = [free_port(), free_port()]
        procs = [_start(cfg, p, tmp_path / f"{p}.log") for p in ports]
        try:
            with httpx.Client(
                base_url=f"{_url(ports[0])[: -len('/api/gateway/v1')]}{ADMIN_PREFIX}",
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
                timeout=10,
            ) as a:
                assert a.post("/projects", json={"name": "p", "budget_usd": 1.0}).status_code == 201
                created = a.post("/projects/p/keys", json={}).json()
                key = created["key"]
                for port in ports:  # both instances have the key cached
                    r = httpx.post(
                        f"{_url(port)}/chat/completions",
                        json=BODY,
                        headers={"authorization": f"Bearer {key}"},
                        timeout=10,
                    )
                    assert r.status_code == 200, r.text
                assert a.delete(f"/keys/{created['key_id']}").status_code == 200
            t0 = time.monotonic()
            while True:
                r = httpx.post(
                    f"{_url(ports[1])}/chat/completions",
                    json=BODY,
                    headers={"authorization": f"Bearer {key}"},
                    timeout=10,
                )
                if r.status_code == 401:
                    break
                assert time.monotonic() - t0 < 3, "the other instance still accepts the revoked key"
                time.sleep(0.02)
            elapsed = time.monotonic() - t0
            r = httpx.post(
                f"{_url(ports[0])}/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {key}"},
                timeout=10,
            )
            assert r.status_code == 401  # the instance that revoked it: at once
        finally:
            for p in procs:
                p.terminate()
                p.wait(15)
    assert elapsed < 1.0, elapsed
