"""Start ``ethen worker`` child processes and wait until they serve (used by ``ethen up``, tests, benches).

A worker prints ``READY host:port`` once its layers are loaded and its port is bound; :func:`spawn_worker`
waits for that line (``port=0`` lets the OS pick a free port, so parallel test runs never collide).

Children get ``OPENBLAS_NUM_THREADS=1`` (and the OMP/MKL equivalents) unless the caller set them: a decode
step is a chain of small matmuls, and several processes each spinning a BLAS thread pool on a few shared
cores ran 3x slower than single-threaded BLAS here (measured: 68 ms vs 21 ms per token under load).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["WorkerProcess", "spawn_worker", "worker_env"]


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

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def worker_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def spawn_worker(node_id: str, layers: str, port: int = 0, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), timeout_s: float = 120.0) -> WorkerProcess:
    """Start ``python -m ethen worker`` and return once it printed ``READY`` (raises on exit or timeout)."""
    cmd = [sys.executable, "-m", "ethen", "worker", "--node-id", node_id, "--layers", layers,
           "--port", str(port), "--host", host, *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=worker_env())
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
