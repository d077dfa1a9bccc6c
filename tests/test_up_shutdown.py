"""Ctrl-C of ``ethen up`` (issue 23 item 11): a terminal sends SIGINT to the whole foreground process group;
the workers stopped by that shutdown are not dead, so no ``is dead`` WARNING, and none is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_ctrl_c_of_ethen_up_logs_no_dead_worker(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(n_layers=4))
    env = {**os.environ, "ETHEN_DATA_DIR": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    # its own session: the test's SIGINT to the group is what a terminal's Ctrl-C does
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # bounded: EOF, or the banner's last line
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops"):
                break
            assert time.monotonic() < deadline, lines
        pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in lines if "(pid " in ln]
        assert len(pids) == 3, lines
        time.sleep(1.0)  # Health polls running
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out = "\n".join(lines) + "\n" + rest
    assert "stopped." in rest, out
    assert "is dead" not in out and "died" not in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
