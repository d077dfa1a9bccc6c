"""Durability: kill -9 a real ``ethen gateway`` process under load, restart it: every request the client saw
succeed has its settled ledger entry (once), the dead process's budget grant stops counting when its lease
expires, and the next start-up releases it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from ethen.store import Store
from ethen.store import schema as s
from tests.gateway.api.test_service_cli import free_port, write_toml
from tests.gateway.budget_harness import db_url, store_cfg, with_store
from tests.gateway.service_harness import ENV, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

__all__ = ["db_url"]
LEASE_S = 2.0


def _start(cfg: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ethen", "gateway", "--config", str(cfg), "--port", str(port)],
        env={**os.environ, **ENV},
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120  # a start-up bound (a loaded CI machine took over 30 s)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/gateway/v1/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.1)


def test_kill_9_under_load_loses_no_settled_entry_and_leaves_no_reservation(
    db_url: str, tmp_path: Path
) -> None:
    async def setup(st: Store) -> str:
        await st.create_project("load", budget_usd=100.0, budget_window="day")
        key, _ = await st.create_key("load")
        return key

    key = with_store(db_url, setup)
    script = Script(default=Behavior(latency_s=0.15), record=False)
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gw.toml"
        write_toml(config_dict(up.url, store={**store_cfg(db_url), "lease_s": LEASE_S}), cfg)
        port = free_port()
        log = tmp_path / "gateway.log"
        proc = _start(cfg, port, log)
        ok: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def worker(w: int) -> None:
            with httpx.Client(timeout=10) as c:
                i = 0
                while not stop.is_set():
                    rid = f"w{w}-{i}"
                    i += 1
                    try:
                        r = c.post(
                            f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions",
                            json={"model": "ethen/cheap", "messages": [{"role": "user", "content": "hi"}]},
                            headers={"authorization": f"Bearer {key}", "x-request-id": rid},
                        )
                    except httpx.TransportError:
                        continue
                    if r.status_code == 200:
                        with lock:
                            ok.append(rid)

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(8)]
        try:
            for t in threads:
                t.start()
            time.sleep(2.5)
            load_until = time.monotonic() + 60  # bounded: a loaded machine answers slowly
            while time.monotonic() < load_until:
                with lock:
                    if len(ok) >= 20:
                        break
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            with lock:
                seen = list(ok)
            stop.set()
            for t in threads:
                t.join(15)

            async def after_crash(st: Store) -> tuple[list[str], int, float]:
                async with st.engine.connect() as conn:
                    ids = [r[0] for r in await conn.execute(select(s.ledger.c.request_id))]
                    total = func.coalesce(func.sum(s.budget_grants.c.amount_nano), 0)
                    held = await conn.scalar(select(total))
                spend = await st.spend(await st.get_project("load"))
                return ids, int(held or 0), spend.granted_usd

            ids, held, counted = with_store(db_url, after_crash)
            ledger_ids = set(ids)
            assert len(seen) >= 20, f"too little load before the kill ({len(seen)} answers)"
            assert set(seen) <= ledger_ids, sorted(set(seen) - ledger_ids)[:5]
            assert len(ids) == len(ledger_ids)  # no request settled twice
            assert held > 0 and counted > 0  # the dead process's grant still counts while its lease runs
            print(f"kill -9 after {len(seen)} answered requests; {held} nano-USD were held")
            time.sleep(LEASE_S + 0.5)
            assert with_store(db_url, after_crash)[2] == 0  # lease expired: the hold no longer counts

            proc = _start(cfg, port, log)
            r = httpx.post(
                f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions",
                json={"model": "ethen/cheap", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {key}", "x-request-id": "after-restart"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            ids, held, _ = with_store(db_url, after_crash)
            assert set(seen) | {"after-restart"} <= set(ids) and len(ids) == len(set(ids))
            assert "released 1 budget hold" in log.read_text() and key not in log.read_text()
        finally:
            stop.set()
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
