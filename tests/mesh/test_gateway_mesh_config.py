"""``ethen gateway --config FILE`` with a ``kind = "mesh"`` provider, as real processes: three
``ethen worker`` processes on 127.0.0.1 (one layout shared by the module) and the gateway process, which
builds the orchestrator from the config at start-up (progress logged), answers ``ethen/auto`` and the concrete
model id with the mesh route under ``ethen.routing.mesh``, and closes it at shutdown. Also: a mesh provider
whose workers are not reachable still lets the gateway start, and its requests fail with a retryable error."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from openai import OpenAI

from ethen.gateway.accounting.auth import hash_key
from ethen.gateway.config import parse_config
from ethen.gateway.errors import UpstreamConnectionError
from ethen.gateway.providers import build_providers
from ethen.gateway.providers.base import UpstreamCall
from ethen.gateway.providers.mesh import MeshProvider
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker

LAYOUT = {"gpu": "0-9", "mini": "0-9,10-19", "laptop": "10-19,20-29"}
KEY = "ethen-test-mesh-config-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _config(workers: dict[str, str], port: int, **mesh: Any) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": workers, **mesh}],
        "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
        "api_keys": [{"name": "test", "sha256": hash_key(KEY)}],
    }


class Gateway:
    def __init__(self, cfg_path: Path, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}/api/gateway/v1"
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "ethen", "gateway", "--config", str(cfg_path)],
                                     stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 40
        while True:
            try:
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for node, layers in LAYOUT.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


@pytest.fixture(scope="module")
def gateway(workers: dict[str, WorkerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-mesh")
    port = _free_port()
    cfg = tmp / "gateway.toml"
    cfg.write_text(tomli_w.dumps(_config({n: w.address for n, w in workers.items()}, port,
                                         weights={"hop": 1.0}, health_interval_s=0.5)))
    gw = Gateway(cfg, port, tmp / "gateway.log")
    yield gw
    gw.stop()


def _check_mesh_receipt(body: dict[str, Any], requested: str) -> None:
    assert "Paris" in body["choices"][0]["message"]["content"]
    routing = body["ethen"]["routing"]
    assert routing["requested_model"] == requested
    assert (routing["served_provider"], routing["served_model"]) == ("mesh", "smollm2-135m-instruct")
    stages = routing["mesh"]["route"]["stages"]
    assert stages[0]["first"] == 0 and stages[-1]["last"] == 29
    assert {s["node_id"] for s in stages} <= set(LAYOUT)
    assert routing["mesh"]["route"]["nodes"] == [s["node_id"] for s in stages]


@pytest.mark.parametrize("model", ["ethen/auto", "smollm2-135m-instruct"])
def test_the_config_declared_mesh_answers_with_its_route(gateway: Gateway, model: str) -> None:
    r = httpx.post(f"{gateway.base}/chat/completions", timeout=60, headers={"authorization": f"Bearer {KEY}"},
                   json={"model": model, "temperature": 0, "max_tokens": 12, "messages": QUESTION})
    assert r.status_code == 200, r.text
    _check_mesh_receipt(r.json(), model)


def test_the_openai_sdk_streams_from_the_config_declared_mesh(gateway: Gateway) -> None:
    client = OpenAI(base_url=gateway.base, api_key=KEY, max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="ethen/auto", temperature=0, max_tokens=12, stream=True,
                                            messages=QUESTION)  # type: ignore[arg-type]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    routing = (chunks[-1].model_extra or {})["ethen"]["routing"]
    assert routing["mesh"]["route"]["stages"][-1]["last"] == 29


def test_start_up_progress_is_logged_and_sigterm_shuts_down_cleanly(gateway: Gateway) -> None:
    assert gateway.stop() == 0  # a graceful shutdown (lifespan: providers closed), not death by the signal
    log = gateway.log.read_text()
    assert "mesh 'mesh': orchestrator closed" in log
    assert "mesh 'mesh': loading the embeddings, final norm and head" in log
    assert "mesh 'mesh': route now " in log and "(cost " in log
    assert "Traceback" not in log


def test_unreachable_workers_do_not_stop_the_gateway_and_fail_retryably(
        caplog: pytest.LogCaptureFixture) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    cfg = parse_config(_config({"gone": dead}, 0, start_timeout_s=0.3, forward_timeout_s=1.0))
    provider = build_providers(cfg, {})["mesh"]
    assert isinstance(provider, MeshProvider)

    async def run() -> None:
        with caplog.at_level(logging.INFO, logger="ethen.gateway.startup"):
            await provider.start()
        assert provider.orchestrator is not None
        assert "no route over the workers yet" in caplog.text
        try:
            with pytest.raises(UpstreamConnectionError) as err:
                await provider.complete(UpstreamCall({"messages": QUESTION, "max_tokens": 2},
                                                     "smollm2-135m-instruct", "r1"))
            assert err.value.retryable
        finally:
            await provider.aclose()
        assert provider.orchestrator is None

    asyncio.run(run())
