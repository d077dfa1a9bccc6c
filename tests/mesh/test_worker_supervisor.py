"""The worker supervisor driven directly, with real ``ethen worker`` processes (one layer each, ~2 s to
start): a ``kill -9``'d worker comes back on the same address and answers Health; a worker that cannot
start again is retried with a growing delay (no busy loop); ``stop()`` restarts nothing and logs no death."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Sequence

import grpc
import pytest

from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.mesh.worker.supervisor import RestartBackoff, Supervisor, describe_exit

LOGGER = "ethen.mesh.supervisor"


def _health(address: str) -> mesh_pb2.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.MeshWorkerStub(channel)  # type: ignore[no-untyped-call]
        reply: mesh_pb2.HealthResponse = stub.Health(mesh_pb2.HealthRequest(), timeout=5)
        return reply


def _until(cond: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_restart_backoff_doubles_to_the_cap_and_resets_after_a_long_run() -> None:
    b = RestartBackoff(base_s=0.5, max_s=30.0, reset_after_s=60.0)
    assert [b.next_delay(1.0) for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.next_delay(0.0) == 30.0  # a failed start keeps the delay growing
    assert b.next_delay(61.0) == 0.5  # it ran a minute: a fresh death starts over
    with pytest.raises(ValueError, match="base_s"):
        RestartBackoff(base_s=0.0)
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"


def test_a_killed_worker_is_restarted_on_its_address_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with Supervisor() as sup:
        first = sup.add("w0", "0-0")
        sup.start()
        address, pid = first.address, first.pid
        assert _health(address).node_id == "w0"
        os.kill(pid, signal.SIGKILL)
        _until(lambda: sup.restarts("w0") == 1, 60, f"no restart: {_messages(caplog)}")
        again = sup.workers["w0"]
        assert again.pid != pid and again.alive()
        assert again.address == address == sup.addresses["w0"]
        reply = _health(address)  # the same address answers: the restarted worker serves
        assert reply.node_id == "w0" and reply.alive
        died, restarted = _messages(caplog)
        assert died == f"mesh worker w0 (pid {pid}, {address}) died: killed by SIGKILL; restarting in 0.5 s"
        assert restarted == f"mesh worker w0 restarted on {address} (pid {again.pid}, restart 1)"
    assert not again.alive()  # stop() took the restarted worker down
    assert len(_messages(caplog)) == 2  # and logged no death for it


def test_a_worker_that_cannot_start_again_is_retried_with_a_growing_delay(
        caplog: pytest.LogCaptureFixture) -> None:
    """After its first start the worker is spawned with layers the model does not have (the real worker
    exits before READY, as with a bad --layers): the restarts fail, 0.5 s then 1 s then 2 s apart."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    calls: list[float] = []

    def spawn(node_id: str, layers: str, port: int, host: str, extra: Sequence[str]) -> WorkerProcess:
        calls.append(time.monotonic())
        return spawn_worker(node_id, layers if len(calls) == 1 else "0-999", port=port, host=host,
                            extra_args=extra)

    sup = Supervisor(spawn=spawn)
    try:
        w = sup.add("w0", "0-0")
        sup.start()
        t_kill = time.monotonic()
        w.kill()
        _until(lambda: len(calls) >= 4, 60, f"restart attempts: {_messages(caplog)}")
    finally:
        sup.stop()
    gaps = [b - a for a, b in zip([t_kill, *calls[1:]], calls[1:], strict=False)]
    # each attempt waits its delay after the previous one failed (a failed start takes ~1-2 s itself)
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0 and gaps[2] >= 2.0, gaps
    failed = [m for m in _messages(caplog) if "did not restart" in m]
    assert len(failed) >= 2, _messages(caplog)
    assert re.fullmatch(rf"mesh worker w0 did not restart on 127\.0\.0\.1:{w.address.rsplit(':')[1]}: .*"
                        r"; next attempt in 1\.0 s", failed[0]), failed[0]
    assert failed[1].endswith("next attempt in 2.0 s"), failed[1]
    assert sup.restarts("w0") == 0
