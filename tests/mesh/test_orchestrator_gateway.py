"""The mesh behind the gateway, end to end: ``ethen up`` (real processes) serves ``ethen/auto`` with real
text and a receipt naming the mesh route; the openai SDK streams; Ctrl-C stops every child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from ethen.gateway.errors import UpstreamBadRequestError
from ethen.gateway.providers.mesh import messages_of, sampling_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Up:
    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.data = tmp / "data"
        env = {**os.environ, "ETHEN_DATA_DIR": str(self.data)}
        env.pop("ETHEN_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("Ctrl-C stops"):
                break
            assert time.monotonic() < deadline, self.lines
        self.base = f"http://127.0.0.1:{self.port}/api/gateway/v1"
        self.key = (self.data / "api_key").read_text().strip()
        self.worker_pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in self.lines if "(pid " in ln]
        while True:  # the banner is printed just before uvicorn binds the port
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.lines
                time.sleep(0.1)

    def stop(self) -> float:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up"))
    yield u
    if u.proc.poll() is None:
        u.stop()


def test_up_prints_the_url_the_key_and_examples(up: Up) -> None:
    text = "\n".join(up.lines)
    assert up.base in text and up.key in text and "curl " in text and "from openai import OpenAI" in text
    assert "generated now" in text and up.key.startswith("ethen")
    assert len(up.worker_pids) == 3


def test_ethen_auto_through_the_gateway_returns_text_and_the_mesh_route(up: Up) -> None:
    r = httpx.post(f"{up.base}/chat/completions", timeout=120, headers={"authorization": f"Bearer {up.key}"},
                   json={"model": "ethen/auto", "temperature": 0, "max_tokens": 16,
                         "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    routing = body["ethen"]["routing"]
    assert routing["served_provider"] == "mesh" and routing["served_model"] == "smollm2-135m-instruct"
    mesh = routing["mesh"]
    stages = mesh["route"]["stages"]
    assert stages[0]["first"] == 0 and stages[-1]["last"] == 29
    assert all({"node_id", "first", "last", "cost"} <= set(s) for s in stages)
    assert mesh["route"]["nodes"] == [s["node_id"] for s in stages]
    assert body["usage"]["completion_tokens"] > 0


def test_openai_sdk_streams_from_the_mesh(up: Up) -> None:
    client = OpenAI(base_url=up.base, api_key=up.key)
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=12, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2 and "Paris" in "".join(pieces)


def test_up_serves_a_written_config_with_a_mesh_provider(up: Up) -> None:
    import tomllib

    text = "\n".join(up.lines)
    path = up.data / "up-gateway.toml"
    assert f"ethen gateway --config {path}" in text
    doc = tomllib.loads(path.read_text())
    (mesh,) = doc["providers"]
    assert mesh["kind"] == "mesh" and "base_url" not in mesh
    assert set(mesh["workers"]) == {"gpu", "mini", "laptop"} and doc["server"]["port"] == up.port
    assert "mesh 'mesh': route now " in text  # start-up progress from the gateway's lifespan


def test_ctrl_c_stops_every_child_within_seconds(up: Up) -> None:
    took = up.stop()
    assert up.proc.returncode == 0 and took < 10
    assert up.proc.stdout is not None
    rest = up.proc.stdout.read()
    assert "stopped." in rest and "Traceback" not in rest, rest
    time.sleep(0.2)
    for pid in up.worker_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_request_mapping_errors_name_the_field() -> None:
    with pytest.raises(UpstreamBadRequestError, match="temperature"):
        sampling_params({"temperature": 5})
    with pytest.raises(UpstreamBadRequestError, match="n = 2"):
        sampling_params({"n": 2})
    with pytest.raises(UpstreamBadRequestError, match=r"messages\[0\].content\[1\].*image_url"):
        messages_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "image_url", "image_url": {}}]}]})
    p = sampling_params({"max_completion_tokens": 7, "stop": "x", "seed": 3, "temperature": 0})
    assert (p.max_tokens, p.stop, p.seed, p.greedy) == (7, ("x",), 3, True)
