"""The mesh's membership registry: a small gRPC service (``MeshRegistry``: ``Join``, ``Leave``) a mesh
provider opens on its ``join`` address, so ``ethen worker --join HOST:PORT`` adds a worker to a running mesh.

Choices where the issue is silent:

- A gRPC port of its own (not an HTTP endpoint of the gateway): the workers already speak gRPC with the same
  credentials (TLS certificate of ``ethen mesh certs``, the mesh token in ``authorization`` metadata, checked
  by the same interceptor as the workers'), and an orchestrator used without a gateway can open it too.
- ``Join`` is idempotent and doubles as the heartbeat (every :data:`HEARTBEAT_S` seconds): a restarted
  gateway learns its workers again within one heartbeat. A joined node is Health-polled at once, so the router
  can choose it well within 2 s. A node that stops heartbeating is not removed by the registry: its failed
  Health polls take it out of routing within 1 s, like a static worker's (it stays listed as dead).
- ``Leave`` (sent by a draining worker) removes the node from routing; it only removes the node at the
  address it names, so a late ``Leave`` of an old process never drops its successor.
- Membership lives in this process (the orchestrator's client table). Several gateway instances each run
  their own registry; a worker joins one of them (sharing membership through the store or Redis: not done).
"""

from __future__ import annotations

import logging
import re
from concurrent import futures
from typing import Any, Protocol

import grpc

from ethen.mesh.auth import TokenAuth, TokenInterceptor
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["HEARTBEAT_S", "Members", "RegistryService", "start_registry"]

log = logging.getLogger("ethen.mesh.orchestrator")

HEARTBEAT_S = 2.0
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


class Members(Protocol):
    def add_worker(self, node_id: str, address: str) -> bool: ...

    def remove_worker(self, node_id: str, address: str | None = None) -> bool: ...


def _check(context: Any, node_id: str, address: str) -> None:
    if not _NODE_ID.match(node_id):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"node_id = {node_id!r}: letters, digits, '.', '_' or '-' (at most 64)")
    m = _ADDRESS.match(address)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"address = {address!r}: must be 'host:port' where the orchestrator reaches the worker "
                      f"(not 0.0.0.0: pass --advertise)")
    if address.startswith(("0.0.0.0:", "[::]:")):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"address = {address!r}: a wildcard is not reachable; pass --advertise HOST:PORT")


class RegistryService(mesh_pb2_grpc.MeshRegistryServicer):
    def __init__(self, members: Members, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.members = members
        self.heartbeat_s = heartbeat_s

    def Join(self, request: mesh_pb2.JoinRequest, context: Any) -> mesh_pb2.JoinResponse:
        _check(context, request.node_id, request.address)
        added = self.members.add_worker(request.node_id, request.address)
        if added:
            layers = ",".join(f"{r.first}-{r.last}" for r in request.served_layers)
            log.warning("mesh worker %s joined at %s (layers %s)", request.node_id, request.address, layers)
        return mesh_pb2.JoinResponse(added=added, heartbeat_s=self.heartbeat_s)

    def Leave(self, request: mesh_pb2.LeaveRequest, context: Any) -> mesh_pb2.LeaveResponse:
        _check(context, request.node_id, request.address)
        removed = self.members.remove_worker(request.node_id, request.address)
        if removed:
            log.warning("mesh worker %s at %s left the mesh", request.node_id, request.address)
        return mesh_pb2.LeaveResponse(removed=removed)


def start_registry(members: Members, host: str, port: int, *, tls: Any = None, auth: TokenAuth | None = None,
                   heartbeat_s: float = HEARTBEAT_S) -> tuple[Any, int]:
    """Serve ``MeshRegistry`` on ``host:port`` (0: a free port); returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ethen-registry"),
                         interceptors=[] if auth is None else [TokenInterceptor(auth)],
                         options=[("grpc.so_reuseport", 0)])
    mesh_pb2_grpc.add_MeshRegistryServicer_to_server(  # type: ignore[no-untyped-call]
        RegistryService(members, heartbeat_s), server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls)
    if bound == 0:
        raise OSError(f"cannot bind the mesh registry on {address}")
    server.start()
    return server, bound
