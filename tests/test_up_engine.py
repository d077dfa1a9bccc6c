"""``ethen up --accuracy fast`` (ggml: int8 activations): the choice reaches the workers (on their command
lines) and the head (the generated gateway config), which run on ggml (their processes map ggml's CPU
library), whatever ``ETHEN_ACCURACY`` / ``ETHEN_DEVICE`` say (no longer read: one warning line each), and the
mesh answers; a bad ``--engine`` / ``--accuracy`` is refused naming it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf

pytest.importorskip("libggml")


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "ETHEN_DATA_DIR": str(tmp / "data"), "XDG_CACHE_HOME": str(tmp / "cache")}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL", "ETHEN_ENGINE", "ETHEN_ACCURACY",
                "ETHEN_DEVICE"):
        env.pop(var, None)
    return env


def _maps_ggml(pid: int) -> bool:
    return "libggml-cpu" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps (Linux)")
def test_ethen_up_accuracy_fast_runs_the_workers_and_the_head_on_ggml(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(types=("Q4_K",), embd_type="Q8_0", n_layers=4,
                                                         name="tiny ggml", quantizer="ggml"))
    # a small model: auto would run it on onnxruntime; the gone variables ask for exact (onnx) and metal
    # (refused here if read): both ignored
    env = {**_env(tmp_path), "ETHEN_ACCURACY": "exact", "ETHEN_DEVICE": "metal"}
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path),
                             "--accuracy", "fast"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # bounded: EOF when the process exits, or the banner's last line
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops"):
                break
            assert time.monotonic() < deadline, lines
        text = "\n".join(lines)
        m = re.search(r"^Ethen is up, ready in [0-9.]+ s since the command started: (\S+)$", text, re.M)
        assert m, text
        key = (tmp_path / "data" / "api_key").read_text().strip()
        r = httpx.post(f"{m.group(1)}/chat/completions", timeout=120,
                       headers={"authorization": f"Bearer {key}"},
                       json={"model": "ethen/auto", "temperature": 0, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hello mesh"}]})
        assert r.status_code == 200, r.text
        pids = [int(p) for p in re.findall(r"ready on \S+ \(pid (\d+)\)", text)]
        assert len(pids) == 3, text
        assert all(_maps_ggml(p) for p in pids)  # the workers' layers
        assert _maps_ggml(proc.pid)  # the orchestrator's head
        for pid in pids:  # on their command lines, not through the environment
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            assert argv[argv.index("--accuracy") + 1] == "fast", argv
            assert "--parent-pid" in argv, argv
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            gone = (b"ETHEN_ACCURACY=", b"ETHEN_DEVICE=", b"ETHEN_PARENT")
            assert not any(e.startswith(gone) for e in environ)
        written = tomllib.loads((tmp_path / "data" / "up-gateway.toml").read_text())
        assert written["providers"][0]["accuracy"] == "fast" and "device" not in written["providers"][0]
        assert text.count("warning: ETHEN_ACCURACY is no longer read (ignored); use --accuracy") == 1, text
        assert text.count("warning: ETHEN_DEVICE is no longer read (ignored); use --device") == 1, text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize(("flag", "value"), [("--engine", "cuda"), ("--accuracy", "exact-int4"),
                                             ("--accuracy", "exact-int8"), ("--device", "tpu")])
def test_ethen_up_refuses_a_bad_engine_or_accuracy(tmp_path: Path, flag: str, value: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ethen", "up", "--port", "0", flag, value],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{flag} {value!r}: must be one of" in " ".join(out.stderr.split()), out.stderr


def test_ethen_up_refuses_a_device_no_installed_engine_runs(tmp_path: Path) -> None:
    from ethen.model.ggml_lib import backends

    if "vulkan" in backends():
        pytest.skip("ggml's vulkan backend is installed here (libggml-vulkan.so): not the refusal case")
    out = subprocess.run([sys.executable, "-m", "ethen", "up", "--port", "0", "--device", "vulkan"],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "device 'vulkan' needs a libggml build with the Vulkan backend" in " ".join(out.stderr.split())
