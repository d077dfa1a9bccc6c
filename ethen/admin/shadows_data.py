"""What ``GET /api/admin/v1/shadows`` says about one shadow candidate (issue 27): a pure summary of its
recorded pairs (rows of :mod:`ethen.store.shadows`).

- ``n``: pairs; ``success_rate``: the share whose shadow call answered (``candidate_status == "ok"``).
- Over the successful pairs only (a failed call has no answer, latency or cost to compare):
  ``latency_ratio`` = median shadow latency / median primary latency (**medians**: one slow outlier does
  not swing it); ``cost_ratio`` = mean shadow cost / mean primary cost over the pairs with both costs
  known (**means**: the ratio of what the traffic would cost in total); ``exact_rate``; ``mean_similarity``;
  ``tool_calls_equal_rate`` over the pairs where either side called a tool; ``schema_valid_rate`` and
  ``primary_schema_valid_rate`` over the pairs whose request had a JSON schema. ``None`` when nothing
  qualifies.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["summarize"]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _rate(values: Sequence[Any]) -> float | None:
    known = [bool(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary of one candidate's pairs (module docstring)."""
    n = len(rows)
    ok = [r for r in rows if r["candidate_status"] == "ok"]
    lat = [r for r in ok if r["candidate_latency_ms"] is not None and r["primary_latency_ms"] is not None]
    costs = [r for r in ok if r["candidate_cost_nano"] is not None and r["primary_cost_nano"] is not None]
    sims = [float(r["similarity"]) for r in ok if r["similarity"] is not None]
    return {
        "n": n,
        "ok": len(ok),
        "success_rate": len(ok) / n if n else None,
        "latency_ratio": _ratio(
            statistics.median(r["candidate_latency_ms"] for r in lat) if lat else None,
            statistics.median(r["primary_latency_ms"] for r in lat) if lat else None,
        ),
        "cost_ratio": _ratio(
            statistics.fmean(r["candidate_cost_nano"] for r in costs) if costs else None,
            statistics.fmean(r["primary_cost_nano"] for r in costs) if costs else None,
        ),
        "exact_rate": _rate([r["exact"] for r in ok]),
        "mean_similarity": statistics.fmean(sims) if sims else None,
        "tool_calls_equal_rate": _rate([r["tool_calls_equal"] for r in ok]),
        "schema_valid_rate": _rate([r["schema_valid"] for r in ok]),
        "primary_schema_valid_rate": _rate([r["primary_schema_valid"] for r in ok]),
    }
