"""Test hosts: Linux network namespaces made by the test itself, a delaying relay in front of each worker.

:class:`Hosts` builds, in the root namespace, a bridge with address ``10.A.B.1/24``, and per host a namespace
``ethent-<pid>-<n>-h<i>`` joined to the bridge by a veth pair (``10.A.B.<10+i>/24`` inside). The test process
(the orchestrator) stays in the root namespace. A :class:`Host` runs one ``ethen worker`` in its namespace,
bound to the namespace's own ``127.0.0.1`` (so nothing reaches it but the relay), and a relay
(:mod:`tests.mesh.relay`) on the host's address that holds each chunk ``delay_ms`` each way. The relay's echo
port measures the added round trip through the same relay. A partition is ``ip link set down`` of the
host's veth end on the bridge; a dead node is ``kill -9`` of its worker; a stuck node is ``SIGSTOP``.

Everything made carries the creating process's pid in its name (namespaces ``ethent-<pid>-...``, links
``et<pid hex>-...``): :func:`cleanup_leftovers` removes those whose process is gone (a run killed before
its teardown), and :meth:`Hosts.close` removes its own (also on failure: use it as a context manager or a
fixture finalizer). :func:`unavailable_reason` says why the hosts cannot be made here (not root, no ``ip``,
``ip netns add`` refused), for ``pytest.skip``.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ethen.mesh.worker.launch import WorkerProcess, spawn_worker

__all__ = ["Host", "Hosts", "RootRelay", "cleanup_leftovers", "unavailable_reason"]

REPO = Path(__file__).resolve().parents[2]
NS_PREFIX = "ethent-"
LINK_PREFIX = "et"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable_reason() -> str | None:
    """``None`` when namespaced hosts can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"ip netns add fails here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and links of this helper whose creating process is gone; returns what it removed."""
    removed: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{NS_PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(rf"\d+: ({LINK_PREFIX}([0-9a-f]+)-[^:@]+)", line)
        if m and not _pid_alive(int(m.group(2), 16)):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _free_subnet() -> str:
    """``10.A.B`` not used by any address here."""
    used = _ip("-o", "addr", "show", check=False).stdout
    base = 100 + os.getpid() % 100
    for b in range(256):
        net = f"10.{base}.{(os.getpid() // 100 + b) % 256}"
        if f" {net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test hosts")


class _RelayControl:
    """Talks to a running relay process: its delay, and the echo round trip through it."""

    ns: str
    ip: str
    relay: subprocess.Popen[str] | None
    echo_port: int
    delay_ms: float

    def _relay_line(self, timeout_s: float = 20.0) -> str:
        assert self.relay is not None and self.relay.stdout is not None
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.relay.stdout.readline()),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not out:
            raise TimeoutError(f"relay on {self.ns}: no answer in {timeout_s} s")
        return out[0].strip()

    def set_delay(self, delay_ms: float) -> None:
        """One-way delay for the chunks that arrive from now on (both directions)."""
        assert self.relay is not None and self.relay.stdin is not None
        self.relay.stdin.write(f"delay {delay_ms}\n")
        self.relay.stdin.flush()
        answer = self._relay_line()
        if answer != f"OK delay {delay_ms}":
            raise RuntimeError(f"relay on {self.ns}: {answer!r}")
        self.delay_ms = delay_ms

    def echo_rtt_ms(self, samples: int = 5) -> float:
        """Median round trip of a 64-byte echo through this host's relay (from the root namespace)."""
        times: list[float] = []
        with socket.create_connection((self.ip, self.echo_port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(samples):
                t0 = time.perf_counter()
                sock.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    chunk = sock.recv(64 - got)
                    if not chunk:
                        raise ConnectionError(f"echo on {self.ns} closed")
                    got += len(chunk)
                times.append((time.perf_counter() - t0) * 1000)
        return sorted(times)[len(times) // 2]

    def _close_relay(self) -> None:
        if self.relay is not None:
            if self.relay.stdin is not None:
                self.relay.stdin.close()  # end-of-file stops it
            try:
                self.relay.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait(timeout=5)


class Host(_RelayControl):
    """One namespaced host: its namespace, address, worker and relay."""

    def __init__(self, hosts: Hosts, index: int) -> None:
        self.index = index
        self.ns = f"{hosts.ns_base}-h{index}"
        self.ip = f"{hosts.subnet}.{10 + index}"
        self.veth = f"{hosts.link_base}v{index}"  # root side, on the bridge
        peer = f"{hosts.link_base}p{index}"
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.ns)
        _ip("link", "set", self.veth, "master", hosts.bridge)
        _ip("link", "set", self.veth, "up")
        self.exec("ip", "link", "set", peer, "name", "eth0")
        self.exec("ip", "addr", "add", f"{self.ip}/24", "dev", "eth0")
        self.exec("ip", "link", "set", "eth0", "up")
        self.exec("ip", "link", "set", "lo", "up")
        self.worker: WorkerProcess | None = None
        self.relay: subprocess.Popen[str] | None = None
        self.port = 0
        self.echo_port = 0
        self.delay_ms = 0.0
        self.stopped = False

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    @property
    def address(self) -> str:
        """The worker's address as the orchestrator (root namespace) reaches it: through the relay."""
        return f"{self.ip}:{self.port}"

    def exec(self, *cmd: str) -> str:
        return subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, check=True,
                              timeout=10).stdout

    def start(self, node_id: str, layers: str, delay_ms: float = 0.0,
              extra_args: tuple[str, ...] = ()) -> Host:
        """Start the worker (loopback of the namespace) and the relay in front of it."""
        self.worker = spawn_worker(node_id, layers, host="127.0.0.1", extra_args=extra_args,
                                   command_prefix=self.prefix)
        self.start_relay(int(self.worker.address.rsplit(":", 1)[1]), delay_ms)
        return self

    def start_relay(self, target_port: int, delay_ms: float = 0.0) -> None:
        """The relay on this host's address in front of ``127.0.0.1:target_port`` of its namespace (the
        worker's port, or any server's: the relay connects to the target per accepted connection)."""
        self.relay = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "tests.mesh.relay", "--listen", f"{self.ip}:0",
             "--target", f"127.0.0.1:{target_port}", "--echo", f"{self.ip}:0", "--delay-ms", str(delay_ms)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1)
        words = self._relay_line().split()
        if len(words) != 3 or words[0] != "READY":
            raise RuntimeError(f"relay on {self.ns} did not start: {words}")
        self.port, self.echo_port = int(words[1]), int(words[2])
        self.delay_ms = delay_ms

    def partition(self) -> None:
        _ip("link", "set", self.veth, "down")

    def heal(self) -> None:
        _ip("link", "set", self.veth, "up")

    def kill_worker(self) -> None:
        assert self.worker is not None
        self.worker.kill()

    def stop_worker(self) -> None:
        """SIGSTOP: the process lives, its sockets stay open, nothing progresses."""
        assert self.worker is not None
        os.kill(self.worker.pid, signal.SIGSTOP)
        self.stopped = True

    def continue_worker(self) -> None:
        assert self.worker is not None
        if self.stopped and self.worker.alive():
            os.kill(self.worker.pid, signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        if self.worker is not None:
            self.continue_worker()
            self.worker.stop(timeout=3)
        self._close_relay()
        _ip("netns", "del", self.ns, check=False)


class RootRelay(_RelayControl):
    """A relay in the root namespace on the bridge's address (``10.A.B.1``) in front of a server of the test
    process itself (e.g. the orchestrator's receiver for a worker-to-worker chain): what the hosts send to
    ``address`` waits ``delay_ms`` like every other crossing. Made by :meth:`Hosts.root_relay`."""

    def __init__(self, ip: str, target_port: int, delay_ms: float) -> None:
        self.ns = "root"
        self.ip = ip
        self.delay_ms = delay_ms
        self.relay = subprocess.Popen(
            [sys.executable, "-m", "tests.mesh.relay", "--listen", f"{ip}:0", "--target",
             f"127.0.0.1:{target_port}", "--echo", f"{ip}:0", "--delay-ms", str(delay_ms)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1)
        words = self._relay_line().split()
        if len(words) != 3 or words[0] != "READY":
            self._close_relay()
            raise RuntimeError(f"root relay did not start: {words}")
        self.port, self.echo_port = int(words[1]), int(words[2])

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def close(self) -> None:
        self._close_relay()


class Hosts:
    """``count`` namespaced hosts on one bridge; a context manager that removes everything it made."""

    def __init__(self, count: int) -> None:
        n = next(_counter)
        self.ns_base = f"{NS_PREFIX}{os.getpid()}-{n}"
        self.link_base = f"{LINK_PREFIX}{os.getpid():x}-{n}"
        self.bridge = f"{self.link_base}br"
        self.hosts: list[Host] = []
        self.root_relays: list[RootRelay] = []
        cleanup_leftovers()
        self.subnet = _free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(count):
                self.hosts.append(Host(self, i))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def root_relay(self, target_port: int, delay_ms: float = 0.0) -> RootRelay:
        """A delaying relay on the bridge address in front of ``127.0.0.1:target_port`` of this process's
        namespace; closed with the hosts."""
        relay = RootRelay(f"{self.subnet}.1", target_port, delay_ms)
        self.root_relays.append(relay)
        return relay

    def set_delay(self, delay_ms: float) -> None:
        """The same one-way delay on every host's relay and every root relay."""
        for r in [*self.hosts, *self.root_relays]:
            r.set_delay(delay_ms)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for relay in self.root_relays:
            relay.close()
        self.root_relays.clear()
        for host in self.hosts:
            try:
                host.close()
            except Exception:  # keep removing the rest
                _ip("netns", "del", host.ns, check=False)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():  # veths left behind
            m = re.match(rf"\d+: ({re.escape(self.link_base)}[^:@]*)", line)
            if m:
                _ip("link", "del", m.group(1), check=False)
