"""Membership with real processes: ``ethen worker --join`` adds a worker to a running gateway's mesh over an
authenticated registry (TLS + token) and the gateway routes to it within 2 s; a worker with a wrong token is
refused; SIGTERM drains a worker (a stream in flight through it completes, new requests go elsewhere) and it
leaves the mesh and exits."""

from __future__ import annotations

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

from ethen.gateway.accounting.auth import hash_key
from ethen.mesh.auth import ClientCredentials, TokenAuth, read_tokens, server_credentials
from ethen.mesh.certs import make_certs
from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.orchestrator.members import Membership
from ethen.mesh.orchestrator.registry import start_registry
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model.sampling import SamplingParams

KEY = "ethen-test-mesh-membership-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _until(cond: Any, seconds: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < seconds, f"not within {seconds}s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _tls_args(certs: dict[str, Path]) -> list[str]:
    return ["--tls-cert", str(certs["server.pem"]), "--tls-key", str(certs["server.key"]),
            "--token-file", str(certs["token"])]


def _join_args(certs: dict[str, Path], registry: str) -> list[str]:
    return [*_tls_args(certs), "--join", registry, "--ca-file", str(certs["ca.pem"])]


class Gateway:
    def __init__(self, cfg: dict[str, Any], tmp: Path, port: int) -> None:
        path = tmp / "gateway.toml"
        path.write_text(tomli_w.dumps(cfg))
        self.base = f"http://127.0.0.1:{port}/api/gateway/v1"
        self.log = tmp / "gateway.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "ethen", "gateway", "--config", str(path)],
                                     stdout=self._out, stderr=subprocess.STDOUT)
        _until(self._answers, 60, "the gateway answers /healthz")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return self.healthz().status_code in (200, 503)
        except httpx.TransportError:
            return False

    def healthz(self) -> httpx.Response:
        return httpx.get(f"{self.base}/healthz", timeout=2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        self._out.close()


@pytest.fixture(scope="module")
def mesh(certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A gateway whose mesh lists one TLS worker (layers 0-19) and opens a TLS join registry."""
    tmp = tmp_path_factory.mktemp("membership")
    started: list[WorkerProcess] = []
    gw = None
    try:
        a = spawn_worker("a", "0-9,10-19", extra_args=_tls_args(certs))
        started.append(a)
        port, join_port = _free_port(), _free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": port},
            "providers": [{"id": "mesh", "kind": "mesh", "workers": {"a": a.address}, "start_timeout_s": 0.0,
                           "ca_file": str(certs["ca.pem"]), "token_file": str(certs["token"]),
                           "join": f"127.0.0.1:{join_port}", "tls_cert": str(certs["server.pem"]),
                           "tls_key": str(certs["server.key"])}],
            "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
            "api_keys": [{"name": "test", "sha256": hash_key(KEY)}],
        }
        gw = Gateway(cfg, tmp, port)
        yield {"gateway": gw, "registry": f"127.0.0.1:{join_port}", "workers": started, "tmp": tmp}
    finally:
        if gw is not None:
            gw.stop()
        for w in started:
            w.stop()


def test_a_joining_worker_is_routed_within_2s_and_serves_requests(mesh: dict[str, Any],
                                                                  certs: dict[str, Path]) -> None:
    gw: Gateway = mesh["gateway"]
    before = gw.healthz()
    assert before.status_code == 503 and "layers 20-29" in before.text  # nobody holds 20-29 yet
    b = spawn_worker("b", "20-29", extra_args=_join_args(certs, mesh["registry"]))
    mesh["workers"].append(b)
    took = _until(lambda: gw.healthz().status_code == 200, 2.0, "the gateway routes over the joined worker")
    assert took <= 2.0
    r = httpx.post(f"{gw.base}/chat/completions", timeout=60, headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "ethen/auto", "temperature": 0, "max_tokens": 12, "messages": QUESTION})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert r.json()["ethen"]["routing"]["mesh"]["route"]["nodes"] == ["a", "b"]
    assert "mesh worker b joined at" in gw.log.read_text()
    metrics = httpx.get(f"{gw.base}/metrics", timeout=5).text
    assert 'ethen_mesh_node_alive{node="b",provider="mesh"} 1.0' in metrics


def test_a_worker_with_a_wrong_token_cannot_join(mesh: dict[str, Any], certs: dict[str, Path]) -> None:
    bad = mesh["tmp"] / "bad-token"
    bad.write_text("not-the-mesh-token-0123456789abcdef\n")
    args = ["--tls-cert", str(certs["server.pem"]), "--tls-key", str(certs["server.key"]),
            "--token-file", str(bad), "--join", mesh["registry"], "--ca-file", str(certs["ca.pem"])]
    c = spawn_worker("intruder", "0-9", extra_args=args)
    mesh["workers"].append(c)
    try:
        _until(lambda: any("cannot join the mesh" in line for line in c.output), 5, "the refusal is logged")
        assert any("UNAUTHENTICATED" in line for line in c.output)
        time.sleep(0.5)
        gw: Gateway = mesh["gateway"]
        assert 'node="intruder"' not in httpx.get(f"{gw.base}/metrics", timeout=5).text
        assert "intruder joined" not in gw.log.read_text()
    finally:
        c.stop()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_sigterm_drains_a_worker_its_stream_completes_then_it_leaves(certs: dict[str, Path]) -> None:
    """Two full replicas; the joined one (higher capacity) carries a stream when it gets SIGTERM: the stream
    completes token for token, a generation started during the drain succeeds elsewhere, the worker leaves
    the mesh (Leave) and exits 0 once its session closed."""
    creds = ClientCredentials.load(certs["ca.pem"], certs["token"])
    layers = "0-9,10-19,20-29"
    a = spawn_worker("a", layers, extra_args=[*_tls_args(certs), "--capacity-score", "0.5"])
    b: WorkerProcess | None = None
    orch = Orchestrator.load({"a": a.address}, credentials=creds, health_interval_s=0.1).start()
    registry, port = start_registry(Membership(orch), "127.0.0.1", 0,
                                    auth=TokenAuth(read_tokens(certs["token"])),
                                    tls=server_credentials(certs["server.pem"], certs["server.key"]))
    try:
        b = spawn_worker("b", layers, extra_args=[*_join_args(certs, f"127.0.0.1:{port}"),
                                                  "--capacity-score", "50"])
        _until(lambda: any(s.node_id == "b" and s.alive for s in orch.states()), 2.0, "b is routable")
        prompt = orch.chat_prompt(QUESTION)
        gen = orch.generate(prompt, _greedy(24))
        assert gen.route.nodes == ("b",)
        chunks = iter(gen)
        for _ in range(4):
            next(chunks)
        b.process.send_signal(signal.SIGTERM)
        _until(lambda: not any(s.node_id == "b" and s.alive for s in orch.states()), 2.0,
               "b's Health says draining")
        during = orch.generate(prompt, _greedy(24))  # started while b drains: served elsewhere
        assert during.route.nodes == ("a",)
        during_ids = during.result().token_ids
        for _ in chunks:
            pass
        assert gen.finish_reason is not None and not gen.session.failovers  # b finished it itself
        assert b.process.wait(timeout=15) == 0
        assert any("drained (0 session(s) still open)" in line for line in b.output)
        _until(lambda: "b" not in orch.monitor.clients, 2.0, "b left the mesh")
        reference = orch.generate(prompt, _greedy(24))
        assert reference.route.nodes == ("a",)
        assert tuple(gen.token_ids) == reference.result().token_ids == during_ids
    finally:
        registry.stop(0)
        orch.close()
        if b is not None:
            b.stop()
        a.stop()
