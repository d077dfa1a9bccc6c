"""Membership shared by two gateway instances through the gateway's ``[store]`` when there is no Redis (issue
12), with real gateway and worker processes, real gRPC and a real database: one SQLite file, and a fresh
Postgres database (skipped without ``ETHEN_TEST_PG_URL``).

Gateway A and gateway B serve one config (a ``[store]``, no ``[shared]``; a mesh provider with static worker
``a`` on layers 0-19, ``join`` on one port, ``member_expiry_s = 3``). A binds the join port; B cannot and
routes through the store's ``mesh_members`` table. A worker that joins A is routed by B within 2 s; a Leave
drops it on both before its expiry could; a SIGKILLed joined worker leaves both after the expiry and comes
back when restarted; a worker cannot join under the static worker's name, a foreign row under that name does
not move it, and the static worker never expires. The store-outage test (an in-process orchestrator reading
Postgres through a TCP relay that the test kills) needs Postgres too."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from sqlalchemy.engine import make_url

from ethen.gateway.accounting.auth import hash_key
from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.orchestrator.members import Membership
from ethen.mesh.orchestrator.shared_members import Announcement, SharedMembersUnavailable
from ethen.mesh.orchestrator.store_members import StoreMembers
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.store import Store
from tests.mesh.member_pair import ask, gateway_pair, join, listed
from tests.mesh.test_mesh_member_expiry import _Relay
from tests.mesh.test_mesh_membership import _free_port, _until
from tests.pgdb import PG_ENV, fresh_pg_database

KEY = "ethen-test-mesh-store-membership-0123"
EXPIRY_S = 3.0  # workers announce every 0.75 s


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if request.param == "sqlite":
        yield from _pair(f"sqlite:///{tmp_path_factory.mktemp('store') / 'ethen.db'}", tmp_path_factory)
        return
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is not set: the Postgres variant needs a real server")
    with fresh_pg_database(url) as fresh:
        yield from _pair(fresh, tmp_path_factory)


def _pair(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    for pair in gateway_pair({"store": {"url": store_url}}, KEY, EXPIRY_S, tmp_path_factory):
        yield {**pair, "store_url": store_url}


def test_a_worker_that_joins_instance_a_is_routed_by_instance_b_within_2s(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    before = b_gw.healthz()
    assert before.status_code == 503 and "layers 20-29" in before.text
    join(pair, "b")  # returns once the worker printed READY, right after its first announcement
    took = _until(lambda: b_gw.healthz().status_code == 200, 2.0, "instance B routes over the joined worker")
    print(f"\njoined worker routable by the other instance (store) after {took:.2f} s")
    r = ask(b_gw, KEY)
    assert r.status_code == 200, r.text
    b_log = b_gw.log.read_text()
    assert "another process serves it" in b_log  # B could not bind the join port
    assert r.json()["ethen"]["routing"]["mesh"]["route"]["nodes"] == ["a", "b"]
    assert "mesh worker b joined at" in b_log and "(shared membership)" in b_log
    assert listed(a_gw, "b", alive=True) and listed(b_gw, "b", alive=True)


def test_a_worker_that_leaves_instance_a_leaves_instance_b_before_its_expiry(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    d = join(pair, "d")
    _until(lambda: listed(b_gw, "d", alive=True), 2.0, "B routes d")
    d.process.send_signal(signal.SIGTERM)  # drains (no session open), sends Leave to A, exits
    t0 = time.monotonic()
    # the Leave deletes d's row: B drops d on its next poll (0.5 s); its expiry would come >= 2.25 s after
    # the signal (the last heartbeat was at most 0.75 s before it)
    _until(lambda: not listed(b_gw, "d") and not listed(a_gw, "d"), 1.5, "both drop the worker that left")
    assert time.monotonic() - t0 < EXPIRY_S - 0.75
    assert d.process.wait(timeout=10) == 0


def test_a_sigkilled_joined_worker_expires_everywhere_and_comes_back(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    k = join(pair, "k")
    _until(lambda: listed(b_gw, "k", alive=True), 2.0, "B routes k")
    k.kill()
    killed = time.monotonic()
    time.sleep(1.0)  # its last announcement is < 3 s old: still a member (dead), listed on both
    assert listed(a_gw, "k") and listed(b_gw, "k")
    _until(lambda: not listed(a_gw, "k") and not listed(b_gw, "k"), EXPIRY_S + 1.5,
           "k leaves both instances' membership (metrics)")
    gone = time.monotonic() - killed
    assert gone >= EXPIRY_S - 0.9, f"removed {gone:.2f} s after the kill: before its expiry"
    assert "mesh worker k at" in b_gw.log.read_text() and "left the mesh or expired" in b_gw.log.read_text()
    join(pair, "k")  # restarted (a new port): it announces again and is a member again
    _until(lambda: listed(a_gw, "k", alive=True) and listed(b_gw, "k", alive=True), 2.0, "k is back")


def test_static_workers_are_never_expired_nor_taken_over(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    impostor = join(pair, "a", "0-9")  # the static worker's name
    _until(lambda: any("cannot join the mesh" in line for line in impostor.output), 5, "the refusal")
    assert any("ALREADY_EXISTS" in line for line in impostor.output)
    impostor.stop()
    # a row under the static name (as an instance configured without that static worker would write it)
    foreign = StoreMembers(pair["store_url"], "mesh")
    try:
        foreign.write(Announcement("a", "127.0.0.1:1", ((0, 29),)), EXPIRY_S)
        assert foreign.read()["a"].address == "127.0.0.1:1"
        time.sleep(1.5)  # both instances polled the store (every 0.5 s) and Health-polled a meanwhile
        assert listed(a_gw, "a", alive=True) and listed(b_gw, "a", alive=True)  # still the static worker
        r = ask(b_gw, KEY)
        assert r.status_code == 200, r.text
    finally:
        foreign.close()
    static = pair["workers"][0]
    assert static.node_id == "a"
    static.kill()
    _until(lambda: listed(b_gw, "a", alive=False), 2.0, "the dead static worker is seen dead")
    time.sleep(EXPIRY_S + 1.0)
    assert listed(a_gw, "a", alive=False) and listed(b_gw, "a", alive=False)  # dead, still a member


def test_with_workers_2_on_sqlite_one_child_serves_the_registry_and_both_route_joined_workers(
        tmp_path: Path) -> None:
    """``ethen gateway --workers 2`` with a SQLite ``[store]`` and no Redis: one child binds the join port,
    the other reads the store's membership; every connection (the kernel spreads them over the children)
    sees the joined worker's layers."""
    join_port, port = _free_port(), _free_port()
    workers: list[WorkerProcess] = []
    a = spawn_worker("a", "0-9,10-19")
    workers.append(a)
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"url": f"sqlite:///{tmp_path / 'ethen.db'}"},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": {"a": a.address}, "start_timeout_s": 0.0,
                       "join": f"127.0.0.1:{join_port}", "insecure": True,
                       "member_expiry_s": EXPIRY_S}],
        "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
        "api_keys": [{"name": "test", "sha256": hash_key(KEY)}],
    }
    config = tmp_path / "gateway.toml"
    config.write_text(tomli_w.dumps(cfg))
    log = tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "ethen", "gateway", "--config", str(config), "--workers", "2"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/api/gateway/v1"
    try:
        def both_started() -> bool:
            assert proc.poll() is None, log.read_text()
            text = log.read_text()
            return "workers may join on port" in text and "another process serves it" in text
        _until(both_started, 120, "one child serves the registry, the other reads the store's membership")
        assert log.read_text().count("workers may join on port") == 1
        workers.append(spawn_worker("m", "20-29", extra_args=["--join", f"127.0.0.1:{join_port}"]))
        time.sleep(1.5)  # both children polled the store (every 0.5 s) and Health-polled m
        codes = [httpx.get(f"{base}/healthz", timeout=5).status_code for _ in range(20)]  # new connections
        assert codes == [200] * 20, codes
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        for w in workers:
            w.stop()


# ---- the store unreachable (Postgres through a relay the test kills) ---------------------------------------


def _alive(o: Orchestrator, node: str) -> bool:
    return any(s.node_id == node and s.alive for s in o.states())


def test_store_unreachable_keeps_the_last_membership_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is not set: this test cuts a real Postgres off")
    with fresh_pg_database(url) as fresh:
        asyncio.run(_migrate(fresh))
        u = make_url(fresh)
        relay = _Relay(f"{u.host}:{u.port or 5432}")
        relays = [relay]
        writer = StoreMembers(fresh, "mesh")  # what another instance's registry writes
        reader = StoreMembers(u.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False),
                              "mesh", timeout_s=0.5)
        orch = Orchestrator.load({}, health_interval_s=0.1).start()
        membership = Membership(orch, expiry_s=1.0, shared=reader, poll_s=0.1).start()
        w = spawn_worker("r", "0-29")
        caplog.set_level(logging.WARNING, logger="ethen.mesh.orchestrator")
        try:
            writer.write(Announcement("r", w.address, ((0, 29),)), ttl_s=1.0)
            _until(lambda: _alive(orch, "r"), 1.5, "the shared announcement is routed")
            relay.kill()  # the store unreachable from this instance
            time.sleep(2.5)  # the row lapsed meanwhile (nobody renews it)
            assert writer.read() == {}
            assert _alive(orch, "r") and membership.members() == {"r": w.address}  # the last known membership
            downs = [r for r in caplog.records if "routing keeps the last known membership" in r.getMessage()]
            assert len(downs) == 1, [r.getMessage() for r in caplog.records]
            assert "until store answers" in downs[0].getMessage()
            relays.append(_Relay(f"{u.host}:{u.port or 5432}", relay.port))
            _until(lambda: "r" not in orch.monitor.clients, 3.0, "store back: r (lapsed) is removed")
            ups = [r for r in caplog.records if "store answers again" in r.getMessage()]
            assert len(ups) == 1
        finally:
            membership.stop()
            writer.close()
            orch.close()
            w.stop()
            for r in relays:
                if r.proc.poll() is None:
                    r.kill()


async def _migrate(url: str) -> None:
    st = await Store.open(url)
    await st.aclose()


# ---- the backend itself (no gateway) -----------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ethen.db'}"
        asyncio.run(_migrate(url))
        yield url
        return
    pg = os.environ.get(PG_ENV)
    if not pg:
        pytest.skip(f"{PG_ENV} is not set: the Postgres variant needs a real server")
    with fresh_pg_database(pg) as fresh:
        asyncio.run(_migrate(fresh))
        yield fresh


def test_store_members_write_read_delete_and_lapse(store_url: str) -> None:
    one, two = StoreMembers(store_url, "mesh"), StoreMembers(store_url, "mesh")  # two instances
    try:
        one.write(Announcement("b", "127.0.0.1:7001", ((0, 9), (10, 19))), ttl_s=0.6)
        two.write(Announcement("c", "127.0.0.1:7002", ((20, 29),)), ttl_s=30.0)
        assert two.read() == {"b": Announcement("b", "127.0.0.1:7001", ((0, 9), (10, 19))),
                              "c": Announcement("c", "127.0.0.1:7002", ((20, 29),))}
        assert two.delete("c", "127.0.0.1:9999") is False  # another address: a late Leave of an old process
        assert one.delete("c", "127.0.0.1:7002") is True
        assert set(two.read()) == {"b"}
        time.sleep(0.9)
        assert one.read() == {}  # b lapsed 0.6 s after its last announcement
    finally:
        one.close()
        two.close()
    with pytest.raises(SharedMembersUnavailable):
        one.read()  # closed: an error of the membership's tree, not a crash


def test_a_sqlite_write_lock_held_elsewhere_costs_at_most_the_timeout(tmp_path: Path) -> None:
    """The ledger writer (or anyone) holding SQLite's write lock: an announcement gives up after ``timeout_s``
    (a worker's Join has a 2 s deadline) instead of the store's 10 s busy timeout; reads go on (WAL)."""
    url = f"sqlite:///{tmp_path / 'ethen.db'}"
    asyncio.run(_migrate(url))
    members = StoreMembers(url, "mesh", timeout_s=0.3)
    members.write(Announcement("b", "127.0.0.1:7001", ((0, 29),)), ttl_s=30.0)
    holder = sqlite3.connect(tmp_path / "ethen.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        t0 = time.monotonic()
        with pytest.raises(SharedMembersUnavailable):
            members.write(Announcement("c", "127.0.0.1:7002", ((0, 29),)), ttl_s=30.0)
        assert time.monotonic() - t0 < 1.5
        assert set(members.read()) == {"b"}
        holder.execute("ROLLBACK")
        members.write(Announcement("c", "127.0.0.1:7002", ((0, 29),)), ttl_s=30.0)
        assert set(members.read()) == {"b", "c"}
    finally:
        holder.close()
        members.close()
