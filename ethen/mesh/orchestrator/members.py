"""Which joined workers an orchestrator routes to: announcements to this process's registry, the shared
membership in Redis or the gateway's store (other gateway instances' registries), and expiry.

:class:`Membership` sits between the registry (:mod:`ethen.mesh.orchestrator.registry`, which calls
:meth:`Membership.join` / :meth:`Membership.leave`) and the orchestrator (``add_worker`` /
``remove_worker``). Rules, where issue 12 left the choice:

- **Expiry.** A joined node not announced for ``expiry_s`` seconds (mesh provider ``member_expiry_s``,
  default 10 s; workers announce every ``heartbeat_s`` = min(2 s, expiry / 4), the registry tells them) is
  removed from the orchestrator: from routing, health and metrics. Its failed Health polls took it out of
  routing within 1 s already; expiry ends the listing. If it announces again it comes back. A statically
  configured worker (``workers = {...}``) is never removed, and a ``Join`` naming a static node id is refused
  (the registry answers ``ALREADY_EXISTS``): a joined worker cannot take over a configured one's name.
- **Shared** (``shared``: the provider has ``join`` and the gateway has ``[shared]`` Redis, else its
  ``[store]``; one interface, :class:`~ethen.mesh.orchestrator.shared_members.MemberBackend`). Each
  announcement to this registry is routed here at once and written to Redis with the expiry
  (:mod:`~ethen.mesh.orchestrator.shared_members`); every ``poll_s`` (0.25 s) each instance reads the
  shared membership and routes to the nodes it lists, so a worker that joined any instance is routed by all
  within ~0.25 s (+ one Health poll) and leaves them all when Redis drops its key. While Redis is
  reachable its list is the membership (plus this registry's own fresh announcements). **Redis
  unreachable**: routing keeps the last membership read (nothing read from Redis expires meanwhile: this
  process cannot tell a dead worker from a dead Redis; Health still takes dead nodes out of routing), this
  registry's own announcements keep being routed and expire as without Redis; one WARNING per outage and
  one when Redis answers again.
- **Store** (no Redis, a ``[store]``: :mod:`~ethen.mesh.orchestrator.store_members`): the same rules with
  the ``mesh_members`` table instead of Redis keys, polled every ``poll_s`` = 0.5 s (one indexed query per
  poll: a worker that joined any instance is routed by all within ~0.5 s + one Health poll, inside the
  issue's 2 s); a ``Leave`` deletes the row, a row lapses ``expiry_s`` after its last announcement (the
  database's clock); store unreachable: as Redis unreachable above.
- Without Redis or store, membership is per process: a worker is routed by the gateway process whose
  registry it joined.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ethen.mesh.orchestrator.shared_members import Announcement, MemberBackend, SharedMembersUnavailable

__all__ = ["DEFAULT_EXPIRY_S", "REDIS_POLL_S", "STORE_POLL_S", "Membership", "Routing"]

log = logging.getLogger("ethen.mesh.orchestrator")

DEFAULT_EXPIRY_S = 10.0
_MAX_HEARTBEAT_S = 2.0
REDIS_POLL_S = 0.25  # how often the shared membership is read: Redis
STORE_POLL_S = 0.5  # the store: half Redis's rate (a query costs more), well inside the 2 s join target


class Routing(Protocol):
    """What membership changes: the orchestrator's watched workers."""

    def add_worker(self, node_id: str, address: str) -> bool: ...

    def remove_worker(self, node_id: str, address: str | None = None) -> bool: ...


class Membership:
    """The joined workers of one orchestrator (module docstring). :meth:`start` runs the loop that reads the
    shared membership and expires silent nodes; without it, joins and leaves still apply (no expiry)."""

    def __init__(self, routing: Routing, *, static: Iterable[str] = (), expiry_s: float = DEFAULT_EXPIRY_S,
                 shared: MemberBackend | None = None, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.routing = routing
        self.static = frozenset(static)
        self.expiry_s = expiry_s
        self.shared = shared
        if poll_s is None:
            poll_s = STORE_POLL_S if shared is not None and shared.kind == "store" else REDIS_POLL_S
        self.poll_s = poll_s
        self.clock = clock
        self.heartbeat_s = min(_MAX_HEARTBEAT_S, expiry_s / 4)
        self._lock = threading.RLock()
        self._local: dict[str, tuple[Announcement, float]] = {}  # announced here -> (what, when: clock)
        self._view: dict[str, Announcement] = {}  # the last shared membership read
        self._view_at = float("-inf")  # when that read started (clock)
        self._left: dict[str, tuple[str, float]] = {}  # Leave here: node -> (address, when)
        self.shared_ok: bool | None = None  # the last shared call answered (None: none made yet)
        self._applied: dict[str, str] = {}  # joined nodes the orchestrator watches -> their address
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.removed = 0  # joined nodes removed by the loop (silent, or left through another instance)

    # ---- the registry's side ---------------------------------------------------------------------------

    def refusal(self, node_id: str) -> str | None:
        """Why ``node_id`` may not join (None: it may)."""
        if node_id in self.static:
            return (f"node_id {node_id!r} is a statically configured worker of this mesh "
                    f"(workers = {{...}}); a joining worker needs another --node-id")
        return None

    def join(self, node_id: str, address: str, fragments: Sequence[tuple[int, int]] = ()) -> bool:
        """An announcement (``Join``, also the heartbeat): route to the node now, share it; True when the
        orchestrator did not watch it at that address before."""
        a = Announcement(node_id, address, tuple(fragments))
        with self._lock:
            self._local[node_id] = (a, self.clock())
            self._applied[node_id] = address
            added = self.routing.add_worker(node_id, address)
        # Redis (or the store) known away: do not make the worker's Join (2 s deadline) wait for it; the loop
        # notices when it is back and the next heartbeat writes the announcement
        if self.shared is not None and self.shared_ok is not False:
            try:
                self.shared.write(a, self.expiry_s)
            except SharedMembersUnavailable as exc:
                self._shared_down(exc)
            else:
                self._shared_up()
        return added

    def leave(self, node_id: str, address: str) -> bool:
        """A draining worker's ``Leave``: stop routing to it here and in every instance; True when removed."""
        with self._lock:
            self._left[node_id] = (address, self.clock())
            mine = self._local.get(node_id)
            if mine is not None and mine[0].address == address:
                del self._local[node_id]
            view = self._view.get(node_id)
            if view is not None and view.address == address:
                del self._view[node_id]
        if self.shared is not None:
            try:
                self.shared.delete(node_id, address)
            except SharedMembersUnavailable as exc:
                self._shared_down(exc)
            else:
                self._shared_up()
        with self._lock:
            if self._applied.get(node_id) == address:
                del self._applied[node_id]
            return self.routing.remove_worker(node_id, address)

    # ---- the loop: shared membership in, silent nodes out ----------------------------------------------

    def start(self) -> Membership:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ethen-membership", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3.0)
            self._thread = None
        if self.shared is not None:
            self.shared.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.poll_s)

    def tick(self) -> None:
        """Read the shared membership (if any), then add and remove joined nodes to match it."""
        if self.shared is not None:
            at = self.clock()
            try:
                view = self.shared.read()
            except SharedMembersUnavailable as exc:
                self._shared_down(exc)
            else:
                self._shared_up()
                with self._lock:
                    self._view, self._view_at = view, at
        with self._lock:
            self._reconcile(self.clock())

    def members(self) -> dict[str, str]:
        """The joined nodes routed now (node id -> address)."""
        with self._lock:
            return dict(self._applied)

    def _wanted(self, now: float) -> dict[str, str]:  # under self._lock
        for node_id, (_, seen) in list(self._local.items()):
            if now - seen > self.expiry_s:
                del self._local[node_id]
        for node_id, (_, at) in list(self._left.items()):
            if now - at > self.expiry_s:
                del self._left[node_id]
        wanted: dict[str, str] = {}
        if self.shared is not None:
            for n, a in self._view.items():
                left = self._left.get(n)
                if left is None or left[0] != a.address or left[1] < self._view_at:
                    wanted[n] = a.address  # (not a Leave made here after this view was read)
        for n, (a, seen) in self._local.items():
            # an announcement here after the view was read (or while Redis is away) is the fresher word
            if n not in wanted or seen >= self._view_at or self.shared_ok is False:
                wanted[n] = a.address
        for n in self.static & wanted.keys():
            del wanted[n]
        return wanted

    def _reconcile(self, now: float) -> None:  # under self._lock
        wanted = self._wanted(now)
        for node_id, address in list(self._applied.items()):
            if wanted.get(node_id) == address:
                continue
            del self._applied[node_id]
            if self.routing.remove_worker(node_id, address) and node_id not in wanted:
                self.removed += 1
                how = "expired" if self.shared is None else "left the mesh or expired"
                log.warning("mesh worker %s at %s %s (no announcement within %.1f s): removed from routing",
                            node_id, address, how, self.expiry_s)
        for node_id, address in wanted.items():
            if self._applied.get(node_id) != address:
                self._applied[node_id] = address
                if self.routing.add_worker(node_id, address):
                    log.warning("mesh worker %s joined at %s (shared membership)", node_id, address)

    # ---- Redis / store transitions: one WARNING each way ------------------------------------------------

    def _shared_down(self, exc: SharedMembersUnavailable) -> None:
        if self.shared_ok is not False:
            log.warning("mesh membership: %s; routing keeps the last known membership (%d joined node(s)) "
                        "until %s answers", exc, len(self._applied), self._kind)
        self.shared_ok = False

    @property
    def _kind(self) -> str:
        return "redis" if self.shared is None else self.shared.kind

    def _shared_up(self) -> None:
        if self.shared_ok is False:
            log.warning("mesh membership: %s answers again; the shared membership is read again", self._kind)
        self.shared_ok = True
