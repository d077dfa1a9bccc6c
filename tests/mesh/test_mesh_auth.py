"""The authenticated data plane over real gRPC with the real model: TLS with the certificates ``ethen mesh
certs`` makes, the mesh token on every call, sessions bound to their caller, and the worker's refusal to
expose itself without credentials."""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from ethen.cli import app as ethen_app
from ethen.mesh.auth import ClientCredentials, TokenAuth, read_tokens, server_credentials
from ethen.mesh.certs import make_certs
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.orchestrator.errors import NodeRejected, SessionLost
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc
from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService, serve
from ethen.mesh.worker.launch import spawn_worker, worker_env
from ethen.model import load_layer_stacks

D = 576
RNG = np.random.default_rng(1)


def _hidden(t: int) -> np.ndarray:
    return (RNG.standard_normal((t, D)) * 0.5).astype(np.float32)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"), ["10.1.2.3", "gpu.lan"])


@pytest.fixture(scope="module")
def second_token(tmp_path_factory: pytest.TempPathFactory) -> str:
    return "another-callers-token-" + "x" * 20


@pytest.fixture(scope="module")
def worker(certs: dict[str, Path], second_token: str) -> Iterator[tuple[int, WorkerService]]:
    """A TLS worker accepting two tokens (two callers), layers 0-9, on 127.0.0.1."""
    tokens = [*read_tokens(certs["token"]), second_token]
    service = WorkerService(WorkerConfig("w", [(0, 9)]), ModelBackend.load([(0, 9)]), auth=TokenAuth(tokens))
    server, port = serve(service, "127.0.0.1", 0, tls=server_credentials(certs["server.pem"],
                                                                        certs["server.key"]))
    yield port, service
    server.stop(0)
    service.stop()


def _stub(certs: dict[str, Path], port: int) -> tuple[grpc.Channel, Any]:
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(
        root_certificates=certs["ca.pem"].read_bytes()))
    return channel, mesh_pb2_grpc.MeshWorkerStub(channel)


def _forward_request(sid: str, x: np.ndarray, start: int = 0) -> mesh_pb2.ForwardRequest:
    return mesh_pb2.ForwardRequest(
        session_id=sid, first_layer=0, last_layer=9, positions=list(range(start, start + x.shape[0])),
        hidden=mesh_pb2.Tensor(data=x.tobytes(), shape=list(x.shape), dtype="float32"))


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong-token-0123456789abcdef"),),
                                      (("authorization", "bearer"),)], ids=["no-token", "wrong", "malformed"])
def test_a_caller_without_the_token_is_unauthenticated_on_every_rpc(
        certs: dict[str, Path], worker: tuple[int, WorkerService], metadata: Any) -> None:
    port, service = worker
    channel, stub = _stub(certs, port)
    calls = [
        (stub.Forward, _forward_request("intruder", _hidden(2))),
        (stub.ForwardBatch, mesh_pb2.ForwardBatchRequest(items=[_forward_request("intruder", _hidden(1))])),
        (stub.CloseSession, mesh_pb2.CloseSessionRequest(session_id="intruder")),
        (stub.Health, mesh_pb2.HealthRequest()),
    ]
    for method, request in calls:
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=10, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert "mesh token" in info.value.details()
    assert service.open_sessions() == 0  # nothing ran
    channel.close()


def test_the_right_token_over_tls_runs_forward_and_the_result_is_exact(
        certs: dict[str, Path], worker: tuple[int, WorkerService]) -> None:
    port, _ = worker
    creds = ClientCredentials.load(certs["ca.pem"], certs["token"])
    client = WorkerClient("w", f"127.0.0.1:{port}", credentials=creds)
    x = _hidden(4)
    stack = load_layer_stacks([(0, 9)])[0]  # the worker's weights
    expected = stack.forward(x, np.arange(4), stack.new_kv_cache())
    np.testing.assert_array_equal(client.forward("s-exact", 0, 9, x, 0).hidden, expected)
    assert client.health().node_id == "w"
    assert client.close_session("s-exact") is True
    client.close()


def test_a_client_not_trusting_the_mesh_ca_cannot_connect(
        certs: dict[str, Path], worker: tuple[int, WorkerService], tmp_path: Path) -> None:
    port, _ = worker
    other = make_certs(tmp_path / "other")  # a CA that did not sign the worker's certificate
    creds = ClientCredentials(other["ca.pem"].read_bytes(), read_tokens(certs["token"])[0])
    client = WorkerClient("w", f"127.0.0.1:{port}", credentials=creds, health_timeout_s=3.0)
    with pytest.raises(Exception) as info:
        client.health()
    assert "UNAVAILABLE" in str(info.value)
    client.close()


def test_another_caller_can_neither_extend_nor_close_a_session_it_did_not_open(
        certs: dict[str, Path], worker: tuple[int, WorkerService], second_token: str) -> None:
    port, service = worker
    ca = certs["ca.pem"].read_bytes()
    mine = ClientCredentials(ca, read_tokens(certs["token"])[0])
    owner = WorkerClient("w", f"127.0.0.1:{port}", credentials=mine)
    other = WorkerClient("w", f"127.0.0.1:{port}", credentials=ClientCredentials(ca, second_token))
    stack = load_layer_stacks([(0, 9)])[0]  # the worker's weights
    kv = stack.new_kv_cache()
    x, y = _hidden(5), _hidden(1)
    expected_x = stack.forward(x, np.arange(5), kv)
    expected_y = stack.forward(y, [5], kv)
    np.testing.assert_array_equal(owner.forward("shared-id", 0, 9, x, 0).hidden, expected_x)
    with pytest.raises(SessionLost, match="NOT_FOUND"):  # extend: as if the id were unknown
        other.forward("shared-id", 0, 9, _hidden(1), 5)
    assert other.close_session("shared-id") is False  # close: nothing of the owner's is touched
    other.forward("shared-id", 0, 9, _hidden(3), 0)  # position 0 opens the other caller's own session
    assert service.open_sessions() == 2
    # the owner's session is intact: it continues at position 5, bit for bit
    np.testing.assert_array_equal(owner.forward("shared-id", 0, 9, y, 5).hidden, expected_y)
    assert owner.close_session("shared-id") is True
    assert other.close_session("shared-id") is True
    assert service.open_sessions() == 0
    owner.close()
    other.close()


def test_a_mismatched_token_maps_to_a_rejection_not_a_failover(
        certs: dict[str, Path], worker: tuple[int, WorkerService]) -> None:
    port, _ = worker
    client = WorkerClient("w", f"127.0.0.1:{port}",
                          credentials=ClientCredentials(certs["ca.pem"].read_bytes(), "z" * 32))
    with pytest.raises(NodeRejected, match="UNAUTHENTICATED"):
        client.forward("s", 0, 9, _hidden(1), 0)
    client.close()


def _worker_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-9", "--port", "0",
            *args]


@pytest.mark.parametrize(("args", "needs"), [
    ((), "--tls-cert/--tls-key and --token-file are missing"),
    (("--token-file", "TOKEN"), "--tls-cert/--tls-key is missing"),
])
def test_a_worker_refuses_a_non_loopback_bind_without_credentials(
        certs: dict[str, Path], args: tuple[str, ...], needs: str) -> None:
    args = tuple(str(certs["token"]) if a == "TOKEN" else a for a in args)
    done = subprocess.run(_worker_cmd("--host", "0.0.0.0", *args), capture_output=True, text=True,
                          timeout=60, env=worker_env(), stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert needs in done.stderr and "--insecure" in done.stderr
    assert "READY" not in done.stdout and "loaded" not in done.stderr  # refused before the model loads


def test_a_worker_binds_all_interfaces_with_credentials_or_with_insecure(certs: dict[str, Path]) -> None:
    w = spawn_worker("x", "0-9", host="0.0.0.0", extra_args=[
        "--tls-cert", str(certs["server.pem"]), "--tls-key", str(certs["server.key"]),
        "--token-file", str(certs["token"])])
    try:
        port = w.address.rsplit(":", 1)[1]
        creds = ClientCredentials.load(certs["ca.pem"], certs["token"])
        client = WorkerClient("x", f"127.0.0.1:{port}", credentials=creds)
        assert client.health().node_id == "x"
        client.close()
        tls_only = ClientCredentials(certs["ca.pem"].read_bytes())
        bare = WorkerClient("x", f"127.0.0.1:{port}", credentials=tls_only)
        with pytest.raises(NodeRejected, match="UNAUTHENTICATED"):
            bare.health()
        bare.close()
    finally:
        w.stop()
    w = spawn_worker("x", "0-9", host="0.0.0.0", extra_args=["--insecure"])
    try:
        client = WorkerClient("x", f"127.0.0.1:{w.address.rsplit(':', 1)[1]}")
        assert client.health().node_id == "x"
        client.close()
    finally:
        w.stop()


def test_mesh_certs_writes_a_loadable_ca_certificate_key_and_token(tmp_path: Path) -> None:
    out = tmp_path / "mesh-certs"
    result = CliRunner().invoke(ethen_app, ["mesh", "certs", "--out", str(out), "--hosts",
                                            "10.1.2.3,gpu.lan"])
    assert result.exit_code == 0, result.output
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    key = serialization.load_pem_private_key((out / "server.key").read_bytes(), password=None)
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1", "10.1.2.3"}
    assert set(san.get_values_for_type(x509.DNSName)) >= {"localhost", "gpu.lan"}
    for private in ("ca.key", "server.key", "token"):
        assert stat.S_IMODE((out / private).stat().st_mode) == 0o600
    assert len(read_tokens(out / "token")[0]) >= 40
    server_credentials(out / "server.pem", out / "server.key")  # grpc accepts the pair
    again = CliRunner().invoke(ethen_app, ["mesh", "certs", "--out", str(out)])
    assert again.exit_code == 2 and "ca.pem exists already" in again.output
    bad = CliRunner().invoke(ethen_app, ["mesh", "certs", "--out", str(tmp_path / "x"), "--hosts", "a b"])
    assert bad.exit_code == 2 and "'a b'" in bad.output
