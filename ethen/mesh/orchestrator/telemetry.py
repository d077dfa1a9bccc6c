"""The orchestrator's view of the workers: a :class:`NodeState` per worker from ``Health`` polls.

A background thread per worker polls it every ``interval_s`` (default 0.25 s): one thread each, so a worker
that does not answer (a partition: each poll waits out its 0.5 s timeout) never delays the others' polls.
:meth:`HealthMonitor.states` never hands out a state older than ``max_age_s`` (default 1 s, as the issue
asks): a worker whose last good poll is older is polled again on the spot, and one that does not answer is
reported ``alive=False``. So a dead or cut-off worker leaves routing within ``interval_s`` + the Health
timeout (0.25 + 0.5 s) of its last answer. A node in back-off (it just failed a request, see
:mod:`~ethen.mesh.orchestrator.backoff`) is also reported dead, so the router does not pick it until the
back-off ends.

``current_load`` is the worker's data-plane ``load`` (spec §7: it reaches the node through Health).
``latency_ms`` is the latency *as the orchestrator sees it*, the spec's EWMA over network round trip plus
compute, kept here (the shell) as two EWMAs (alpha ``alpha``, default 0.3) whose sum the pure router reads:

- **round trip**: each Health poll's duration measured around the call, and each stage call's duration minus
  the queue + compute time the worker reports in its reply (:meth:`HealthMonitor.observe_call`): network both
  ways plus the gRPC call's own cost, what every stage call pays on top of the worker's compute. A failed
  poll forgets it (a node that comes back starts afresh). At 4 polls a second an idle node's EWMA follows a
  changed delay 97 % of the way in 10 polls (2.5 s); a node in use gets a sample per stage call.
- **compute per step**: the worker's queue + compute time of one-row (decode) calls, from the replies. Not
  the worker's own Health ``latency_ms`` (its EWMA over every ``Forward``): that mixes prompt prefills (a
  40-token prefill costs ~10 decode steps) with decode steps, and is 0 on a node that never served, so the
  node just used looked slower than an unused replica 40 ms away and routing alternated between them. A node
  with no decode step measured yet counts the mean of the measured nodes' (the mesh's average speed; its
  capacity score still tells the router about declared differences); with none measured at all, the
  worker's own EWMA.

The spec's §8/§9 assumed the worker's EWMA covers the data plane; it does not see the wire.

Logs (logger ``ethen.mesh.orchestrator``, one line per transition, never per poll): WARNING when a worker
that answered its Health polls stops answering (or reports itself not alive), and when a request to a worker
fails and backs it off; WARNING again when a dead worker answers again (its recovery pairs with the death).
A worker that reports ``draining`` (it was told to stop: SIGTERM, ``ethen up`` shutting down) is logged once
at INFO as stopping, not dead, and its polls failing afterwards (it closed its port) add no line.

Liveness by progress (issue 42, :mod:`~ethen.mesh.orchestrator.admission`): each stage call that finishes
is progress (:meth:`HealthMonitor.observe_call` / :meth:`HealthMonitor.observe_step`). A Health poll that
*timed out* on a worker with stage calls in flight and progress within ``grace_s`` (the orchestrator's
``progress_timeout_s``) keeps its last good state (alive: busy, not dead; no log line); a poll the worker
refused (connection refused, ``UNAVAILABLE``) is death at once, as is a timeout without calls in flight or
recent progress (cut off, stuck).

Model check (issue 24): with :meth:`HealthMonitor.expect_model` (the orchestrator's own GGUF fingerprint,
:func:`ethen.mesh.model_id.model_fingerprint`), a worker whose Health ``model_sha256`` differs serves another
model file: its polls count as failed (``alive=False``, no fragments), so nothing is routed to it, and one
ERROR line says which file the mesh serves (again only after the worker changed). A worker that reports no
fingerprint (an in-process test service, an older worker) is not checked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ethen.mesh.orchestrator.admission import busy_not_dead
from ethen.mesh.orchestrator.backoff import Backoff
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.orchestrator.errors import NodeError
from ethen.mesh.orchestrator.load import session_cap
from ethen.mesh.orchestrator.prefix import PrefixHolding
from ethen.mesh.proto import mesh_pb2
from ethen.mesh.routing import NodeState

__all__ = ["HealthMonitor", "HealthReply", "NodeHealth", "state_from_health"]

#: A worker's ``Health`` reply, as the orchestrator's readers see it (``HealthMonitor.polled``).
HealthReply = mesh_pb2.HealthResponse

log = logging.getLogger("ethen.mesh.orchestrator")


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """The last poll of one worker."""

    node_id: str
    at: float  # monotonic time of the poll
    reply: mesh_pb2.HealthResponse | None  # None: the poll failed
    error: str = ""
    rtt_ms: float = 0.0  # this poll's round trip (0 when it failed)


def state_from_health(node_id: str, reply: mesh_pb2.HealthResponse | None, alive: bool,
                      rtt_ms: float = 0.0, step_ms: float | None = None) -> NodeState:
    """A router ``NodeState`` from a Health reply (a node never heard from serves nothing). ``latency_ms`` is
    ``rtt_ms`` (the orchestrator's round-trip EWMA to the node) plus ``step_ms`` (its compute EWMA per decode
    step), or plus the worker's own latency EWMA while ``step_ms`` is unknown."""
    if reply is None:
        return NodeState(node_id, 0.0, 0.0, 0.0, (), alive=False)
    compute = reply.latency_ms if step_ms is None else step_ms
    return NodeState(
        node_id=node_id,
        latency_ms=max(0.0, compute) + max(0.0, rtt_ms),
        current_load=max(0.0, reply.load),
        capacity_score=reply.capacity_score,
        served_layers=tuple((r.first, r.last) for r in reply.served_layers),
        alive=alive and reply.alive,
    )


class HealthMonitor:
    def __init__(self, clients: Mapping[str, WorkerClient], backoff: Backoff, interval_s: float = 0.25,
                 max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 alpha: float = 0.3, grace_s: float | None = None) -> None:
        self.clients = dict(clients)
        self.grace_s = grace_s  # a timed-out poll within this of the node's last progress: busy, not dead
        self._progress: dict[str, float] = {}  # node -> when a stage call to it last finished (clock)
        self.backoff = backoff
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.alpha = alpha
        self._rtt: dict[str, float] = {}  # EWMA of the round trip, ms
        self._step: dict[str, float] = {}  # EWMA of the worker's queue + compute per decode step, ms
        self._lock = threading.Lock()
        self._last: dict[str, NodeHealth] = {}
        self._last_good: dict[str, NodeHealth] = {}
        self._alive: dict[str, bool] = {}  # last reported liveness, for the transition logs
        self._model: tuple[str, str] | None = None  # (fingerprint, file) the workers must report
        self._refused: dict[str, str] = {}  # node -> the other fingerprint it reported (logged once)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def expect_model(self, fingerprint: str, path: str) -> None:
        """Route only to workers whose Health reports ``fingerprint`` (the GGUF ``path``) or none."""
        self._model = (fingerprint, path)

    def _model_mismatch(self, node_id: str, reply: mesh_pb2.HealthResponse) -> str:
        """Why ``reply`` is refused (another model file), or "" (under ``self._lock``)."""
        if self._model is None or not reply.model_sha256 or reply.model_sha256 == self._model[0]:
            self._refused.pop(node_id, None)
            return ""
        expected, path = self._model
        why = (f"serves another model file ({reply.model_sha256}) than this mesh ({path}, {expected}): "
               f"refused, no request is routed to it; start it with --model {path}")
        if self._refused.get(node_id) != reply.model_sha256:
            self._refused[node_id] = reply.model_sha256
            log.error("mesh worker %s %s", node_id, why)
        return why

    def poll(self, node_id: str) -> NodeHealth:
        client = self.clients.get(node_id)
        if client is None:  # removed meanwhile
            return NodeHealth(node_id, self.clock(), None, "not watched any more")
        t0 = time.perf_counter()
        busy = False
        try:
            reply = client.health()
            rtt_ms = (time.perf_counter() - t0) * 1000.0
            with self._lock:
                mismatch = self._model_mismatch(node_id, reply)
            health = (NodeHealth(node_id, self.clock(), reply, rtt_ms=rtt_ms) if not mismatch
                      else NodeHealth(node_id, self.clock(), None, mismatch))
        except NodeError as exc:
            now = self.clock()
            health = NodeHealth(node_id, now, None, str(exc))
            with self._lock:
                good = self._last_good.get(node_id)
                busy = (self.grace_s is not None and good is not None and
                        busy_not_dead(now, exc.timed_out, client.in_flight, self._progress.get(node_id),
                                      self.grace_s))
            if busy:  # it made progress just now: slow to answer, not dead (its last good state stands)
                assert good is not None
                health = NodeHealth(node_id, now, good.reply, rtt_ms=good.rtt_ms)
                log.debug("mesh worker %s is slow to answer Health but makes progress: busy", node_id)
        alive = health.reply is not None and health.reply.alive
        draining = health.reply is not None and health.reply.draining
        with self._lock:
            self._last[node_id] = health
            if busy:
                pass  # its last good poll and round trip stand
            elif health.reply is not None:
                self._last_good[node_id] = health
                self._record_rtt(node_id, health.rtt_ms)
            else:
                self._rtt.pop(node_id, None)
            was = self._alive.get(node_id)
            self._alive[node_id] = alive
        if was is True and not alive and draining:
            log.info("mesh worker %s is stopping (draining): no new session is routed to it", node_id)
        elif was is True and not alive and node_id not in self._refused:
            log.warning("mesh worker %s is dead: %s", node_id, health.error or "Health says not alive")
        elif was is False and alive:
            log.warning("mesh worker %s answers Health again", node_id)
        return health

    def _ewma(self, table: dict[str, float], node_id: str, sample: float) -> None:  # under self._lock
        old = table.get(node_id)
        table[node_id] = sample if old is None else old + self.alpha * (sample - old)

    def _record_rtt(self, node_id: str, rtt_ms: float) -> None:  # under self._lock
        self._ewma(self._rtt, node_id, rtt_ms)

    def observe_call(self, node_id: str, rows: int, duration_ms: float, worker_ms: float) -> None:
        """A stage call to ``node_id`` carrying ``rows`` positions per session took ``duration_ms`` here and
        ``worker_ms`` (queue + compute) on the worker: a round-trip sample, and for one row a step sample."""
        with self._lock:
            if node_id not in self.clients:
                return
            self._progress[node_id] = self.clock()
            self._record_rtt(node_id, max(0.0, duration_ms - worker_ms))
            if rows == 1:
                self._ewma(self._step, node_id, max(0.0, worker_ms))

    def observe_step(self, node_id: str, worker_ms: float) -> None:
        """A chained decode step ran on ``node_id`` in ``worker_ms`` (queue + compute): a step sample only
        (the chain has no per-stage call to time a round trip from; Health polls keep measuring it)."""
        with self._lock:
            if node_id in self.clients:
                self._progress[node_id] = self.clock()
                self._ewma(self._step, node_id, max(0.0, worker_ms))

    def last_progress(self, node_id: str) -> float | None:
        """When a stage call to ``node_id`` last finished (this monitor's clock; None: never)."""
        with self._lock:
            return self._progress.get(node_id)

    def rtt_ms(self, node_id: str) -> float | None:
        """The round-trip EWMA to ``node_id`` (None before a good poll)."""
        with self._lock:
            return self._rtt.get(node_id)

    def poll_all(self) -> None:
        for node_id in self.clients:
            self.poll(node_id)

    def start(self) -> None:
        if self._threads:
            return
        self.poll_all()
        for node_id in sorted(self.clients):
            self._start_loop(node_id)

    def _start_loop(self, node_id: str) -> None:
        thread = threading.Thread(target=self._loop, args=(node_id,), name=f"ethen-health-{node_id}",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def add(self, node_id: str, client: WorkerClient) -> None:
        """Watch one more worker (a node that joined); polled at once, then by its own thread."""
        self.clients[node_id] = client
        self.poll(node_id)
        if self._threads and not self._stop.is_set():
            self._start_loop(node_id)

    def remove(self, node_id: str) -> None:
        """Stop watching ``node_id`` (its thread ends within one interval)."""
        self.clients.pop(node_id, None)
        with self._lock:
            for table in (self._last, self._last_good, self._alive, self._rtt, self._step, self._refused,
                          self._progress):
                table.pop(node_id, None)

    def _loop(self, node_id: str) -> None:
        while not self._stop.wait(self.interval_s) and node_id in self.clients:
            self.poll(node_id)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)

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
                rtt = self._rtt.get(node_id, 0.0)
                step = self._step.get(node_id)
                if step is None and self._step:
                    step = sum(self._step.values()) / len(self._step)
            # A node that fails its poll keeps its last known fragments (failover needs them), but is dead.
            reply = last.reply if last.reply is not None else (known.reply if known is not None else None)
            out.append(state_from_health(node_id, reply, alive=last.reply is not None and not blocked,
                                         rtt_ms=rtt, step_ms=step))
        return tuple(out)

    def prefix_holdings(self) -> dict[str, PrefixHolding]:
        """Per watched worker, the prompt prefixes its last good Health reported (issue 45); no call."""
        with self._lock:
            good = {n: h.reply for n, h in self._last_good.items()
                    if n in self.clients and h.reply is not None}
        return {n: PrefixHolding(tuple((r.first, r.last) for r in reply.served_layers),
                                 frozenset(reply.cached_prefixes)) for n, reply in good.items()}

    def session_caps(self) -> dict[str, int]:
        """Per watched worker that answered a Health poll, the sessions it says it holds for this orchestrator
        at most (:func:`~ethen.mesh.orchestrator.load.session_cap`: the smaller of its ``max_sessions`` and
        ``max_sessions_per_caller``, the default for a worker that does not say); no call."""
        with self._lock:
            good = {n: h.reply for n, h in self._last_good.items()
                    if n in self.clients and h.reply is not None}
        return {n: session_cap(r.max_sessions, r.max_sessions_per_caller) for n, r in good.items()}

    def snapshot(self) -> dict[str, NodeHealth]:
        with self._lock:
            return dict(self._last)

    def polled(self, stale_s: float) -> list[tuple[NodeState, HealthReply | None]]:
        """Each watched worker's router state from its last Health poll, and that poll's reply if it is at
        most ``stale_s`` old (a worker that left is not listed); reads the polls, calls no worker."""
        now = self.clock()
        last = self.snapshot()
        out: list[tuple[NodeState, HealthReply | None]] = []
        for node_id in sorted(self.clients):
            h = last.get(node_id)
            reply = h.reply if h is not None and now - h.at <= stale_s else None
            alive = reply is not None and reply.alive and not self.backoff.blocked(node_id, now)
            out.append((state_from_health(node_id, reply, alive), reply))
        return out
