"""Membership shared by two gateway instances through real Redis (issue 12), with real processes and gRPC.

Gateway A and gateway B serve one config (``[shared]`` Redis with a key prefix of this run, a mesh provider
with static worker ``a`` on layers 0-19, ``join`` on one port, ``member_expiry_s = 2``). A starts first and
binds the join port; B cannot and routes through the shared membership (what the N processes of
``ethen gateway --workers N`` do). A worker that joins A is routed by B within 2 s; a SIGKILLed joined worker
leaves both after the expiry and comes back when restarted; the static worker is never expired, and a worker
cannot join under its name. Skips without ``ETHEN_TEST_REDIS_URL``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from ethen.gateway.accounting.auth import hash_key
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.mesh.worker.launch import spawn_worker
from tests.mesh.member_pair import ask, gateway_pair, join, listed
from tests.mesh.test_mesh_membership import _free_port, _until

REDIS_URL = os.environ.get("ETHEN_TEST_REDIS_URL")
KEY = "ethen-test-mesh-shared-membership-0123"
EXPIRY_S = 2.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not REDIS_URL:
        pytest.skip("ETHEN_TEST_REDIS_URL is not set: the shared membership needs a real Redis")
    prefix = f"ethen-test-{uuid.uuid4().hex[:10]}"
    yield from gateway_pair({"shared": {"redis_url": REDIS_URL, "key_prefix": prefix}}, KEY, EXPIRY_S,
                            tmp_path_factory)


def test_a_worker_that_joins_instance_a_is_routed_by_instance_b_within_2s(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    before = b_gw.healthz()
    assert before.status_code == 503 and "layers 20-29" in before.text
    join(pair, "b")  # returns once the worker printed READY, right after its first announcement
    took = _until(lambda: b_gw.healthz().status_code == 200, 2.0, "instance B routes over the joined worker")
    print(f"\njoined worker routable by the other instance after {took:.2f} s")
    r = ask(b_gw, KEY)
    assert r.status_code == 200, r.text
    assert "another process serves it" in b_gw.log.read_text()  # B could not bind the join port
    assert r.json()["ethen"]["routing"]["mesh"]["route"]["nodes"] == ["a", "b"]
    assert "mesh worker b joined at" in a_gw.log.read_text()
    assert "mesh worker b joined at" in b_gw.log.read_text() and "(shared membership)" in b_gw.log.read_text()
    assert listed(a_gw, "b", alive=True) and listed(b_gw, "b", alive=True)


def test_a_sigkilled_joined_worker_expires_everywhere_and_comes_back(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    k = join(pair, "k")
    _until(lambda: listed(b_gw, "k", alive=True), 2.0, "B routes k")
    k.kill()
    killed = time.monotonic()
    time.sleep(0.8)  # its last announcement (every 0.5 s) is < 2 s old: still a member, listed
    assert listed(a_gw, "k") and listed(b_gw, "k")
    _until(lambda: not listed(a_gw, "k") and not listed(b_gw, "k"), EXPIRY_S + 1.5,
           "k leaves both instances' membership (metrics)")
    gone = time.monotonic() - killed
    assert gone >= EXPIRY_S - 0.6, f"removed {gone:.2f} s after the kill: before its expiry"
    assert "mesh worker k at" in a_gw.log.read_text() and "expired" in a_gw.log.read_text()
    join(pair, "k")  # restarted (a new port): it announces again and is a member again
    _until(lambda: listed(a_gw, "k", alive=True) and listed(b_gw, "k", alive=True), 2.0, "k is back")


def test_a_worker_that_leaves_instance_a_leaves_instance_b_at_once(pair: dict[str, Any]) -> None:
    b_gw = pair["B"]
    d = join(pair, "d")
    _until(lambda: listed(b_gw, "d", alive=True), 2.0, "B routes d")
    d.process.send_signal(signal.SIGTERM)  # drains (no session open), sends Leave to A, exits
    t0 = time.monotonic()
    # the Leave deletes d's shared announcement: B drops d on its next poll, before its expiry could
    # (the last heartbeat was at most 0.5 s before the signal, so expiry comes >= 1.5 s after it)
    _until(lambda: not listed(b_gw, "d"), 1.0, "B drops the worker that left")
    assert d.process.wait(timeout=10) == 0 and time.monotonic() - t0 < 1.5


def test_with_workers_2_one_child_serves_the_registry_and_both_route_joined_workers(
        pair: dict[str, Any], tmp_path: Path) -> None:
    """``ethen gateway --workers 2``: one child binds the join port, the other reads the shared membership;
    every connection (the kernel spreads them over the children) sees the joined worker's layers."""
    join_port, port = _free_port(), _free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "shared": {"redis_url": REDIS_URL, "key_prefix": f"ethen-test-{uuid.uuid4().hex[:10]}"},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": {"a": pair["workers"][0].address},
                       "start_timeout_s": 0.0, "join": f"127.0.0.1:{join_port}",
                       "insecure": True, "member_expiry_s": EXPIRY_S}],
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
        _until(both_started, 60, "one child serves the registry, the other reads the shared membership")
        assert log.read_text().count("workers may join on port") == 1
        spawn = spawn_worker("m", "20-29", extra_args=["--join", f"127.0.0.1:{join_port}"])
        pair["workers"].append(spawn)
        time.sleep(1.0)  # both children polled Redis (every 0.25 s) and Health-polled m
        codes = [httpx.get(f"{base}/healthz", timeout=5).status_code for _ in range(20)]  # new connections
        assert codes == [200] * 20, codes
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_static_workers_are_never_expired_nor_taken_over(pair: dict[str, Any]) -> None:
    a_gw, b_gw = pair["A"], pair["B"]
    impostor = join(pair, "a", "0-9")  # the static worker's name
    _until(lambda: any("cannot join the mesh" in line for line in impostor.output), 5, "the refusal")
    assert any("ALREADY_EXISTS" in line for line in impostor.output)
    impostor.stop()
    static = pair["workers"][0]
    assert static.node_id == "a"
    static.kill()
    _until(lambda: listed(b_gw, "a", alive=False), 2.0, "the dead static worker is seen dead")
    time.sleep(EXPIRY_S + 1.0)
    assert listed(a_gw, "a", alive=False) and listed(b_gw, "a", alive=False)  # dead, still a member


def test_member_expiry_is_checked_and_named() -> None:
    doc = {"providers": [{"id": "mesh", "kind": "mesh", "join": "127.0.0.1:7000", "member_expiry_s": 0.1}],
           "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
           "api_keys": [{"name": "t", "sha256": "0" * 64}]}
    with pytest.raises(GatewayConfigError) as info:
        parse_config(doc)
    assert "providers[0].member_expiry_s = 0.1" in info.value.message
