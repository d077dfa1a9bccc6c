"""Waiting for an orchestrator's first Health polls: until it can route ``positions`` (bounded)."""

from __future__ import annotations

import time

from ethen.mesh.orchestrator import Orchestrator


def wait_routable(orch: Orchestrator, positions: int, timeout_s: float = 20.0) -> None:
    """Return once ``orch.route_for(positions)`` succeeds; its last error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            orch.route_for(positions)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
