"""A mesh worker's death is logged (issue 10, item 6): a real worker over real gRPC on 127.0.0.1 is polled by
the orchestrator's HealthMonitor, stopped, then served again on the same port. One WARNING per transition
(alive -> dead, dead -> alive, a failed request's back-off), never one per poll."""

from __future__ import annotations

import logging
import time

import pytest

from ethen.mesh.orchestrator import Backoff, HealthMonitor
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, serve


def _serve(port: int) -> tuple[WorkerService, object, int]:
    service = WorkerService(WorkerConfig("w1", [(0, 0)]), ModelBackend.load([(0, 0)]))
    server, bound = serve(service, "127.0.0.1", port)
    return service, server, bound


def test_worker_death_and_return_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ethen.mesh.orchestrator")
    service, server, port = _serve(0)
    client = WorkerClient("w1", f"127.0.0.1:{port}", health_timeout_s=0.5)
    monitor = HealthMonitor({"w1": client}, Backoff(base_s=0.2))
    try:
        for _ in range(3):
            assert monitor.poll("w1").reply is not None
        assert caplog.records == []  # alive and polled: nothing to say
        server.stop(0)  # type: ignore[attr-defined]
        service.stop()
        for _ in range(3):
            assert monitor.poll("w1").reply is None
        dead = [r for r in caplog.records if "w1 is dead" in r.getMessage()]
        assert len(dead) == 1 and dead[0].levelno == logging.WARNING and len(caplog.records) == 1

        service, server, _ = _serve(port)  # back on the same address
        deadline = time.monotonic() + 10
        while monitor.poll("w1").reply is None:  # bounded: the channel reconnects within its back-off
            assert time.monotonic() < deadline
            time.sleep(0.1)
        monitor.poll("w1")
        back = [r for r in caplog.records if "w1 answers Health again" in r.getMessage()]
        assert len(back) == 1 and len(caplog.records) == 2

        for _ in range(3):  # one crash seen by several sessions: one line
            monitor.mark_failed("w1")
        failed = [r for r in caplog.records if "w1 failed a request: backed off" in r.getMessage()]
        assert len(failed) == 1 and len(caplog.records) == 3
    finally:
        client.close()
        server.stop(0)  # type: ignore[attr-defined]
        service.stop()
