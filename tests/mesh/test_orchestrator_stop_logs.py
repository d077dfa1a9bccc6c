"""A worker told to stop is not dead (issue 23 item 11): a real worker over real gRPC reports ``draining`` in
Health once it drains; the orchestrator's HealthMonitor logs that once at INFO ("stopping"), and its polls
failing after the worker closed its port add no WARNING."""

from __future__ import annotations

import logging

import pytest

from ethen.mesh.orchestrator import Backoff, HealthMonitor
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, serve


def test_a_draining_worker_is_logged_as_stopping_not_dead(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ethen.mesh.orchestrator")
    service = WorkerService(WorkerConfig("w1", [(0, 0)]), ModelBackend.load([(0, 0)]))
    server, port = serve(service, "127.0.0.1", 0)
    client = WorkerClient("w1", f"127.0.0.1:{port}", health_timeout_s=0.5)
    monitor = HealthMonitor({"w1": client}, Backoff(base_s=0.2))
    try:
        assert monitor.poll("w1").reply is not None
        service.drain()  # what SIGTERM does
        for _ in range(3):
            reply = monitor.poll("w1").reply
            assert reply is not None and reply.draining and not reply.alive
        server.stop(0)
        for _ in range(3):
            assert monitor.poll("w1").reply is None
    finally:
        client.close()
        server.stop(0)
        service.stop()
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    says = "mesh worker w1 is stopping (draining): no new session is routed to it"
    assert records == [(logging.INFO, says)]
