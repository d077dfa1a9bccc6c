"""Keep ``ethen worker`` child processes running: restart a worker that dies, on the same address.

``ethen up`` uses it; tests drive it directly with real worker processes::

    sup = Supervisor()
    w = sup.add("gpu", "0-9", extra_args=["--capacity-score", "10"])   # spawns now, returns once READY
    sup.start()                                                        # watch: restart on death
    ...
    sup.stop()                                                         # SIGTERM every worker, no restart

A worker is first started with ``port=0`` (the OS picks a free port) and every restart asks for the port it
got, so its address never changes: a gateway config listing worker addresses (``ethen up``'s) and the mesh
orchestrator's Health polling pick the restarted worker up without a config change.

One watcher thread per worker blocks in ``wait()`` on its process (no polling). When the process exits
without :meth:`Supervisor.stop` having been called, the watcher logs one WARNING line (logger
``ethen.mesh.supervisor``) with the node id, pid, exit code or signal and the delay before the restart, waits
that delay, and spawns the worker again; a successful restart logs one WARNING line with the new pid and the
address; a restart that fails (the worker exits before ``READY``, e.g. bad layers, or a port taken meanwhile)
logs one WARNING line with the reason and the next delay.

Back-off (:class:`RestartBackoff`, the issue leaves the numbers open): 0.5 s after a death, doubling with
each further failure (a death or a failed restart) up to 30 s; a worker that stayed up 60 s has its delay
reset to 0.5 s. So a worker that cannot start costs one spawn per 30 s at worst, never a busy loop.

Restarted workers are spawned from a watcher thread, so they do not get Linux's parent-death signal (it would
fire when that thread ends, see :mod:`ethen.mesh.worker.launch`); they still exit when this process dies,
``kill -9`` included, through the stdin-pipe and parent-pid watch.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ethen.mesh.worker.launch import WorkerProcess, spawn_worker

__all__ = ["RestartBackoff", "Supervisor", "describe_exit"]

log = logging.getLogger("ethen.mesh.supervisor")

#: ``(node_id, layers, port, host, extra_args) -> WorkerProcess`` once the worker is ready.
Spawn = Callable[[str, str, int, str, Sequence[str]], WorkerProcess]


def _spawn(node_id: str, layers: str, port: int, host: str, extra_args: Sequence[str]) -> WorkerProcess:
    # own process group: a terminal's Ctrl-C reaches the supervising process alone, which stops its
    # workers after the gateway (so the gateway never sees them vanish: no "is dead" lines on shutdown)
    return spawn_worker(node_id, layers, port=port, host=host, extra_args=extra_args, own_process_group=True)


def describe_exit(returncode: int) -> str:
    """``"killed by SIGKILL"`` / ``"exit code 3"`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(slots=True)
class RestartBackoff:
    """Delay before the next restart of one worker (pure: times are arguments)."""

    base_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s or self.reset_after_s <= 0:
            raise ValueError(f"need 0 < base_s <= max_s and reset_after_s > 0; got base_s={self.base_s}, "
                             f"max_s={self.max_s}, reset_after_s={self.reset_after_s}")

    def next_delay(self, up_for_s: float) -> float:
        """One more failure after the worker ran ``up_for_s`` seconds (0 for a failed start): the delay."""
        if up_for_s >= self.reset_after_s:
            self.failures = 0
        self.failures += 1
        return min(self.max_s, self.base_s * 2.0 ** (self.failures - 1))


@dataclass(slots=True)
class _Slot:
    node_id: str
    layers: str
    host: str
    extra_args: tuple[str, ...]
    worker: WorkerProcess
    port: int
    started_at: float
    backoff: RestartBackoff
    restarts: int = 0
    thread: threading.Thread | None = field(default=None, repr=False)


class Supervisor:
    """Spawns workers, restarts any that dies (same address, with back-off), stops them all on :meth:`stop`.

    ``spawn`` is how a worker process is started (default: :func:`~ethen.mesh.worker.launch.spawn_worker`);
    ``base_s`` / ``max_s`` / ``reset_after_s`` configure each worker's :class:`RestartBackoff`."""

    def __init__(self, *, base_s: float = 0.5, max_s: float = 30.0, reset_after_s: float = 60.0,
                 spawn: Spawn = _spawn, clock: Callable[[], float] = time.monotonic) -> None:
        RestartBackoff(base_s, max_s, reset_after_s)  # validates the numbers now
        self._backoff = (base_s, max_s, reset_after_s)
        self._spawn = spawn
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._stopping = threading.Event()
        self._started = False

    # ---- what callers read ------------------------------------------------------------------------------

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        """The current process of each worker (a restart replaces it)."""
        with self._lock:
            return {n: s.worker for n, s in self._slots.items()}

    @property
    def addresses(self) -> dict[str, str]:
        """``node_id -> host:port``; stable across restarts."""
        with self._lock:
            return {n: s.worker.address for n, s in self._slots.items()}

    def restarts(self, node_id: str) -> int:
        """How many times ``node_id`` was restarted successfully."""
        with self._lock:
            return self._slots[node_id].restarts

    # ---- life cycle -------------------------------------------------------------------------------------

    def add(self, node_id: str, layers: str, *, port: int = 0, host: str = "127.0.0.1",
            extra_args: Sequence[str] = ()) -> WorkerProcess:
        """Spawn a worker now (in the calling thread) and return it once it serves; it is watched from
        :meth:`start` on (or at once when the supervisor is already started). Raises what
        :func:`~ethen.mesh.worker.launch.spawn_worker` raises when it does not start."""
        with self._lock:
            if node_id in self._slots:
                raise ValueError(f"worker {node_id!r} is already supervised")
        if self._stopping.is_set():
            raise RuntimeError("the supervisor is stopped")
        args = tuple(extra_args)
        worker = self._spawn(node_id, layers, port, host, args)
        bound = int(worker.address.rsplit(":", 1)[1])
        backoff = RestartBackoff(*self._backoff)
        slot = _Slot(node_id, layers, host, args, worker, bound, self._clock(), backoff)
        with self._lock:
            self._slots[node_id] = slot
            if self._started:
                self._watch(slot)
        return worker

    def start(self) -> Supervisor:
        """Watch every worker added so far (and those added later)."""
        with self._lock:
            if not self._started:
                self._started = True
                for slot in self._slots.values():
                    self._watch(slot)
        return self

    def stop(self, timeout: float = 3.0) -> None:
        """Stop supervising and stop every worker (SIGTERM, SIGKILL after ``timeout`` s). A restart in
        progress is stopped as soon as its worker is ready. Idempotent."""
        self._stopping.set()
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            slot.worker.stop(timeout=timeout)
        for slot in slots:
            if slot.thread is not None and slot.thread is not threading.current_thread():
                slot.thread.join(timeout=timeout + 5.0)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the watcher ------------------------------------------------------------------------------------

    def _watch(self, slot: _Slot) -> None:  # with self._lock held
        slot.thread = threading.Thread(target=self._run, args=(slot,), name=f"ethen-supervise-{slot.node_id}",
                                       daemon=True)
        slot.thread.start()

    def _run(self, slot: _Slot) -> None:
        while not self._stopping.is_set():
            worker = slot.worker
            code = worker.process.wait()
            worker.stop()  # reaped already; closes its stdin pipe
            if self._stopping.is_set():
                return
            delay = slot.backoff.next_delay(self._clock() - slot.started_at)
            log.warning("mesh worker %s (pid %d, %s) died: %s; restarting in %.1f s", slot.node_id,
                        worker.pid, worker.address, describe_exit(code), delay)
            if not self._restart(slot, delay):
                return

    def _restart(self, slot: _Slot, delay: float) -> bool:
        """Wait ``delay``, then spawn until a worker serves (backing off on failures). False: stopping."""
        while not self._stopping.wait(delay):
            try:
                worker = self._spawn(slot.node_id, slot.layers, slot.port, slot.host, slot.extra_args)
            except (RuntimeError, TimeoutError, OSError) as exc:
                delay = slot.backoff.next_delay(0.0)
                log.warning("mesh worker %s did not restart on %s:%d: %s; next attempt in %.1f s",
                            slot.node_id, slot.host, slot.port, _one_line(exc), delay)
                continue
            with self._lock:
                if self._stopping.is_set():
                    stale = True
                else:
                    stale = False
                    slot.worker, slot.started_at = worker, self._clock()
                    slot.restarts += 1
            if stale:
                worker.stop()
                return False
            log.warning("mesh worker %s restarted on %s (pid %d, restart %d)", slot.node_id, worker.address,
                        worker.pid, slot.restarts)
            return True
        return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
