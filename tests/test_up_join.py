"""``ethen up --join HOST:PORT`` (issue 12: "a worker joins a running mesh ... to the mesh provider of a
gateway (or of ``ethen up``)"): the banner prints a worker command that runs as printed; the worker it
starts is routed within 2 s of its ``READY`` and serves requests when the local holder of its layers is
down. A bad ``--join`` stops ``ethen up`` before anything loads, naming the flag."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.test_up import _env
from tests.test_up_supervision import Up, _series, _until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ethen_up(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ethen", "up", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, env=_env(tmp / "data"), stdin=subprocess.DEVNULL)


def test_a_worker_started_as_the_banner_prints_joins_ethen_up_and_serves(tmp_path: Path) -> None:
    registry = f"127.0.0.1:{_free_port()}"
    up = Up(tmp_path, "--join", registry)
    worker: subprocess.Popen[str] | None = None
    _, laptop = up.workers["laptop"]
    try:
        m = re.search(r"^Workers join the mesh at (\S+) .*\n  (.+)$", up.text, re.M)
        assert m and m.group(1) == registry, up.text
        cmd = shlex.split(m.group(2))
        assert cmd[1:4] == ["worker", "--join", registry] and "--token-file" in cmd, cmd
        worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=_env(up.data), stdin=subprocess.DEVNULL)
        assert worker.stdout is not None
        lines: list[str] = []
        for line in worker.stdout:  # bounded: the worker exits (EOF) or prints READY once its layers load
            lines.append(line)
            if line.startswith("READY "):
                break
        assert lines and lines[-1].startswith("READY "), "".join(lines)
        ready = time.monotonic()
        _until(lambda: up.metrics().get(_series("extra", "alive")) == 1.0, 2.0, lambda: str(up.metrics()))
        print(f"\njoined worker routed {time.monotonic() - ready:.2f} s after READY")
        assert "mesh worker extra joined at" in up.text
        # the only local holder of 20-29 goes silent: the joined worker serves those layers
        os.kill(laptop, signal.SIGSTOP)
        nodes: list[str] = []

        def routed_over_extra() -> bool:
            r = up.chat()
            assert r.status_code == 200, r.text
            nodes[:] = r.json()["ethen"]["routing"]["mesh"]["route"]["nodes"]
            return "extra" in nodes

        _until(routed_over_extra, 20, lambda: f"route {nodes}")
        assert up.healthz().status_code == 200  # 20-29 stay covered
    finally:
        os.kill(laptop, signal.SIGCONT)
        if worker is not None:
            worker.kill()
            worker.wait(10)
        up.close()


def test_a_bad_join_stops_ethen_up_before_anything_loads_naming_the_flag(tmp_path: Path) -> None:
    t0 = time.monotonic()
    open_port = _ethen_up(tmp_path, "--join", "0.0.0.0:50999")
    assert open_port.returncode == 2
    assert "--join 0.0.0.0:50999: a registry other hosts reach needs --tls-cert and --tls-key" in (
        open_port.stdout + open_port.stderr)
    bad = _ethen_up(tmp_path, "--join", "nonsense")
    assert bad.returncode == 2 and "join = 'nonsense': must be 'host:port'" in bad.stdout + bad.stderr
    half = _ethen_up(tmp_path, "--join", "127.0.0.1:50999", "--tls-cert", str(tmp_path / "c.pem"))
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stdout + half.stderr
    missing = _ethen_up(tmp_path, "--join", "127.0.0.1:50999", "--tls-cert", str(tmp_path / "c.pem"),
                        "--tls-key", str(tmp_path / "k.pem"))
    assert missing.returncode == 2 and "tls_cert = " in missing.stdout + missing.stderr
    assert "no such file" in missing.stdout + missing.stderr
    assert time.monotonic() - t0 < 40  # four starts, none loaded the model or a worker
    assert not (tmp_path / "data" / "up-gateway.toml").exists()


def test_the_gateway_document_carries_join_and_tls() -> None:
    from ethen.up_config import gateway_document

    doc = gateway_document("127.0.0.1", 8080, "k" * 32, {"a": "127.0.0.1:1"}, join="0.0.0.0:50050",
                           tls=("/c.pem", "/k.pem"), token_file="/t")
    (mesh,) = doc["providers"]
    assert (mesh["join"], mesh["tls_cert"], mesh["tls_key"], mesh["token_file"]) == (
        "0.0.0.0:50050", "/c.pem", "/k.pem", "/t")
    plain = gateway_document("127.0.0.1", 8080, "k" * 32, {"a": "127.0.0.1:1"})["providers"][0]
    assert "join" not in plain and "tls_cert" not in plain
