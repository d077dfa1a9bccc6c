"""``ethen up`` as a new user meets it (issue 10, items 7-11 and 13): one real ``ethen up`` process (real
model, three real workers, the gateway on a free port) shared by the tests of this module, in a temporary
data directory. The banner's curl and Python commands are run exactly as printed; ``ethen keys create``,
``certify`` and ``usage`` run with no flags against the same data directory; ``kill -9`` of ``ethen up`` (the
last test) must take its workers with it. Separate cheaper processes cover a taken port, a worker spawned
from a thread (the portable parent watch, without Linux's death signal) and ``bash run.sh up``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
T0_AGO = 100.0  # ETHEN_UP_T0 is set this far in the past: the banner's "ready in" must count from it


def _env(data: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "ETHEN_DATA_DIR": str(data), **extra}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    return env


def _gone(pid: int) -> bool:
    """No such process, or a zombie (exited, not yet reaped: this VM's init reaps late)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


class Up:
    def __init__(self, tmp: Path, *args: str, **env_extra: str) -> None:
        self.data = tmp / "data"
        env = _env(self.data, ETHEN_UP_T0=str(time.time() - T0_AGO), **env_extra)
        self.proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.worker_pids: list[int] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.worker_pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in self.lines if "(pid " in ln]
        for pid in self.worker_pids:  # never leave a worker behind, whatever happened
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)

    def _start(self) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in self.proc.stdout:  # bounded: the process exits (EOF) or prints the banner's last line
            self.lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops"):
                break
            assert time.monotonic() < deadline, self.lines
        self.text = "\n".join(self.lines)
        ready = r"^Ethen is up, ready in ([0-9.]+) s since the command started: (\S+)$"
        m = re.search(ready, self.text, re.M)
        assert m, self.text
        self.ready_s, self.base = float(m.group(1)), m.group(2)
        self.admin_base = self.base.replace("/api/gateway/v1", "/api/admin/v1")
        self.key = (self.data / "api_key").read_text().strip()
        self.admin_key = (self.data / "admin_key").read_text().strip()
        self.worker_pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in self.lines if "(pid " in ln]
        port = int(self.base.split(":")[2].split("/")[0])
        while True:  # the banner is printed once uvicorn has bound the port; bounded by the deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.text
                time.sleep(0.1)

    def block(self, first: str, last: str) -> str:
        """The banner's lines from the one starting with ``first`` to the next one equal to / ending with
        ``last``, as printed."""
        start = next(i for i, ln in enumerate(self.lines) if ln.startswith(first))
        end = next(i for i in range(start + 1, len(self.lines)) if self.lines[i].endswith(last))
        return "\n".join(self.lines[start:end + 1]) + "\n"

    def ethen(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ethen", *args], capture_output=True, text=True,
                              env=_env(self.data), timeout=timeout, cwd=self.data.parent)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up"))
    yield u
    u.close()


def test_the_banner_curl_runs_as_printed_and_answers_paris(up: Up) -> None:
    curl = up.block("curl ", "}'")
    assert '"temperature": 0' in curl and '"max_tokens": 32' in curl
    out = subprocess.run(["bash", "-c", curl.replace("curl ", "curl -sS --max-time 120 ", 1)],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "Paris" in body["choices"][0]["message"]["content"], body


def test_the_banner_python_command_runs_as_printed(up: Up) -> None:
    script = up.block(f"{sys.executable} - <<'PY'", "PY")
    assert "temperature=0" in script and "max_tokens=32" in script
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=150,
                         cwd=up.data.parent)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "'laptop']" in out.stdout, out.stdout


def test_ready_in_counts_from_the_command_start(up: Up) -> None:
    assert T0_AGO <= up.ready_s < T0_AGO + 240, up.text


def test_keys_create_without_flags_makes_a_key_the_gateway_accepts(up: Up) -> None:
    out = up.ethen("keys", "create")
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key.startswith("ethen_") and "project 'default'" in out.stderr
    r = httpx.post(f"{up.base}/chat/completions", timeout=120, headers={"authorization": f"Bearer {key}"},
                   json={"model": "ethen/auto", "temperature": 0, "max_tokens": 8,
                         "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    usage = up.ethen("usage", "--project", "default")
    assert usage.returncode == 0, usage.stderr
    rows = [row for row in json.loads(usage.stdout)["data"] if row["key_id"] == key.split("_")[1]]
    assert [(row["project"], row["provider"], row["requests"]) for row in rows] == [("default", "mesh", 1)]


def test_the_admin_api_answers_the_printed_admin_key(up: Up) -> None:
    assert up.admin_key in up.text and up.admin_base in up.text
    admin = {"authorization": f"Bearer {up.admin_key}"}
    r = httpx.get(f"{up.admin_base}/projects", headers=admin, timeout=30)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["data"], list)
    r = httpx.get(f"{up.admin_base}/projects", headers={"authorization": f"Bearer {up.key}"}, timeout=30)
    assert r.status_code == 401  # the client key is not an admin key
    assert stat.S_IMODE((up.data / "admin_key").stat().st_mode) == 0o600


def test_certify_finds_the_config_and_the_store_without_flags(up: Up) -> None:
    out = up.ethen("certify", "mesh/smollm2-135m-instruct", "--valid-for", "1h", timeout=180)
    assert out.returncode == 0, out.stderr
    receipt = json.loads(out.stdout)
    r = httpx.get(f"{up.admin_base}/certifications", headers={"authorization": f"Bearer {up.admin_key}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    assert receipt["receipt_id"] in r.text


def test_the_banner_second_gateway_command_serves_as_printed(up: Up) -> None:
    """Issue 23 item 8: the printed ``ethen gateway --config`` command runs while ``ethen up`` does (the
    config's own port is the one ``ethen up`` holds)."""
    (line,) = [ln for ln in up.lines if ln.startswith("A second gateway on these workers")]
    command = line.split(":  ", 1)[1]
    port = int(command.rsplit("--port ", 1)[1])
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(up.data))
    try:
        deadline = time.monotonic() + 120
        while True:  # bounded by the deadline: the mesh provider loads its head and polls the workers
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions", timeout=120,
                               headers={"authorization": f"Bearer {up.key}"},
                               json={"model": "ethen/auto", "temperature": 0, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "What is the capital?"}]})
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert r.json()["ethen"]["routing"]["selected_provider"] == "mesh"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_kill_9_of_ethen_up_leaves_no_worker(up: Up) -> None:  # last: it ends the shared process
    assert len(up.worker_pids) == 3 and not any(_gone(p) for p in up.worker_pids)
    up.proc.kill()
    up.proc.wait(timeout=10)
    assert _wait_gone(up.worker_pids, 5.0) == []


def test_a_taken_port_fails_fast_naming_the_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "ethen", "up", "--port", str(port)], capture_output=True,
                             text=True, env=_env(tmp_path / "data"), timeout=60)
        took = time.monotonic() - t0
    assert out.returncode == 1
    assert f"port {port} on 127.0.0.1 is not available" in out.stderr, out.stderr
    assert "[1/4]" not in out.stderr and "worker" not in out.stderr  # nothing loaded, no worker started
    assert took < 5.0, took


_THREAD_PARENT = textwrap.dedent("""
    import sys, threading, time
    from ethen.mesh.worker.launch import spawn_worker
    started = []
    t = threading.Thread(target=lambda: started.append(spawn_worker("w", "0-0")))
    t.start(); t.join()
    print(started[0].pid, flush=True)
    time.sleep(600)
""")


def test_a_worker_spawned_from_a_thread_dies_with_its_parent() -> None:
    """No Linux death signal here (it would fire when the spawning thread ends): the stdin watch alone."""
    parent = subprocess.Popen([sys.executable, "-c", _THREAD_PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    pid = 0
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the spawning thread is gone: a death signal tied to it would have fired by now
        assert not _gone(pid)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_gone([pid], 5.0) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _shim(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def _project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"])


def _site(tmp: Path, *dists: tuple[str, str, str | None]) -> dict[str, str]:
    """An environment whose interpreter sees these distributions first: (name, version, editable source
    directory or ``None``) dist-info directories in a directory put first on ``PYTHONPATH``."""
    site = tmp / "site"
    for name, version, source in dists:
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if source is not None:
            (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True},
                                                              "url": Path(source).resolve().as_uri()}))
    return {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}


#: an ethen of another version than pyproject.toml's: `bash run.sh up` must install
_NOT_INSTALLED = ("ethen", "0.0.0", str(ROOT))


def test_run_sh_up_installs_without_dev_extras_shows_progress_and_exports_the_start(tmp_path: Path) -> None:
    """``bash run.sh up`` against a venv whose ``python -m pip`` records its arguments instead of reaching
    the network (the real interpreter runs everything else, and the real ``ethen up`` starts)."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    _shim(venv / "bin" / "python", f"""if [ "$1 $2" = "-m pip" ]; then
    echo "pip ${{*:3}}" >> {log}
    echo "Requirement already satisfied: numpy in /somewhere"
    echo "Collecting some-package"
    exit 0
fi
exec {sys.executable} "$@"
""")
    _shim(venv / "bin" / "ethen", f"""echo "ethen $* T0=$ETHEN_UP_T0" >> {log}
exec {sys.executable} -m ethen "$@"
""")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = time.time()
        out = subprocess.run(["bash", str(ROOT / "run.sh"), "up", "--port", str(port)], capture_output=True,
                             text=True, timeout=120, env=_env(tmp_path / "data", ETHEN_VENV=str(venv),
                                                              **_site(tmp_path, _NOT_INSTALLED)))
    calls = log.read_text().splitlines()
    pips = [c for c in calls if c.startswith("pip ")]
    assert pips and not any("[dev]" in c or "dev" in c.split() for c in pips), pips
    assert not any("--upgrade" in c.split() for c in pips), pips  # issue 42 item 14: never upgrades pip
    assert any(c.endswith(" -e . openai>=1.30") for c in pips), pips  # the package alone, and the SDK
    assert all("-q" not in c.split() for c in pips), pips
    (run,) = [c for c in calls if c.startswith("ethen ")]
    assert run.startswith(f"ethen up --port {port} T0=")
    assert before - 1 <= float(run.split("T0=")[1]) <= time.time()
    assert "[setup 1/4]" in out.stderr and "[setup 4/4]" in out.stderr, out.stderr
    # issue 23 item 9: one progress line per step, pip's own lines in the log the first line names
    pip_log = venv / "pip-up.log"
    assert f"(pip's output: {pip_log})" in out.stderr, out.stderr
    assert "Collecting some-package" not in out.stdout + out.stderr
    assert pip_log.read_text().count("Collecting some-package") == 2
    setup = out.stderr.split("starting ethen up ...")[0].strip().splitlines()
    assert [ln[:11] for ln in setup] == [f"[setup {i}/4]" for i in range(1, 5)], setup
    assert out.returncode == 1 and f"port {port}" in out.stderr  # the real ethen up, failing fast


def test_run_sh_up_shows_a_failing_pip_step_and_stops(tmp_path: Path) -> None:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    _shim(venv / "bin" / "python", f"""if [ "$1 $2" = "-m pip" ]; then
    echo "pip ${{*:3}}" >> {log}
    echo "Collecting openai>=1.30"
    case "$*" in *"-e ."*) echo "ERROR: No matching distribution found for openai>=1.30" >&2; exit 7;; esac
    exit 0
fi
exec {sys.executable} "$@"
""")
    _shim(venv / "bin" / "ethen", f'echo "ethen $*" >> {log}\n')
    out = subprocess.run(["bash", str(ROOT / "run.sh"), "up"], capture_output=True, text=True, timeout=120,
                         env=_env(tmp_path / "data", ETHEN_VENV=str(venv), **_site(tmp_path, _NOT_INSTALLED)))
    assert out.returncode == 7, out.stderr
    assert "error: `pip install -e . openai>=1.30` failed (exit 7)" in out.stderr, out.stderr
    assert "ERROR: No matching distribution found for openai>=1.30" in out.stderr  # the log's tail
    assert "[setup 3/4]" not in out.stderr
    assert not any(c.startswith("ethen ") for c in log.read_text().splitlines())  # ethen up never ran
    assert "ERROR: No matching distribution" in (venv / "pip-up.log").read_text()


def _run_sh_up(tmp_path: Path, *dists: tuple[str, str, str | None]) -> tuple[list[str], str]:
    """``bash run.sh up --port <taken>`` with a venv whose ``python -m pip`` records its arguments (and the
    real interpreter, seeing ``dists`` first, for the rest): (the pip calls, stderr)."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    log.touch()
    _shim(venv / "bin" / "python", f"""if [ "$1 $2" = "-m pip" ]; then
    echo "pip ${{*:3}}" >> {log}; exit 0
fi
exec {sys.executable} "$@"
""")
    _shim(venv / "bin" / "ethen", f'exec {sys.executable} -m ethen "$@"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(["bash", str(ROOT / "run.sh"), "up", "--port", str(port)], capture_output=True,
                             text=True, timeout=120, env=_env(tmp_path / "data", ETHEN_VENV=str(venv),
                                                              **_site(tmp_path, *dists)))
    assert out.returncode == 1 and f"port {port}" in out.stderr, out.stderr  # ethen up ran, failing fast
    return log.read_text().splitlines(), out.stderr


def test_run_sh_up_on_an_installed_env_installs_nothing(tmp_path: Path) -> None:
    """Issue 42 item 14: ethen in editable mode from this checkout at pyproject.toml's version, and every
    requirement met (the real interpreter's packages): no pip at all, so no network."""
    pips, err = _run_sh_up(tmp_path, ("ethen", _project_version(), str(ROOT)))
    assert pips == [], pips
    assert "nothing to install" in err and "[setup 1/4]" not in err, err


@pytest.mark.parametrize("dist", [
    ("ethen", "0.0.0", str(ROOT)),  # pyproject.toml's version changed since the install
    ("ethen", _project_version(), "/elsewhere/ethen"),  # installed from another checkout
    ("ethen", _project_version(), None),  # not an editable install
    ("openai", "1.0.0", None),  # below the pin (openai>=1.30)
    ("numpy", "1.0.0", None),  # below pyproject.toml's numpy>=1.26
])
def test_run_sh_up_installs_when_something_is_missing(tmp_path: Path,
                                                     dist: tuple[str, str, str | None]) -> None:
    dists = [dist] if dist[0] == "ethen" else [("ethen", _project_version(), str(ROOT)), dist]
    pips, err = _run_sh_up(tmp_path, *dists)
    expected = "pip install --disable-pip-version-check -e . openai>=1.30"
    assert [p for p in pips if "-e ." in p] == [expected], pips
    assert "[setup 4/4] installed" in err, err
