"""A worker whose parent dies stops promptly, even with a session open: SIGTERM normally drains (open sessions
may finish, up to 30 s), but an orphan has nobody to finish them for (a CI run once saw ``kill -9`` of
``ethen up`` leave a worker draining a session the dead gateway had opened, 1 run in 5 on this VM)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np

from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.worker.launch import ORPHAN_EXIT_S

PARENT = textwrap.dedent("""
    import sys, time
    from ethen.mesh.worker.launch import spawn_worker
    w = spawn_worker("orphan", "0-0")
    print(w.pid, w.address, flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


def _orphan_once() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid_text, address = parent.stdout.readline().split()
        pid = int(pid_text)
        with grpc.insecure_channel(address) as channel:
            stub = mesh_pb2_grpc.MeshWorkerStub(channel)  # type: ignore[no-untyped-call]
            hidden = np.zeros((3, 576), np.float32)
            stub.Forward(mesh_pb2.ForwardRequest(
                session_id="left-open", first_layer=0, last_layer=0, positions=[0, 1, 2],
                hidden=mesh_pb2.Tensor(data=hidden.tobytes(), shape=[3, 576], dtype="float32")), timeout=60)
            assert stub.Health(mesh_pb2.HealthRequest(), timeout=5).active_sessions == 1
        parent.kill()
        parent.wait(timeout=10)
        # a drain would hold it for --drain-timeout (30 s)
        assert _gone_within(pid, 8.0), "the orphan still runs (draining a session nobody will finish?)"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)


def test_an_orphaned_worker_with_an_open_session_stops_without_draining() -> None:
    """Three times: the kernel may deliver the death signal while the dying parent's other threads still run
    (the worker is not orphaned yet when its handler looks), which a single run catches only sometimes."""
    for _ in range(3):
        _orphan_once()


STUCK_CHILD = textwrap.dedent("""
    import signal, sys, time
    from ethen.mesh.worker.launch import die_with_parent
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a main thread that never acts on its SIGTERM
    die_with_parent(int(sys.argv[1]))  # (ethen worker --parent-pid)
    time.sleep(600)
""")

STUCK_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdin=subprocess.PIPE)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_an_orphan_whose_main_thread_is_stuck_still_exits() -> None:
    """The parent watch ends the process ORPHAN_EXIT_S after its SIGTERM, whatever the main thread does (here
    it ignores SIGTERM: without the backstop it would run for its whole 600 s sleep)."""
    pid = -1
    parent = subprocess.Popen([sys.executable, "-c", STUCK_PARENT, STUCK_CHILD], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the child is in its sleep, SIGTERM ignored
        assert not _gone(pid)
        parent.kill()
        parent.wait(timeout=10)
        # stdin's end-of-file at once (the pid poll: 1 s), then the grace
        assert _gone_within(pid, ORPHAN_EXIT_S + 4.0), "an orphan ignoring SIGTERM still runs"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if pid > 0 and not _gone(pid):
            os.kill(pid, 9)
