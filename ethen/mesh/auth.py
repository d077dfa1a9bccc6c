"""Authentication of the mesh data plane: TLS (grpcio's own credentials) plus a shared bearer token.

Choices where the issue is silent:

- **TLS + token, not mutual TLS.** Workers present a server certificate signed by the mesh's CA
  (``ethen mesh certs`` makes both); the orchestrator checks it with the CA file and sends
  ``authorization: Bearer <token>`` in every call's metadata. A token is one line in a file, easy to rotate
  and to hand to a new machine; client certificates per gateway would add a signing step per host.
- **Every RPC needs the token, Health included**: Health tells the layout, load and session count of a node,
  which is nobody else's business; the orchestrator has the token anyway. A caller without it (or with a
  wrong one) gets ``UNAUTHENTICATED`` from a server interceptor before any handler runs. Tokens are compared
  with :func:`hmac.compare_digest`.
- **A token file may list several tokens** (one per line; blank lines and ``#`` comments ignored), each one
  identity (a *principal*: ``token:`` + the first 12 hex digits of its SHA-256). A worker keys each session by
  the principal and the peer host that opened it (see :mod:`ethen.mesh.worker.server`), so a caller holding
  another token, or calling from another host, can neither extend nor close it: to it the session does not
  exist (``NOT_FOUND``). Tokens shorter than 16 characters are refused.
- **Loopback may stay open**: a worker bound to a loopback address may run without credentials (``ethen up``
  passes a token anyway, generated in its data directory, so other local users cannot drive its workers). A
  non-loopback bind needs both TLS and a token (a token without TLS would travel in clear text) unless
  ``--insecure`` says otherwise: :func:`check_bind`.
- The token is sent as explicit call metadata, not as grpc call credentials: call credentials run a Python
  plugin on another thread per call (hot path), and refuse insecure loopback channels.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ethen.mesh.errors import MeshError

__all__ = [
    "AUTH_HEADER",
    "ClientCredentials",
    "CredentialsError",
    "TokenAuth",
    "TokenInterceptor",
    "check_bind",
    "is_loopback",
    "read_file",
    "read_tokens",
    "server_credentials",
]

AUTH_HEADER = "authorization"
MIN_TOKEN_CHARS = 16


class CredentialsError(MeshError, ValueError):
    """A credentials file or option is missing or malformed; the message names it."""


def read_file(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"{what} {str(path)!r}: cannot read it: {exc.strerror}") from None


def read_tokens(path: str | Path, what: str = "token file") -> list[str]:
    """The tokens of a token file (one per line); raises :class:`CredentialsError` naming the file."""
    text = read_file(path, what).decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.splitlines()]
    tokens = [line for line in lines if line and not line.startswith("#")]
    if not tokens:
        raise CredentialsError(f"{what} {str(path)!r}: holds no token")
    for i, tok in enumerate(tokens):
        if len(tok) < MIN_TOKEN_CHARS or any(c.isspace() for c in tok):
            raise CredentialsError(
                f"{what} {str(path)!r}: token {i + 1} must be at least {MIN_TOKEN_CHARS} characters without "
                f"spaces (make one with `ethen mesh certs`)")
    return tokens


def principal_of_token(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


class TokenAuth:
    """Checks ``authorization: Bearer <token>`` against the accepted tokens; names the caller's principal."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise CredentialsError("TokenAuth needs at least one token")
        self._expected = [(f"Bearer {t}".encode(), principal_of_token(t)) for t in tokens]

    def principal(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The principal of a call's metadata, or ``None`` when it carries no accepted token."""
        for key, value in metadata or ():
            if key != AUTH_HEADER:
                continue
            got = value.encode() if isinstance(value, str) else bytes(value)
            found = None
            for expected, name in self._expected:  # compare with every token: time does not tell which
                if hmac.compare_digest(got, expected):
                    found = name
            return found
        return None


def _deny(request: Any, context: Any) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "missing or wrong mesh token (send 'authorization: Bearer <token>' of the mesh token file)")


_DENY = grpc.unary_unary_rpc_method_handler(_deny)


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses (``UNAUTHENTICATED``) every call without an accepted token, before its handler runs."""

    def __init__(self, auth: TokenAuth) -> None:
        self.auth = auth

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if self.auth.principal(handler_call_details.invocation_metadata) is None:
            return _DENY
        return continuation(handler_call_details)


def server_credentials(cert_file: str | Path, key_file: str | Path) -> Any:
    """grpc server credentials from a PEM certificate (chain) and its PEM private key."""
    cert = read_file(cert_file, "TLS certificate")
    key = read_file(key_file, "TLS key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise CredentialsError(f"TLS certificate {str(cert_file)!r}: not a PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise CredentialsError(f"TLS key {str(key_file)!r}: not a PEM private key")
    return grpc.ssl_server_credentials([(key, cert)])


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``[::1]``, ``localhost``: True; ``0.0.0.0``, other addresses, names: False."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: bool, token: bool, insecure: bool) -> None:
    """Raise :class:`CredentialsError` when binding ``host`` would expose the data plane: a non-loopback
    address needs TLS and a token, unless ``insecure``."""
    if is_loopback(host) or insecure or (tls and token):
        return
    missing = " and ".join(n for n, ok in (("--tls-cert/--tls-key", tls), ("--token-file", token)) if not ok)
    raise CredentialsError(
        f"--host {host!r} is not a loopback address and {missing} {'are' if ' and ' in missing else 'is'} "
        f"missing: anyone who reaches the port could run the model and touch sessions. Make credentials with "
        f"`ethen mesh certs --out DIR --hosts {host}`, or pass --insecure to serve without them")


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a mesh client (the orchestrator, a joining worker) presents: the CA that signed the workers'
    certificates (``None``: plaintext channel) and the token (``None``: no authorization metadata)."""

    ca: bytes | None = None
    token: str | None = None

    @classmethod
    def load(cls, ca_file: str | Path | None = None, token_file: str | Path | None = None,
             token_env: str | None = None) -> ClientCredentials:
        ca = None if ca_file is None else read_file(ca_file, "CA file")
        if ca is not None and b"-----BEGIN CERTIFICATE-----" not in ca:
            raise CredentialsError(f"CA file {str(ca_file)!r}: not a PEM certificate")
        token = None
        if token_file is not None:
            token = read_tokens(token_file)[0]
        elif token_env is not None:
            token = os.environ.get(token_env, "").strip() or None
            if token is None:
                raise CredentialsError(f"token_env = {token_env!r}: variable is not set")
        return cls(ca, token)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return None if self.token is None else ((AUTH_HEADER, f"Bearer {self.token}"),)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if self.ca is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=self.ca),
                                   options=list(options))
