"""Expiry of joined workers and the shared membership's Redis outages, in-process orchestrators over real
worker processes and real gRPC (issue 12).

- Without Redis: a joined worker SIGKILLed leaves the orchestrator's watched nodes after ``expiry_s`` (not
  before), and a restarted one is watched again.
- Redis unreachable (a TCP relay in front of the test Redis, killed): the instance keeps routing the last
  membership it read, even after the announcement's key expired in Redis, logs one WARNING for the whole
  outage, and follows Redis again (one WARNING) once the relay is back. Skips without
  ``ETHEN_TEST_REDIS_URL``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.orchestrator.members import Membership
from ethen.mesh.orchestrator.registry import open_join_point
from ethen.mesh.orchestrator.shared_members import Announcement, SharedMembers
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from tests.mesh.test_mesh_membership import _until

REDIS_URL = os.environ.get("ETHEN_TEST_REDIS_URL")


@pytest.fixture(scope="module")
def orch() -> Iterator[Orchestrator]:
    o = Orchestrator.load({}, health_interval_s=0.1).start()
    try:
        yield o
    finally:
        o.close()


def _alive(o: Orchestrator, node: str) -> bool:
    return any(s.node_id == node and s.alive for s in o.states())


def test_without_redis_a_silent_joined_worker_expires_and_comes_back(orch: Orchestrator) -> None:
    point = open_join_point(orch, "127.0.0.1", 0, expiry_s=1.5, insecure=True)
    workers: list[WorkerProcess] = []
    try:
        assert point.port is not None and point.membership.heartbeat_s == 1.5 / 4
        j = spawn_worker("j", "0-29", extra_args=["--join", f"127.0.0.1:{point.port}"])
        workers.append(j)
        _until(lambda: _alive(orch, "j"), 2.0, "j is routable")
        j.kill()
        killed = time.monotonic()
        _until(lambda: not _alive(orch, "j"), 1.5, "j leaves routing (failed Health)")
        assert "j" in orch.monitor.clients  # dead but still a member: its last announcement is fresh
        _until(lambda: "j" not in orch.monitor.clients, 1.5 + 1.0, "j expires")
        assert time.monotonic() - killed >= 1.5 - 0.4  # announced every 0.375 s, expired 1.5 s after
        assert point.membership.removed == 1 and point.membership.members() == {}
        back = spawn_worker("j", "0-29", extra_args=["--join", f"127.0.0.1:{point.port}"])
        workers.append(back)
        _until(lambda: _alive(orch, "j"), 2.0, "the restarted j is routable again")
        assert orch.clients["j"].address == back.address
    finally:
        point.close()
        for w in workers:
            w.stop()


class _Relay:
    """``tests.mesh.relay`` in front of the test Redis: killed, Redis is unreachable through it."""

    def __init__(self, target: str, port: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mesh.relay", "--listen", f"127.0.0.1:{port}", "--target", target,
             "--echo", "127.0.0.1:0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), line
        self.port = int(line.split()[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def test_redis_unreachable_keeps_the_last_membership_and_warns_once(
        orch: Orchestrator, caplog: pytest.LogCaptureFixture) -> None:
    if not REDIS_URL:
        pytest.skip("ETHEN_TEST_REDIS_URL is not set: this test cuts a real Redis off")
    url = urlsplit(REDIS_URL)
    relay = _Relay(f"{url.hostname}:{url.port or 6379}")
    relays = [relay]
    prefix = f"ethen-test-{uuid.uuid4().hex[:10]}"
    writer = SharedMembers(REDIS_URL, "mesh", key_prefix=prefix)  # what another instance's registry writes
    reader = SharedMembers(f"redis://127.0.0.1:{relay.port}{url.path}", "mesh", key_prefix=prefix,
                           timeout_s=0.3)
    membership = Membership(orch, expiry_s=1.0, shared=reader, poll_s=0.1).start()
    w = spawn_worker("r", "0-29")
    caplog.set_level(logging.WARNING, logger="ethen.mesh.orchestrator")
    try:
        writer.write(Announcement("r", w.address, ((0, 29),)), ttl_s=1.0)
        _until(lambda: _alive(orch, "r"), 1.0, "the shared announcement is routed")
        relay.kill()  # Redis unreachable from this instance
        time.sleep(2.5)  # the key expired in Redis meanwhile (nobody renews it)
        assert writer.read() == {}
        assert _alive(orch, "r") and membership.members() == {"r": w.address}  # the last known membership
        downs = [r for r in caplog.records if "routing keeps the last known membership" in r.getMessage()]
        assert len(downs) == 1, [r.getMessage() for r in caplog.records]
        relays.append(_Relay(f"{url.hostname}:{url.port or 6379}", relay.port))
        _until(lambda: "r" not in orch.monitor.clients, 2.0, "Redis back: r (expired there) is removed")
        ups = [r for r in caplog.records if "redis answers again" in r.getMessage()]
        assert len(ups) == 1
    finally:
        membership.stop()
        writer.close()
        w.stop()
        for r in relays:
            if r.proc.poll() is None:
                r.kill()
