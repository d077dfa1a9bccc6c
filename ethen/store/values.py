"""Pure value helpers: money in integer nano-USD, budget windows, time.

Choices where the spec is silent:
- Money is stored as integer **nano-USD** (1e-9 USD) in ``BIGINT`` columns, so sums are exact on SQLite and
  Postgres alike (a token at $0.05/Mtok is 50 nano-USD). Conversion rounds costs **up** (``ceil``) so rounding
  can never make the ledger under-count spend.
- Budget windows are **calendar windows in UTC**: ``day`` starts at 00:00 UTC, ``month`` on the 1st at 00:00
  UTC. A calendar window is what operators budget against (invoices); a rolling window would make the
  remaining budget creep back minute by minute.
- All datetimes are timezone-aware UTC; naive datetimes are rejected.
- The largest amount is :data:`MAX_USD` (9,223,372,036 USD): the most nano-USD a signed 64-bit ``BIGINT``
  holds. A larger amount (or an integer beyond the float range) is a ``ValueError``, not a database overflow.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Final, Literal

__all__ = ["MAX_USD", "NANO", "WINDOWS", "Window", "aware", "from_nano", "to_nano", "window_start"]

NANO: Final = 1_000_000_000
MAX_USD: Final = (2**63 - 1) // NANO
Window = Literal["day", "month"]
WINDOWS: Final = ("day", "month")


def to_nano(usd: float) -> int:
    """USD -> nano-USD, rounded up. Rejects negative, non-finite and too large (> ``MAX_USD``) values."""
    if type(usd) is float and 0.0 <= usd <= MAX_USD:  # the request path's case (NaN fails the comparison)
        return math.ceil(round(usd * NANO, 3))
    if not (isinstance(usd, int | float) and not isinstance(usd, bool)):
        raise ValueError(f"amount must be a finite number >= 0 USD, got {usd!r}")
    if isinstance(usd, int) and usd > MAX_USD:  # before isfinite(): a huge int does not convert to float
        shown = usd if usd < 10**20 else "a huge integer"
        raise ValueError(f"amount must be at most {MAX_USD} USD, got {shown}")
    if not (math.isfinite(usd) and usd >= 0):
        raise ValueError(f"amount must be a finite number >= 0 USD, got {usd!r}")
    if usd > MAX_USD:
        raise ValueError(f"amount must be at most {MAX_USD} USD, got {usd!r}")
    return math.ceil(round(usd * NANO, 3))


def from_nano(nano: int) -> float:
    return nano / NANO


def aware(dt: datetime, name: str = "datetime") -> datetime:
    if dt.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware, got {dt.isoformat()}")
    return dt.astimezone(UTC)


def window_start(window: Window, now: datetime) -> datetime:
    """Start of the calendar window (UTC) containing ``now``."""
    n = aware(now, "now")
    if window == "day":
        return n.replace(hour=0, minute=0, second=0, microsecond=0)
    if window == "month":
        return n.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    raise ValueError(f"budget window must be one of {', '.join(WINDOWS)}, got {window!r}")
