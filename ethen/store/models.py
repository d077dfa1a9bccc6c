"""Frozen records the store returns. Money is USD (converted from exact nano-USD at the edge)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .values import Window

__all__ = ["CertificationReceipt", "KeyInfo", "Principal", "Project", "Spend", "UsageRow", "usage_report"]


@dataclass(frozen=True, slots=True)
class Project:
    id: int
    name: str
    allowed_providers: tuple[str, ...] | None
    allowed_models: tuple[str, ...] | None
    budget_usd: float | None
    budget_window: Window
    default_alias: str | None
    created_at: datetime
    rpm: int | None = None  # requests per rate-limit window (gateway.accounting.ratelimit); None: no limit
    tpm: int | None = None  # tokens per rate-limit window

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "allowed_providers": list(self.allowed_providers) if self.allowed_providers is not None else None,
            "allowed_models": list(self.allowed_models) if self.allowed_models is not None else None,
            "budget_usd": self.budget_usd,
            "budget_window": self.budget_window,
            "default_alias": self.default_alias,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key's public data (never the key or its hash)."""

    key_id: str
    project: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None
    rpm: int | None = None  # the key's own rate limits (its project's apply too)
    tpm: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "project": self.project,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "last_used_at": self.last_used_at.isoformat() if self.last_used_at else None,
            "rpm": self.rpm,
            "tpm": self.tpm,
        }


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: a store key (with its own rate limits) and its project."""

    key_id: str
    project: Project
    rpm: int | None = None
    tpm: int | None = None


@dataclass(frozen=True, slots=True)
class Spend:
    """A project's window: settled spend since ``window_start``, the active per-request reservations
    (:meth:`ethen.store.Store.reserve`) and the budget granted to live gateway instances (their in-flight
    requests plus what they claimed ahead; see :mod:`ethen.store.escrow`)."""

    budget_usd: float | None
    settled_usd: float
    reserved_usd: float
    window_start: datetime
    granted_usd: float = 0.0

    @property
    def remaining_usd(self) -> float | None:
        if self.budget_usd is None:
            return None
        return max(0.0, self.budget_usd - self.settled_usd - self.reserved_usd - self.granted_usd)


@dataclass(frozen=True, slots=True)
class UsageRow:
    project: str
    key_id: str | None
    model: str
    provider: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    #: of ``prompt_tokens``: read from / written to the provider's prompt cache; what the reads saved (USD)
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    saved_usd: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "key_id": self.key_id,
            "model": self.model,
            "provider": self.provider,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "saved_usd": self.saved_usd,
        }


def usage_report(rows: Sequence[UsageRow]) -> dict[str, Any]:
    """``ethen usage``'s and the admin API's report: the rows and their totals (cost, cache reads and
    writes, what the reads saved)."""
    return {
        "data": [r.to_dict() for r in rows],
        "total_cost_usd": sum(r.cost_usd for r in rows),
        "total_cache_read_tokens": sum(r.cache_read_tokens for r in rows),
        "total_cache_write_tokens": sum(r.cache_write_tokens for r in rows),
        "total_saved_usd": sum(r.saved_usd for r in rows),
    }


@dataclass(frozen=True, slots=True)
class CertificationReceipt:
    """A dated live-certification receipt for one provider/model, valid on ``[certified_at, expires_at)``."""

    receipt_id: str
    provider: str
    model: str
    certified_at: datetime
    expires_at: datetime
    probe: dict[str, Any]

    def valid_at(self, now: datetime) -> bool:
        return self.certified_at <= now < self.expires_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "receipt_id": self.receipt_id,
            "provider": self.provider,
            "model": self.model,
            "certified_at": self.certified_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "probe": self.probe,
        }
