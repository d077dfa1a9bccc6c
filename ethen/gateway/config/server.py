"""The ``[server]`` section: where the gateway listens and its limits on slow clients and on each client
address (:mod:`ethen.gateway.api.serve` and :mod:`ethen.gateway.api.connections` apply them)."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from .base import _Strict

__all__ = [
    "ServerConfig",
]


class ServerConfig(_Strict):
    """Where to listen, and the limits on slow clients (:mod:`ethen.gateway.api.serve` applies them): a
    request's
    headers must arrive within ``header_timeout_s`` of its first byte (of the connection, for the first
    request), its body within ``body_timeout_s`` of the headers' end (else 408), and beyond
    ``max_connections`` open connections a request gets 503. Per client address (issue 23):
    ``max_connections_per_client`` open connections (default half of ``max_connections``: one address never
    takes them all; while k >= 2 addresses hold connections, each at most ``max_connections // (k + 1)``, the
    fair share of issue 42) and ``max_pending_headers_per_client`` (32) sockets still sending their headers
    a second after they began; past either, a socket is refused or the address's oldest slow one closed (429).

    ``trusted_proxies`` (issue 42): IP addresses or CIDR networks of reverse proxies whose
    ``X-Forwarded-For`` / ``X-Forwarded-Proto`` headers are believed (the client address then used by the
    login throttle, the logs and the dashboard's cookie rule); empty (the default): forwarded headers are
    ignored from every peer, loopback included. A connection from a trusted proxy is not subject to the
    per-address connection caps (its clients are only known once a request's headers are read)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)
    max_connections_per_client: int | None = Field(default=None, ge=1, le=1_000_000)
    max_pending_headers_per_client: int = Field(default=32, ge=1, le=1_000_000)
    trusted_proxies: list[str] = Field(default_factory=list, max_length=1024)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for i, entry in enumerate(v):
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies[{i}] = {entry!r}: not an IP address or CIDR network "
                                 "(e.g. '10.0.0.5' or '10.0.0.0/8')") from None
        return [entry.strip() for entry in v]

    @property
    def trusted_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``trusted_proxies`` as networks (an address is its /32 or /128)."""
        return tuple(ipaddress.ip_network(entry, strict=False) for entry in self.trusted_proxies)

    @field_validator("header_timeout_s", "body_timeout_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("max_connections_per_client")
    @classmethod
    def _within_global(cls, v: int | None, info: ValidationInfo) -> int | None:
        total = info.data.get("max_connections")
        if v is not None and total is not None and v > total:
            raise ValueError(f"must be at most server.max_connections ({total})")
        return v

    @property
    def connections_per_client(self) -> int:
        """``max_connections_per_client``, or half of ``max_connections`` (at least 1) when unset."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 2)
