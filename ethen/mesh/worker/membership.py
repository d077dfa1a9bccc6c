"""A worker's credentials and its membership in a mesh (``ethen worker --join HOST:PORT``).

:func:`credentials_of` turns the command's options into TLS server credentials, a
:class:`~ethen.mesh.auth.TokenAuth` and a :class:`JoinSpec`, refusing (``CredentialsError``, before the
model loads) a non-loopback bind without credentials, half a TLS pair, an unreadable file, or ``--join``
from a wildcard bind without ``--advertise``.

:class:`Announcer` sends ``Join`` (node id, advertised address, fragments) to the registry at once and then
every ``heartbeat_s`` seconds (the registry's answer sets it: min(2 s, ``member_expiry_s`` / 4)), so a
restarted gateway learns the worker again and a worker that stops announcing expires; failures are logged
once per transition (WARNING), never per beat. :meth:`Announcer.leave` stops the beats and sends ``Leave``
(bounded: 2 s); :meth:`Announcer.stop` only stops the beats (the registry lets the node expire).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ethen.mesh.auth import (
    ClientCredentials,
    CredentialsError,
    TokenAuth,
    check_bind,
    read_tokens,
    server_credentials,
)
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["Announcer", "JoinSpec", "credentials_of"]

log = logging.getLogger("ethen.mesh.worker")

_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


@dataclass(frozen=True, slots=True)
class JoinSpec:
    registry: str  # host:port of the registry
    advertise: str | None  # host:port the orchestrator reaches this worker at (None: the bound address)
    credentials: ClientCredentials
    heartbeat_s: float = 2.0


def _address(option: str, value: str) -> str:
    m = _ADDRESS.match(value)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise CredentialsError(f"{option} {value!r}: must be HOST:PORT (e.g. 10.0.0.5:50051)")
    return value


def credentials_of(host: str, tls_cert: Path | None, tls_key: Path | None, token_file: Path | None,
                   insecure: bool, join: str | None, advertise: str | None,
                   ca_file: Path | None) -> tuple[Any, TokenAuth | None, JoinSpec | None]:
    """(grpc server credentials or None, token auth or None, join spec or None) from the worker's options."""
    if (tls_cert is None) != (tls_key is None):
        raise CredentialsError("--tls-cert and --tls-key go together (a certificate and its private key)")
    tls = None if tls_cert is None or tls_key is None else server_credentials(tls_cert, tls_key)
    auth = None if token_file is None else TokenAuth(read_tokens(token_file, "--token-file"))
    check_bind(host, tls is not None, auth is not None, insecure)
    if join is None:
        if advertise is not None:
            raise CredentialsError("--advertise is only used with --join")
        return tls, auth, None
    _address("--join", join)
    if advertise is not None:
        _address("--advertise", advertise)
    elif host in ("0.0.0.0", "::", "[::]", ""):
        raise CredentialsError(f"--join with --host {host!r} needs --advertise HOST:PORT (the address the "
                               f"gateway reaches this worker at)")
    creds = ClientCredentials.load(ca_file, token_file)
    return tls, auth, JoinSpec(join, advertise, creds)


class Announcer:
    """Joins the mesh and keeps announcing this worker until :meth:`leave`."""

    def __init__(self, spec: JoinSpec, node_id: str, address: str,
                 fragments: Sequence[tuple[int, int]]) -> None:
        self.spec = spec
        self.node_id = node_id
        self.address = address
        self.fragments = list(fragments)
        self.heartbeat_s = spec.heartbeat_s
        self._channel = spec.credentials.channel(spec.registry)
        self._stub: Any = mesh_pb2_grpc.MeshRegistryStub(self._channel)  # type: ignore[no-untyped-call]
        self._md = spec.credentials.metadata
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ok: bool | None = None
        self.joins = 0
        self.last_joined_at: float | None = None  # time.monotonic() of the last answered Join

    def announce(self) -> bool:
        request = mesh_pb2.JoinRequest(
            node_id=self.node_id, address=self.address,
            served_layers=[mesh_pb2.LayerRange(first=a, last=b) for a, b in self.fragments])
        try:
            reply = self._stub.Join(request, timeout=2.0, metadata=self._md)
        except grpc.RpcError as exc:
            if self._ok is not False:
                log.warning("worker %s: cannot join the mesh at %s: %s: %s (retrying every %.0f s)",
                            self.node_id, self.spec.registry, exc.code().name, exc.details(),
                            self.heartbeat_s)
            self._ok = False
            return False
        if self._ok is not True:
            log.warning("worker %s: joined the mesh at %s as %s", self.node_id, self.spec.registry,
                        self.address)
        self._ok = True
        self.joins += 1
        self.last_joined_at = time.monotonic()
        if reply.heartbeat_s > 0:
            self.heartbeat_s = min(max(reply.heartbeat_s, 0.2), 60.0)
        return True

    def start(self) -> Announcer:
        self.announce()
        self._thread = threading.Thread(target=self._loop, name="ethen-join", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.announce()

    def _stop_beats(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3.0)
            self._thread = None

    def stop(self) -> None:
        """Stop announcing without ``Leave`` (the registry expires the node after its ``member_expiry_s``)."""
        self._stop_beats()
        self._channel.close()

    def leave(self) -> bool:
        """Stop announcing and tell the registry this worker leaves; False when it could not be told."""
        self._stop_beats()
        try:
            reply = self._stub.Leave(mesh_pb2.LeaveRequest(node_id=self.node_id, address=self.address),
                                     timeout=2.0, metadata=self._md)
            return bool(reply.removed)
        except grpc.RpcError as exc:
            log.warning("worker %s: Leave to %s failed: %s", self.node_id, self.spec.registry, exc.details())
            return False
        finally:
            self._channel.close()
