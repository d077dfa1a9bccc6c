"""Helpers shared by the store's modules: time normalization, money validation, and the engine pair base."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from .errors import StoreInvalidError
from .values import aware, to_nano

__all__ = ["EngineBase", "budget_nano", "epoch_ms", "now_utc", "utc"]


class EngineBase:
    """``engine`` for reads (deferred transactions), ``writer`` for write transactions (same pool; see
    :mod:`ethen.store.engine`)."""

    engine: AsyncEngine
    writer: AsyncEngine


def utc(dt: datetime | None) -> datetime | None:
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def now_utc(now: datetime | None) -> datetime:
    return datetime.now(UTC) if now is None else aware(now, "now")


def epoch_ms(dt: datetime) -> int:
    """Unix epoch milliseconds of an aware datetime (leases are stored as integers)."""
    return int(dt.timestamp() * 1000)


def budget_nano(value: float | None) -> int | None:
    if value is None:
        return None
    try:
        return to_nano(value)
    except ValueError:
        raise StoreInvalidError(f"budget_usd = {value!r}: must be a finite number >= 0") from None
