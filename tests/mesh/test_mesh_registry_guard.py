"""The mesh registry is closed by default (issue 23, item 6): a ``join`` without a token refuses to start
unless ``insecure``, and a ``Join`` naming a link-local, unspecified, multicast or broadcast address
is refused with ``INVALID_ARGUMENT``, a private one unless the provider allows it (``allow_private_join``);
loopback joins (``ethen up``'s local meshes) stay allowed. Real registries over real gRPC on 127.0.0.1, a real
orchestrator behind them.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.mesh.auth import AUTH_HEADER, CredentialsError, TokenAuth
from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.orchestrator.members import Membership
from ethen.mesh.orchestrator.registry import address_refusal, open_join_point, start_registry
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

TOKEN = secrets.token_urlsafe(24)


def _doc(**mesh: Any) -> dict[str, Any]:
    return {"providers": [{"id": "mesh", "kind": "mesh", **mesh}],
            "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
            "api_keys": [{"name": "t", "sha256": "0" * 64}]}


def test_a_join_registry_without_a_token_refuses_to_start_naming_the_key() -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse_config(_doc(join="127.0.0.1:7000"))
    message = info.value.message
    assert "join = '127.0.0.1:7000'" in message and "token_file" in message and "insecure" in message
    assert parse_config(_doc(join="127.0.0.1:7000", insecure=True)).providers[0].insecure is True
    # the shell refuses too (an orchestrator embedding the registry without the gateway's config)
    with pytest.raises(CredentialsError, match="has no token"):
        start_registry(Membership(_NoRouting()), "127.0.0.1", 0)
    with pytest.raises(CredentialsError, match="has no token"):
        open_join_point(_NoRouting(), "127.0.0.1", 0)
    server, port = start_registry(Membership(_NoRouting()), "127.0.0.1", 0, insecure=True)
    server.stop(None)
    assert port > 0


def test_allow_private_join_is_a_boolean_key() -> None:
    with pytest.raises(GatewayConfigError, match="allow_private_join"):
        parse_config(_doc(join="127.0.0.1:7000", insecure=True, allow_private_join="maybe"))
    cfg = parse_config(_doc(join="127.0.0.1:7000", insecure=True, allow_private_join=True))
    assert cfg.providers[0].allow_private_join is True  # type: ignore[union-attr]


class _NoRouting:
    def add_worker(self, node_id: str, address: str) -> bool:
        raise AssertionError("nothing may be added")

    def remove_worker(self, node_id: str, address: str | None = None) -> bool:
        return False


@pytest.fixture(scope="module")
def orch() -> Iterator[Orchestrator]:
    o = Orchestrator.load({}, health_interval_s=0.5).start()
    try:
        yield o
    finally:
        o.close()


def _join(port: int, node: str, address: str) -> mesh_pb2.JoinResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = mesh_pb2_grpc.MeshRegistryStub(channel)  # type: ignore[no-untyped-call]
        reply: mesh_pb2.JoinResponse = stub.Join(
            mesh_pb2.JoinRequest(node_id=node, address=address,
                                 served_layers=[mesh_pb2.LayerRange(first=0, last=29)]),
            metadata=((AUTH_HEADER, f"Bearer {TOKEN}"),), timeout=5)
        return reply


@pytest.mark.parametrize(("address", "why"), [
    ("169.254.169.254:80", "link-local"),
    ("[fe80::1]:80", "link-local"),
    ("[::ffff:169.254.169.254]:80", "link-local"),
    ("224.0.0.1:80", "multicast"),
    ("255.255.255.255:80", "broadcast"),
    ("[::]:80", "wildcard"),
])
def test_a_join_at_a_link_local_or_unreachable_address_is_invalid(orch: Orchestrator, address: str,
                                                                  why: str) -> None:
    point = open_join_point(orch, "127.0.0.1", 0, auth=TokenAuth([TOKEN]), allow_private=True)
    try:
        assert point.port is not None
        with pytest.raises(grpc.RpcError) as info:
            _join(point.port, "meta", address)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert address in (info.value.details() or "") and why in (info.value.details() or "")
        assert "meta" not in orch.monitor.clients
    finally:
        point.close()


def test_a_private_address_joins_only_when_allowed_and_loopback_always(orch: Orchestrator) -> None:
    closed = open_join_point(orch, "127.0.0.1", 0, auth=TokenAuth([TOKEN]))
    try:
        assert closed.port is not None
        for address in ("10.0.0.5:50051", "192.168.1.20:50051", "[fd00::5]:50051", "100.64.0.1:50051"):
            with pytest.raises(grpc.RpcError) as info:
                _join(closed.port, "lan", address)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "allow_private_join" in (info.value.details() or "")
        assert "lan" not in orch.monitor.clients
        assert _join(closed.port, "local", "127.0.0.1:50999").added  # `ethen up`'s workers are loopback
        assert _join(closed.port, "named", "localhost:50998").added  # a name: what it resolves to
    finally:
        closed.close()
    for node in ("local", "named"):
        orch.remove_worker(node)
    allowed = open_join_point(orch, "127.0.0.1", 0, auth=TokenAuth([TOKEN]), allow_private=True)
    try:
        assert allowed.port is not None
        assert _join(allowed.port, "lan", "10.0.0.5:50051").added
        assert orch.clients["lan"].address == "10.0.0.5:50051"
    finally:
        allowed.close()
        orch.remove_worker("lan")


def test_address_refusal_classifies_the_ranges() -> None:
    def refused(text: str, allow: bool = False) -> bool:
        return address_refusal(ipaddress.ip_address(text), allow) is not None

    assert refused("169.254.169.254", allow=True) and refused("fe80::1", allow=True)
    assert refused("0.0.0.0", allow=True) and refused("ff02::1", allow=True) and refused("240.0.0.1", True)
    assert refused("172.16.0.1") and not refused("172.16.0.1", allow=True)
    assert not refused("127.0.0.1") and not refused("::1") and not refused("8.8.8.8")
