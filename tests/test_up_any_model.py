"""``ethen up --model X.gguf`` for any layer count (issue 24): the default layout is derived from the model's
block count (:func:`ethen.up_layout.default_layout`), and a ``--layout`` that does not fit the model is
refused before any worker starts, naming the layer count."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ethen.mesh.orchestrator.planning import plan_route
from ethen.mesh.routing import NodeState, RouteWeights
from ethen.mesh.worker.config import parse_fragments
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from ethen.up_layout import DEFAULT_LAYOUT, default_layout


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "ETHEN_DATA_DIR": str(tmp / "data"), "XDG_CACHE_HOME": str(tmp / "cache")}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    return env


def test_the_default_layout_follows_the_layer_count() -> None:
    assert default_layout(30) == list(DEFAULT_LAYOUT)
    assert default_layout(1) == [("gpu", "0-0", 10.0)]
    assert default_layout(2) == [("gpu", "0-0", 10.0), ("mini", "0-0,1-1", 6.0)]
    assert default_layout(4) == [("gpu", "0-1", 10.0), ("mini", "0-1,2-2", 6.0), ("laptop", "2-2,3-3", 3.0)]
    assert default_layout(22) == [("gpu", "0-7", 10.0), ("mini", "0-7,8-14", 6.0),
                                  ("laptop", "8-14,15-21", 3.0)]
    for n in range(1, 80):  # every count: layers 0..n-1 exactly, and a chain of whole fragments covers them
        workers = default_layout(n)
        assert len(workers) == min(n, 3)
        frags = {f for _, layers, _ in workers for f in parse_fragments(layers)}
        assert min(a for a, _ in frags) == 0 and max(b for _, b in frags) == n - 1
        states = [NodeState(node, 1.0, 0.0, score, tuple(parse_fragments(layers)))
                  for node, layers, score in workers]
        plan_route(states, n, 1, RouteWeights(), "m")
    with pytest.raises(ValueError, match="at least one layer"):
        default_layout(0)


@pytest.mark.parametrize("n_layers", [1, 4, 22])
def test_ethen_up_serves_a_model_of_any_layer_count(tmp_path: Path, n_layers: int) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(n_layers=n_layers, name=f"tiny {n_layers}"))
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
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
        started = re.findall(r"\[2/4\] worker \d+/(\d+): (\w+) layers (\S+) \.\.\.", text)
        assert [(node, layers) for _, node, layers in started] == [
            (node, layers) for node, layers, _ in default_layout(n_layers)], text
        key = (tmp_path / "data" / "api_key").read_text().strip()
        r = httpx.post(f"{m.group(1)}/chat/completions", timeout=120,
                       headers={"authorization": f"Bearer {key}"},
                       json={"model": "ethen/auto", "temperature": 0, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hello mesh"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == f"tiny-{n_layers}"
        stages = body["ethen"]["routing"]["mesh"]["route"]["stages"]
        assert stages[0]["first"] == 0 and stages[-1]["last"] == n_layers - 1, stages
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize(("layers", "says"), [
    ("0-9", "go past the model's last layer: the model has 4 layers (0-3)"),
    ("0-1", "covers layers 0-3 (the model has 4 layers)"),
])
def test_a_layout_that_does_not_fit_the_model_is_refused_before_any_worker(tmp_path: Path, layers: str,
                                                                           says: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(n_layers=4))
    layout = tmp_path / "layout.toml"
    layout.write_text(f'[[workers]]\nnode_id = "a"\nlayers = "{layers}"\n', encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path),
                          "--layout", str(layout)], capture_output=True, text=True, timeout=120,
                         env=_env(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in " ".join(out.stderr.split()), out.stderr
    assert "[2/4]" not in out.stderr  # no worker was started
