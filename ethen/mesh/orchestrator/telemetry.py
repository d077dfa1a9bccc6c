"""The orchestrator's view of the workers: a :class:`NodeState` per worker from ``Health`` polls.

A background thread polls every worker every ``interval_s`` (default 0.25 s). :meth:`HealthMonitor.states`
never hands out a state older than ``max_age_s`` (default 1 s, as the issue asks): a worker whose last good
poll is older is polled again on the spot, and one that does not answer is reported ``alive=False``. A node in
back-off (it just failed a request, see :mod:`~ethen.mesh.orchestrator.backoff`) is also reported dead, so the
router does not pick it until the back-off ends.

``current_load`` is the worker's data-plane ``load`` (spec §7: it reaches the node through Health), and
``latency_ms`` its own EWMA.

Logs (logger ``ethen.mesh.orchestrator``, one line per transition, never per poll): WARNING when a worker
that answered its Health polls stops answering (or reports itself not alive), and when a request to a worker
fails and backs it off; WARNING again when a dead worker answers again (its recovery pairs with the death).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ethen.mesh.orchestrator.backoff import Backoff
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.orchestrator.errors import NodeError
from ethen.mesh.proto import mesh_pb2
from ethen.mesh.routing import NodeState

__all__ = ["HealthMonitor", "NodeHealth", "state_from_health"]

log = logging.getLogger("ethen.mesh.orchestrator")


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """The last poll of one worker."""

    node_id: str
    at: float  # monotonic time of the poll
    reply: mesh_pb2.HealthResponse | None  # None: the poll failed
    error: str = ""


def state_from_health(node_id: str, reply: mesh_pb2.HealthResponse | None, alive: bool) -> NodeState:
    """A router ``NodeState`` from a Health reply (a node never heard from serves nothing)."""
    if reply is None:
        return NodeState(node_id, 0.0, 0.0, 0.0, (), alive=False)
    return NodeState(
        node_id=node_id,
        latency_ms=max(0.0, reply.latency_ms),
        current_load=max(0.0, reply.load),
        capacity_score=reply.capacity_score,
        served_layers=tuple((r.first, r.last) for r in reply.served_layers),
        alive=alive and reply.alive,
    )


class HealthMonitor:
    def __init__(self, clients: Mapping[str, WorkerClient], backoff: Backoff, interval_s: float = 0.25,
                 max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.clients = dict(clients)
        self.backoff = backoff
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, NodeHealth] = {}
        self._last_good: dict[str, NodeHealth] = {}
        self._alive: dict[str, bool] = {}  # last reported liveness, for the transition logs
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, node_id: str) -> NodeHealth:
        client = self.clients[node_id]
        try:
            reply = client.health()
            health = NodeHealth(node_id, self.clock(), reply)
        except NodeError as exc:
            health = NodeHealth(node_id, self.clock(), None, str(exc))
        alive = health.reply is not None and health.reply.alive
        with self._lock:
            self._last[node_id] = health
            if health.reply is not None:
                self._last_good[node_id] = health
            was = self._alive.get(node_id)
            self._alive[node_id] = alive
        if was is True and not alive:
            log.warning("mesh worker %s is dead: %s", node_id, health.error or "Health says not alive")
        elif was is False and alive:
            log.warning("mesh worker %s answers Health again", node_id)
        return health

    def poll_all(self) -> None:
        for node_id in self.clients:
            self.poll(node_id)

    def start(self) -> None:
        if self._thread is not None:
            return
        self.poll_all()
        self._thread = threading.Thread(target=self._loop, name="ethen-health", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_all()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def mark_failed(self, node_id: str) -> None:
        """A request to ``node_id`` failed: back it off and forget its last good poll. Failures reported
        while the node is already backed off (other sessions hitting the same crash) count once."""
        now = self.clock()
        with self._lock:
            first = not self.backoff.blocked(node_id, now)
            until = self.backoff.record_failure(node_id, now) if first else now
            self._last[node_id] = NodeHealth(node_id, now, None, "request failed")
            self._alive[node_id] = False
        if first:
            log.warning("mesh worker %s failed a request: backed off for %.1f s", node_id, until - now)

    def mark_ok(self, node_id: str) -> None:
        with self._lock:
            self.backoff.record_success(node_id)

    def states(self) -> tuple[NodeState, ...]:
        """One fresh (<= ``max_age_s`` old) ``NodeState`` per worker, in a stable order."""
        out: list[NodeState] = []
        for node_id in sorted(self.clients):
            now = self.clock()
            with self._lock:
                last = self._last.get(node_id)
                blocked = self.backoff.blocked(node_id, now)
            if last is None or now - last.at > self.max_age_s:
                last = self.poll(node_id)
            with self._lock:
                known = self._last_good.get(node_id)
            # A node that fails its poll keeps its last known fragments (failover needs them), but is dead.
            reply = last.reply if last.reply is not None else (known.reply if known is not None else None)
            out.append(state_from_health(node_id, reply, alive=last.reply is not None and not blocked))
        return tuple(out)

    def snapshot(self) -> dict[str, NodeHealth]:
        with self._lock:
            return dict(self._last)
