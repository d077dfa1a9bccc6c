"""Start ``ethen worker`` child processes and wait until they serve (used by ``ethen up``, tests, benches).

A worker prints ``READY host:port`` once its layers are loaded and its port is bound; :func:`spawn_worker`
waits for that line (``port=0`` lets the OS pick a free port, so parallel test runs never collide).

Children get ``OPENBLAS_NUM_THREADS=1`` (and the OMP/MKL equivalents) unless the caller set them: a decode
step is a chain of small matmuls, and several processes each spinning a BLAS thread pool on a few shared
cores ran 3x slower than single-threaded BLAS here (measured: 68 ms vs 21 ms per token under load). For the
same reason they get ``--thread-pool session`` unless the caller's ``extra_args`` give one: the engine's
threads sleep between a step's parallel ops instead of spinning (``ethen worker``'s own default, ``shared``,
is for a worker alone on its machine; :func:`ethen.model.engine.shared_pool`).

Workers die with their parent, whatever signal killed it (``kill -9`` of ``ethen up`` must not leave three
~250 MB workers behind). :func:`spawn_worker` passes the parent's pid (the hidden flag ``--parent-pid``; with
``--parent-deathsig`` when spawned from the main thread) and an open stdin pipe; the worker calls
:func:`die_with_parent` first thing, which

- on Linux asks the kernel for ``SIGTERM`` when the parent dies (``prctl(PR_SET_PDEATHSIG)`` via ctypes),
  then checks the parent is still the one named (it may have died before the request took effect). Linux sends
  that signal when the *thread* that spawned the child exits, so it is requested only for workers spawned from
  the main thread;
- everywhere (the portable fallback): watches its stdin pipe from a daemon thread; the parent holds the only
  write end, so end-of-file means the parent is gone; the same thread also checks the parent pid once a second
  (a forked grandchild holding a copy of the pipe cannot keep the worker alive).

Either way the worker sends itself ``SIGTERM``: the default action while it loads, a prompt stop once it
serves. A SIGTERM normally drains (open sessions may finish, up to ``--drain-timeout``), but an orphaned
worker (:func:`orphaned`: its parent is gone) has nobody left to finish sessions for and nobody to answer, so
it stops without draining (a session left open by the dead parent must not keep it alive for 30 s). The
kernel may send the death signal while the dying parent's other threads still run (the worker is then the
child of one of them for a moment: same pid, not yet orphaned), so a drain also gives up once the parent is
really gone (seen: 1 in 5 ``kill -9`` runs drained for the full 30 s before this). And whatever the main
thread is doing when the parent goes (a step still computing, a stop that blocks), the watch thread ends the
process with ``os._exit`` :data:`ORPHAN_EXIT_S` seconds after its SIGTERM: an orphan answers nobody (CI saw a
``kill -9``'d ``ethen up`` leave one worker running past 5 s).
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ORPHAN_EXIT_S", "WorkerProcess", "die_with_parent", "orphaned", "parent_args", "spawn_worker",
           "worker_command", "worker_env"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_S = 2.0  # an orphan still running this long after its SIGTERM exits at once
ORPHAN_EXIT_CODE = 128 + int(signal.SIGTERM)  # what a SIGTERM'd process reports
_watched_parent: int | None = None  # set by die_with_parent


@dataclass
class WorkerProcess:
    node_id: str
    layers: str
    process: subprocess.Popen[str]
    address: str = ""
    output: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, as far as the mesh can tell)."""
        if self.alive():
            self.process.kill()
        self.process.wait(timeout=10)
        self._close_stdin()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.process.stdin is not None and self.process.poll() is not None:
            self.process.stdin.close()


def worker_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def parent_args() -> list[str]:
    """The hidden flags (``ethen worker``, ``ethen gateway``) that make a direct child of this process call
    :func:`die_with_parent` on it: ``--parent-pid PID``, and ``--parent-deathsig`` from the main thread
    (Linux sends the death signal when the spawning *thread* exits)."""
    args = ["--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        args.append("--parent-deathsig")
    return args


def _request_death_signal() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent (thread) exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the stdin watch still applies
        pass


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent: int) -> None:
    """Until stdin reaches end-of-file or the parent pid changes, then SIGTERM to this process, and if it is
    still running :data:`ORPHAN_EXIT_S` later, ``os._exit`` (no cleanup is owed to a dead parent)."""
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    while os.getppid() == parent:
        if fd < 0:
            threading.Event().wait(1.0)
            continue
        try:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready and not os.read(fd, 4096):
                break  # end-of-file: the parent's write end is closed
        except (OSError, ValueError):
            fd = -1  # stdin unusable: keep watching the pid
    _terminate_self()
    threading.Event().wait(ORPHAN_EXIT_S)
    os._exit(ORPHAN_EXIT_CODE)


def orphaned() -> bool:
    """True when :func:`die_with_parent` watches a parent and that parent is gone (or never was)."""
    return _watched_parent is not None and os.getppid() != _watched_parent


def die_with_parent(parent_pid: int | None, deathsig: bool = False) -> None:
    """In a worker started by :func:`spawn_worker` (``--parent-pid`` given): stop when process ``parent_pid``
    dies; ``deathsig``: also ask the kernel for SIGTERM then (``--parent-deathsig``). A no-op without a pid
    (a worker started by hand keeps its terminal's stdin untouched)."""
    if parent_pid is None or parent_pid <= 0:
        return
    global _watched_parent
    parent = _watched_parent = parent_pid
    if deathsig:
        _request_death_signal()
    if os.getppid() != parent:  # gone already (before the death signal was requested)
        _terminate_self()
        return
    threading.Thread(target=_watch_parent, args=(parent,), name="ethen-parent-watch", daemon=True).start()


def worker_command(node_id: str, layers: str, port: int = 0, host: str = "127.0.0.1",
                   extra_args: Sequence[str] = (), command_prefix: Sequence[str] = ()) -> list[str]:
    """The command line :func:`spawn_worker` runs: ``--thread-pool session`` unless ``extra_args`` give a
    ``--thread-pool`` (workers started here share this machine's cores)."""
    cmd = [*command_prefix, sys.executable, "-m", "ethen", "worker", "--node-id", node_id, "--layers", layers,
           "--port", str(port), "--host", host, *extra_args]
    if not any(a == "--thread-pool" or a.startswith("--thread-pool=") for a in extra_args):
        cmd += ["--thread-pool", "session"]
    return cmd


def spawn_worker(node_id: str, layers: str, port: int = 0, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), timeout_s: float = 120.0,
                 command_prefix: Sequence[str] = (), own_process_group: bool = False) -> WorkerProcess:
    """Start ``python -m ethen worker`` and return once it printed ``READY`` (raises on exit or timeout).
    ``command_prefix`` wraps the command (tests: ``ip netns exec NS``, which execs in place, same pid).
    ``own_process_group``: the worker gets its own process group, so a terminal's Ctrl-C reaches only this
    process, which stops its workers in its own order (``ethen up``: the gateway first)."""
    cmd = [*worker_command(node_id, layers, port, host, extra_args, command_prefix), *parent_args()]
    # stdin: a pipe the child never reads data from; its end-of-file tells the child this process died.
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, env=worker_env(),
                            process_group=0 if own_process_group else None)
    worker = WorkerProcess(node_id, layers, proc)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            worker.output.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name=f"ethen-worker-{node_id}-out", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            worker.stop()
            raise TimeoutError(
                f"worker {node_id!r} not ready after {timeout_s}s: {worker.output[-5:]}") from None
        if line is None:
            raise RuntimeError(f"worker {node_id!r} exited with {proc.wait()}: {worker.output[-10:]}")
        if line.startswith("READY "):
            worker.address = line.split()[1]
            return worker
