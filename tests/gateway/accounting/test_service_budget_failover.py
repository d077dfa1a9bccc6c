"""Issue 23 item 4: two real ``ethen gateway`` processes on one database (SQLite file, Postgres), the default
lease: when one of them is killed (``kill -9``) or frozen (``SIGSTOP``) while it holds a budget grant, the
survivor serves requests that need that grant within 3 s, and the settled spend never exceeds the budget
(overspend exactly 0), also after a frozen instance resumes with its grant still in memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from ethen.store import Store
from ethen.store import schema as s
from ethen.store.values import to_nano
from tests.gateway.accounting.test_service_budget_crash import _start
from tests.gateway.api.test_service_cli import free_port, write_toml
from tests.gateway.budget_harness import db_url, store_cfg, with_store
from tests.gateway.service_harness import CLIENT_KEY, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

__all__ = ["db_url"]
BODY = {"model": "alpha-large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BOUND_S = 3.0  # the bound: a dead instance's share is usable again within 3 s
TIMEOUTS = {"connect_s": 5.0, "first_byte_s": 60.0, "total_s": 90.0}  # A's requests hang on purpose


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions"


def _config(tmp: Path, name: str, upstream: str, db: str) -> Path:
    """One instance's config: the default lease (no ``lease_s``), its own instance id and upstream."""
    cfg = tmp / f"{name}.toml"
    store = {**store_cfg(db), "instance_id": f"gw-{name}"}
    write_toml(config_dict(upstream, store=store, timeouts=TIMEOUTS), cfg)
    return cfg


def _post(c: httpx.Client, port: int, key: str, rid: str) -> httpx.Response:
    return c.post(_url(port), json=BODY, headers={"authorization": f"Bearer {key}", "x-request-id": rid})


def _project(db: str, budget: float) -> str:
    async def setup(st: Store) -> str:
        await st.create_project("shared", budget_usd=budget, budget_window="day")
        key, _ = await st.create_key("shared")
        return key

    return with_store(db, setup)


def _ledger_and_grant(db: str, instance_id: str) -> tuple[dict[str, int], int]:
    """(cost of every ledger row by request id, ``instance_id``'s grant row), nano-USD."""

    async def read(st: Store) -> tuple[dict[str, int], int]:
        async with st.engine.connect() as conn:
            rows = await conn.execute(select(s.ledger.c.request_id, s.ledger.c.cost_nano))
            costs = {r[0]: int(r[1]) for r in rows}
            bg = s.budget_grants.c
            q = select(func.coalesce(func.sum(bg.amount_nano), 0)).where(bg.instance_id == instance_id)
            grant = int(await conn.scalar(q) or 0)
        return costs, grant

    return with_store(db, read)


def _estimate(port: int) -> float:
    """The request's estimated cost (what admission holds for it: one candidate, ``max_tokens`` set)."""
    r = httpx.post(_url(port), json=BODY, headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    est: float = r.json()["ethen"]["routing"]["estimated_cost_usd"]
    assert est > 0
    return est


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_kill_9_of_an_instance_holding_a_grant_frees_its_share_within_3_s(
    db_url: str, tmp_path: Path
) -> None:
    """A holds 8 in-flight requests (its upstream hangs) on a budget of 8.5 of them: B is refused (402) while
    A lives. kill -9 A: B serves again within 3 s, using A's share, and the ledger never passes the budget."""
    hang = Script(default=Behavior(latency_s=60.0))  # A's upstream: A's requests stay in flight
    fast = Script(record=False)
    with ServerThread(make_upstream_app(hang)) as slow_up, ServerThread(make_upstream_app(fast)) as fast_up:
        ports = [free_port(), free_port()]
        procs = [
            _start(_config(tmp_path, "a", slow_up.url, db_url), ports[0], tmp_path / "a.log"),
            _start(_config(tmp_path, "b", fast_up.url, db_url), ports[1], tmp_path / "b.log"),
        ]
        try:
            est = _estimate(ports[1])
            budget = est * 8.5
            key = _project(db_url, budget)
            hung: list[int] = []

            def in_flight(i: int) -> None:
                with httpx.Client(timeout=90) as c, contextlib.suppress(httpx.TransportError):  # A dies
                    hung.append(_post(c, ports[0], key, f"a{i}").status_code)

            threads = [threading.Thread(target=in_flight, args=(i,), daemon=True) for i in range(8)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while len(hang.calls) < 8:  # admitted (budget held) and sent upstream
                assert time.monotonic() < deadline, f"A admitted {len(hang.calls)} of 8"
                assert not hung, hung  # none refused
                time.sleep(0.05)
            with httpx.Client(timeout=30) as c:
                before = [_post(c, ports[1], key, f"before{i}") for i in range(3)]
                assert [r.status_code for r in before] == [402] * 3, before[0].text  # A holds the budget

                os.kill(procs[0].pid, signal.SIGKILL)
                killed = time.monotonic()
                procs[0].wait(10)
                costs, held = _ledger_and_grant(db_url, "gw-a")  # A's grant row, frozen by its death
                assert held >= to_nano(8 * est) - 8 and not costs  # A holds 8 requests, nothing settled
                assert to_nano(budget) - held < to_nano(est)  # B's first success needs A's share

                first_ok: float | None = None
                served = refused = 0
                for i in range(2000):  # bounded: ~10 s of requests, then 402s once A's share is spent too
                    r = _post(c, ports[1], key, f"after{i}")
                    assert r.status_code in (200, 402), r.text
                    if r.status_code == 200:
                        served += 1
                        first_ok = first_ok or time.monotonic() - killed
                    elif first_ok is not None:
                        refused += 1
                        if refused >= 5:
                            break
                    if first_ok is None and time.monotonic() - killed > 10:
                        break
                    time.sleep(0.01)
            costs, _ = _ledger_and_grant(db_url, "gw-a")
        finally:
            _stop(procs)
    print(f"kill -9 of A: B served again after {first_ok} s ({served} requests on A's share)")
    assert first_ok is not None, "B never served again within 10 s of A's death"
    assert first_ok <= BOUND_S, first_ok
    assert served >= 2 and refused >= 5  # B used A's share, then the budget ran out
    assert len(costs) == served and all(k.startswith("after") for k in costs)
    assert sum(costs.values()) <= to_nano(budget)  # overspend exactly 0


def test_sigstop_of_an_instance_frees_its_share_and_it_admits_nothing_stale_on_resume(
    db_url: str, tmp_path: Path
) -> None:
    """A claims ahead (an unused grant) and is frozen (SIGSTOP). B serves what needs A's share within 3 s of
    the freeze, spends the budget, and A, resumed with its old grant in memory, admits nothing more: a request
    that reached A while it was frozen and one after are refused (402); settled spend <= budget exactly."""
    fast = Script(record=False)
    with ServerThread(make_upstream_app(fast)) as up:
        ports = [free_port(), free_port()]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        procs = [
            _start(_config(tmp_path, "a", up.url, db_url), ports[0], logs[0]),
            _start(_config(tmp_path, "b", up.url, db_url), ports[1], logs[1]),
        ]
        try:
            est = _estimate(ports[1])
            budget = est * 8.5
            key = _project(db_url, budget)
            with httpx.Client(timeout=30) as c:
                r = _post(c, ports[0], key, "a0")  # A claims ahead: more than this request
                assert r.status_code == 200, r.text
                os.kill(procs[0].pid, signal.SIGSTOP)
                stopped = time.monotonic()
                costs, held = _ledger_and_grant(db_url, "gw-a")  # frozen with A
                assert held >= to_nano(est), held  # an unused grant that A still has in memory
                share_b = to_nano(budget) - sum(costs.values()) - held  # what B can spend without A's share

                answered: list[tuple[str, float]] = []  # B's successes, in order, and when
                codes: list[int] = []
                for i in range(2000):  # bounded; ends 5 refusals after B served again after a refusal
                    r = _post(c, ports[1], key, f"b{i}")
                    assert r.status_code in (200, 402), r.text
                    codes.append(r.status_code)
                    if r.status_code == 200:
                        answered.append((f"b{i}", time.monotonic() - stopped))
                    again = 402 in codes and 200 in codes[codes.index(402):]
                    if (again and codes[-5:] == [402] * 5) or time.monotonic() - stopped > 10:
                        break
                    time.sleep(0.01)
                costs, _ = _ledger_and_grant(db_url, "gw-a")
                spent, crossed = 0, None
                for rid, at in answered:  # the first of B's answers that needed A's share
                    spent += costs[rid]
                    if spent > share_b:
                        crossed = at
                        break
                assert crossed is not None, "B never used A's share within 10 s of A's freeze"

                during: list[int] = []

                def while_frozen() -> None:
                    with httpx.Client(timeout=30) as c2:
                        during.append(_post(c2, ports[0], key, "a-frozen").status_code)

                t = threading.Thread(target=while_frozen, daemon=True)
                t.start()
                time.sleep(0.3)  # the request waits in A's socket
                os.kill(procs[0].pid, signal.SIGCONT)
                t.join(30)
                after = [_post(c, ports[0], key, f"a-after{i}").status_code for i in range(3)]
            costs, _ = _ledger_and_grant(db_url, "gw-a")
        finally:
            _stop(procs)
    print(f"SIGSTOP of A: B used A's share after {crossed:.2f} s; A after resuming: {during} {after}")
    assert crossed <= BOUND_S, crossed
    assert during == [402] and after == [402] * 3, (during, after)
    assert sum(costs.values()) <= to_nano(budget)  # overspend exactly 0
    assert "lease lost" in logs[0].read_text()
