"""Supervision and honesty of a running ``ethen up`` (issue 12): one real ``ethen up`` process (real model,
three real workers: gpu 0-9, mini 0-9 + 10-19, laptop 10-19 + 20-29) shared by the tests of this module.

- ``kill -9`` of a worker in the middle of a stream: the stream completes (failover), the worker is restarted
  on the same address (death and restart logged), the next chat request goes through, ``/metrics`` counts the
  failover and the sessions per node;
- ``/healthz`` is 503 ``degraded`` naming layers 20-29 while the only worker holding them (laptop) is stopped
  (SIGSTOP: it stays down, as a dead host would, without the supervisor bringing it back), 200 ``ok`` again
  once it answers;
- last: ``kill -9`` of ``ethen up`` takes every worker with it, the restarted one included (it was spawned
  from a watcher thread: no Linux death signal, the stdin watch alone)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_up import _env, _gone, _wait_gone

PROMPT = "Count from 1 to 200, one number per line."


class Up:
    """``ethen up --port 0`` with its output drained by a thread (the WARNING log lines keep coming)."""

    def __init__(self, tmp: Path, *extra_args: str) -> None:
        self.data = tmp / "data"
        self.proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", *extra_args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=_env(self.data))
        self.lines: list[str] = []
        self._banner = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            assert self._banner.wait(240) and self.proc.poll() is None, "\n".join(self.lines)
            m = re.search(r"^Ethen is up, ready in [0-9.]+ s since the command started: (\S+)$",
                          self.text, re.M)
            assert m, self.text
            self.base = m.group(1)
            self.key = (self.data / "api_key").read_text().strip()
            # "      ready on 127.0.0.1:PORT (pid N)" after "[2/4] worker i/3: NODE layers ..."
            nodes = re.findall(r"\[2/4\] worker \d/\d: (\S+) layers .*\n\s+ready on (\S+) \(pid (\d+)\)",
                               self.text)
            self.workers = {n: (addr, int(pid)) for n, addr, pid in nodes}
            assert set(self.workers) == {"gpu", "mini", "laptop"}, self.text
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops"):
                self._banner.set()
        self._banner.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, seconds: float) -> re.Match[str]:
        deadline = time.monotonic() + seconds
        while True:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert time.monotonic() < deadline, f"no line matching {pattern!r}:\n{self.text[-3000:]}"
            time.sleep(0.05)

    def pids(self) -> list[int]:
        """Every worker pid this ethen up started (first starts and restarts)."""
        first = [pid for _, pid in self.workers.values()]
        return first + [int(p) for p in re.findall(r"restarted on \S+ \(pid (\d+),", self.text)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in self.pids() if hasattr(self, "workers") else []:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)

    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def chat(self, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(f"{self.base}/chat/completions", timeout=120, headers=self.auth(),
                          json={"model": "ethen/auto", "temperature": 0, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": "What is the capital of France?"}]})

    def healthz(self) -> httpx.Response:
        return httpx.get(f"{self.base}/healthz", timeout=10)

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of the per-node families."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {k: float(v) for k, v in re.findall(r"^(ethen_mesh_node_\S+) (\S+)$", text, re.M)}


def _until(cond: Callable[[], bool], seconds: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up-supervision"))
    yield u
    u.close()


def _series(node: str, family: str) -> str:
    return f'ethen_mesh_node_{family}{{node="{node}",provider="mesh"}}'


def _started_s(pid: int) -> float:
    """When ``pid`` started, in seconds since boot (``/proc/<pid>/stat`` field 22)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def test_the_workers_start_at_once(up: Up) -> None:
    """Issue 24's load time: ``ethen up`` spawns its workers together (4.4 s to ready against 6.1 s one after
    the other on the 2-core VM). One after the other, each started once the one before served: over a
    second apart (each loads its layers first)."""
    starts = [_started_s(pid) for _addr, pid in up.workers.values()]
    assert max(starts) - min(starts) < 0.5, starts
    assert "[2/4] workers: starting 3 at once ..." in up.text


def test_healthz_is_ok_and_metrics_list_every_node(up: Up) -> None:
    r = up.healthz()
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert up.chat().status_code == 200
    m = up.metrics()
    for node in ("gpu", "mini", "laptop"):
        assert m[_series(node, "alive")] == 1.0, m
        assert 0.0 <= m[_series(node, "load")] <= 1.0 and m[_series(node, "latency_ewma_seconds")] >= 0.0
        assert m[_series(node, "failovers_total")] == 0.0
    assert m[_series("laptop", "sessions_total")] >= 1.0  # the only holder of 20-29 served the chat


def test_a_worker_killed_mid_stream_is_restarted_on_its_address_and_serves_again(up: Up) -> None:
    # The victim: the node besides laptop (the only holder of 20-29) on this stream's route, found by the
    # provider's per-node session counter once the stream runs (the route depends on measured latency, so it
    # is read, not assumed). gpu's 0-9 are also on mini; mini's 0-9/10-19 also on gpu + laptop.
    before = up.metrics()
    route = ""
    addr, pid = "", 0
    chunks: list[dict[str, object]] = []
    with httpx.stream("POST", f"{up.base}/chat/completions", timeout=120, headers=up.auth(),
                      json={"model": "ethen/auto", "temperature": 0, "max_tokens": 96, "stream": True,
                            "messages": [{"role": "user", "content": PROMPT}]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 4:
                now = up.metrics()
                (route,) = [n for n in ("gpu", "mini")
                            if now[_series(n, "sessions_total")] > before[_series(n, "sessions_total")]]
                addr, pid = up.workers[route]
                os.kill(pid, signal.SIGKILL)
    mesh = chunks[-1]["ethen"]["routing"]["mesh"]  # type: ignore[index]
    assert [f["failed_node"] for f in mesh["failovers"]] == [route], mesh  # the stream completed
    died = up.wait_line(rf"WARNING ethen\.mesh\.supervisor: mesh worker {route} \(pid {pid}, {addr}\) died: "
                        r"killed by SIGKILL; restarting in 0\.5 s$", 10)
    restarted = up.wait_line(rf"WARNING ethen\.mesh\.supervisor: mesh worker {route} restarted on {addr} "
                             r"\(pid (\d+), restart 1\)$", 60)
    assert died and int(restarted.group(1)) != pid
    # the orchestrator polls the same address: the node is routable again without any config change
    _until(lambda: up.metrics().get(_series(route, "alive")) == 1.0, 15, lambda: str(up.metrics()))
    r2 = up.chat()
    assert r2.status_code == 200, r2.text
    after = up.metrics()
    assert after[_series(route, "failovers_total")] == before[_series(route, "failovers_total")] + 1
    assert after[_series("laptop", "sessions_total")] == before[_series("laptop", "sessions_total")] + 2


def test_healthz_is_degraded_naming_the_layers_while_their_only_worker_is_down(up: Up) -> None:
    _, pid = up.workers["laptop"]
    os.kill(pid, signal.SIGSTOP)  # alive to the supervisor, silent to Health: down until SIGCONT
    try:
        _until(lambda: up.healthz().status_code == 503, 15, lambda: up.healthz().text)
        body = up.healthz().json()
        assert body["status"] == "degraded" and body["serving"] is False, body
        (reason,) = body["reasons"]
        assert "no live worker holds layers 20-29" in reason and "laptop" in reason, reason
        assert up.metrics()[_series("laptop", "alive")] == 0.0
    finally:
        os.kill(pid, signal.SIGCONT)
    _until(lambda: up.healthz().status_code == 200, 15, lambda: up.healthz().text)
    assert up.healthz().json() == {"status": "ok"}
    assert up.chat().status_code == 200


def test_kill_9_of_ethen_up_takes_the_restarted_worker_too(up: Up) -> None:  # last: ends the process
    pids = up.pids()
    assert len(pids) == 4, up.text  # three first starts and the restart of the killed one
    alive = [p for p in pids if not _gone(p)]
    assert len(alive) == 3
    up.proc.kill()
    up.proc.wait(timeout=10)
    # bounded, and generous for a loaded CI machine: a worker's own exit (gRPC server stop, interpreter
    # shutdown with ~250 MB of weights) took over 5 s once in CI; an orphan would stay for good
    left = _wait_gone(alive, 20.0)
    assert left == [], [(p, _proc_state(p)) for p in left]


def _proc_state(pid: int) -> str:
    """A lingering process's state and kernel wait channel (for the failure message)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        ppid = next(line for line in status.splitlines() if line.startswith("PPid:"))
        state = next(line for line in status.splitlines() if line.startswith("State:"))
        return f"{state}; {ppid}; wchan {wchan}"
    except (OSError, StopIteration):
        return "gone"
