"""The mesh's membership registry: a small gRPC service (``MeshRegistry``: ``Join``, ``Leave``) a mesh
provider opens on its ``join`` address, so ``ethen worker --join HOST:PORT`` adds a worker to a running mesh.

Choices where the issue is silent:

- A gRPC port of its own (not an HTTP endpoint of the gateway): the workers already speak gRPC with the same
  credentials (TLS certificate of ``ethen mesh certs``, the mesh token in ``authorization`` metadata, checked
  by the same interceptor as the workers'), and an orchestrator used without a gateway can open it too.
- ``Join`` is idempotent and doubles as the heartbeat (every ``heartbeat_s``: min(2 s, expiry / 4), sent in
  the reply): a restarted gateway learns its workers again within one heartbeat. A joined node is
  Health-polled at once, so the router can choose it well within 2 s. What happens to the announcement
  (shared through Redis, expired when the heartbeats stop) is :class:`~ethen.mesh.orchestrator.members.
  Membership`'s business. A ``Join`` naming a statically configured worker is ``ALREADY_EXISTS``.
- ``Leave`` (sent by a draining worker) removes the node from routing; it only removes the node at the
  address it names, so a late ``Leave`` of an old process never drops its successor.
- One process per host binds the join port (``grpc.so_reuseport`` off): of the N processes of
  ``ethen gateway --workers N`` (or several gateways on one host) the first to bind serves the registry,
  the others fail to bind (:func:`open_join_point` logs it and returns no server) and, with ``[shared]``
  Redis, route the joined workers through the shared membership; without Redis they see static workers
  only. A process that failed to bind does not retry.
- **Credentials** (issue 23, item 6): a registry without a token refuses to start
  (:class:`~ethen.mesh.auth.CredentialsError` naming ``token_file``) unless ``insecure``, as a worker's
  non-loopback bind does (:func:`~ethen.mesh.auth.check_bind`). A loopback-only registry is no exception:
  any local process (any user of the host) could Join and have the orchestrator send prompts' hidden states
  to an address of its choosing. ``ethen up`` passes its generated ``<data dir>/mesh_token``.
- **Join addresses** (:func:`address_refusal`): the host of a ``Join``'s address (a name is resolved, every
  address it resolves to is checked) is refused with ``INVALID_ARGUMENT`` when it is link-local
  (169.254.0.0/16, fe80::/10: cloud metadata services live there), unspecified (0.0.0.0, ::), multicast,
  broadcast or reserved; any other non-routable address (private 10/8, 172.16/12, 192.168/16, fc00::/7,
  shared 100.64/10, ...) is refused unless the provider sets ``allow_private_join = true`` (a LAN mesh).
  Loopback stays allowed: ``ethen up``'s workers are loopback. The orchestrator connects to the name later,
  so a name whose DNS answer changes after the Join is not re-checked (advertise an address, not a name,
  where that matters).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Iterable, Sequence
from concurrent import futures
from typing import Any, Protocol

import grpc

from ethen.mesh.auth import CredentialsError, TokenAuth, TokenInterceptor
from ethen.mesh.orchestrator.members import DEFAULT_EXPIRY_S, Membership, Routing
from ethen.mesh.orchestrator.shared_members import MemberBackend
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["JoinPoint", "Members", "RegistryService", "address_refusal", "open_join_point",
           "require_credentials", "start_registry"]

log = logging.getLogger("ethen.mesh.orchestrator")

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


class Members(Protocol):
    """What the registry tells about workers (:class:`~ethen.mesh.orchestrator.members.Membership`)."""

    heartbeat_s: float

    def refusal(self, node_id: str) -> str | None: ...

    def join(self, node_id: str, address: str, fragments: Sequence[tuple[int, int]] = ()) -> bool: ...

    def leave(self, node_id: str, address: str) -> bool: ...


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_refusal(ip: IP, allow_private: bool) -> str | None:
    """Why a worker may not be reached at ``ip`` (see the module docstring), ``None`` when it may."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "an unspecified address is not reachable (pass --advertise HOST:PORT)"
    if ip.is_link_local:
        return "link-local addresses (169.254.0.0/16, fe80::/10; cloud metadata services) are never joined"
    if ip.is_loopback:  # before is_reserved: ::1 lies in the reserved ::/8
        return None
    if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255") or ip.is_reserved:
        return "a multicast, broadcast or reserved address is not a worker"
    if ip.is_global:
        return None
    if allow_private:
        return None
    return ("a non-routable (private) address is refused unless the mesh provider sets "
            "allow_private_join = true")


def _resolve(host: str) -> list[IP]:
    """The addresses ``host`` (an IP literal, ``[v6]`` or a name) stands for; [] when a name does not
    resolve."""
    literal = host[1:-1] if host.startswith("[") else host
    try:
        return [ipaddress.ip_address(literal)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(literal, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def _check(context: Any, node_id: str, address: str, allow_private: bool | None = None) -> None:
    """Abort with ``INVALID_ARGUMENT`` on a bad node id or address; ``allow_private`` not None: also check
    where the address points (a Join)."""
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
    if allow_private is None:
        return
    host = address.rsplit(":", 1)[0]
    ips = _resolve(host)
    if not ips:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address = {address!r}: {host!r} does not resolve")
    for ip in ips:
        why = address_refusal(ip, allow_private)
        if why is not None:
            shown = "" if str(ip) == host.strip("[]") else f" ({host!r} resolves to {ip})"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address = {address!r}{shown}: {why}")


class RegistryService(mesh_pb2_grpc.MeshRegistryServicer):
    def __init__(self, members: Members, allow_private: bool = False) -> None:
        self.members = members
        self.allow_private = allow_private  # the provider's allow_private_join

    def Join(self, request: mesh_pb2.JoinRequest, context: Any) -> mesh_pb2.JoinResponse:
        _check(context, request.node_id, request.address, self.allow_private)
        why = self.members.refusal(request.node_id)
        if why is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, why)
        fragments = [(r.first, r.last) for r in request.served_layers]
        added = self.members.join(request.node_id, request.address, fragments)
        if added:
            layers = ",".join(f"{a}-{b}" for a, b in fragments)
            log.warning("mesh worker %s joined at %s (layers %s)", request.node_id, request.address, layers)
        return mesh_pb2.JoinResponse(added=added, heartbeat_s=self.members.heartbeat_s)

    def Leave(self, request: mesh_pb2.LeaveRequest, context: Any) -> mesh_pb2.LeaveResponse:
        _check(context, request.node_id, request.address)
        removed = self.members.leave(request.node_id, request.address)
        if removed:
            log.warning("mesh worker %s at %s left the mesh", request.node_id, request.address)
        return mesh_pb2.LeaveResponse(removed=removed)


def require_credentials(host: str, port: int, auth: TokenAuth | None, insecure: bool) -> None:
    """Raise :class:`~ethen.mesh.auth.CredentialsError` for a registry without a token, unless
    ``insecure``."""
    if auth is None and not insecure:
        raise CredentialsError(
            f"the mesh registry on {host}:{port} has no token (token_file or token_env): any local process "
            f"could Join with any address. Set token_file (or token_env), or insecure = true to serve it "
            f"open")


def start_registry(members: Members, host: str, port: int, *, tls: Any = None,
                   auth: TokenAuth | None = None, insecure: bool = False,
                   allow_private: bool = False) -> tuple[Any, int]:
    """Serve ``MeshRegistry`` on ``host:port`` (0: a free port); returns (server, bound port). Raises
    ``OSError`` when the port cannot be bound, :class:`~ethen.mesh.auth.CredentialsError` without ``auth``
    unless ``insecure``."""
    require_credentials(host, port, auth, insecure)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ethen-registry"),
                         interceptors=[] if auth is None else [TokenInterceptor(auth)],
                         options=[("grpc.so_reuseport", 0)])
    mesh_pb2_grpc.add_MeshRegistryServicer_to_server(  # type: ignore[no-untyped-call]
        RegistryService(members, allow_private), server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls)
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
        bound = 0
    if bound == 0:
        server.stop(None)
        raise OSError(f"cannot bind the mesh registry on {address} (in use?)")
    server.start()
    return server, bound


class JoinPoint:
    """A provider's membership: the :class:`Membership` (always) and the registry server (when this process
    bound the join port). :meth:`close` stops both."""

    def __init__(self, membership: Membership, server: Any, port: int | None, error: str | None) -> None:
        self.membership = membership
        self.server = server
        self.port = port
        self.error = error  # why the registry is not served here (the port is taken), else None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(0.5)
            self.server = None
        self.membership.stop()


def open_join_point(routing: Routing, host: str, port: int, *, static: Iterable[str] = (),
                    expiry_s: float = DEFAULT_EXPIRY_S, shared: MemberBackend | None = None, tls: Any = None,
                    auth: TokenAuth | None = None, insecure: bool = False,
                    allow_private: bool = False) -> JoinPoint:
    """Start the membership loop over ``routing`` and try to serve the registry on ``host:port``. Raises
    :class:`~ethen.mesh.auth.CredentialsError` without ``auth`` unless ``insecure`` (nothing started)."""
    require_credentials(host, port, auth, insecure)
    membership = Membership(routing, static=static, expiry_s=expiry_s, shared=shared).start()
    try:
        server, bound = start_registry(membership, host, port, tls=tls, auth=auth, insecure=insecure,
                                       allow_private=allow_private)
    except OSError as exc:
        return JoinPoint(membership, None, None, str(exc))
    return JoinPoint(membership, server, bound, None)
