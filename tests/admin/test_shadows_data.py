"""The shadow summary (issue 27, ``ethen.admin.shadows_data.summarize``): hypothesis properties against a
brute-force oracle written from the module's docstring."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.admin.shadows_data import summarize

maybe_bool = st.none() | st.booleans()
ms = st.none() | st.floats(0, 5_000, allow_subnormal=False)


@st.composite
def pairs(draw: Any) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, 12))):
        ok = draw(st.booleans())
        out.append({
            "candidate_status": "ok" if ok else draw(st.sampled_from(["upstream_timeout", "internal_error"])),
            "candidate_latency_ms": draw(ms) if ok else None,
            "primary_latency_ms": draw(ms),
            "candidate_cost_nano": draw(st.none() | st.integers(0, 10**9)) if ok else None,
            "primary_cost_nano": draw(st.none() | st.integers(0, 10**9)),
            "exact": draw(st.booleans()) if ok else None,
            "similarity": draw(st.floats(0, 1)) if ok else None,
            "tool_calls_equal": draw(maybe_bool) if ok else None,
            "schema_valid": draw(maybe_bool) if ok else None,
            "primary_schema_valid": draw(maybe_bool) if ok else None,
        })
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def rate(xs: list[Any]) -> float | None:
    known = [x for x in xs if x is not None]
    return sum(1 for x in known if x) / len(known) if known else None


def oracle(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["candidate_status"] == "ok"]
    both = [r for r in ok if r["candidate_latency_ms"] is not None and r["primary_latency_ms"] is not None]
    costs = [r for r in ok if r["candidate_cost_nano"] is not None and r["primary_cost_nano"] is not None]
    lat = None
    if both and median([r["primary_latency_ms"] for r in both]) > 0:
        lat = (median([r["candidate_latency_ms"] for r in both])
               / median([r["primary_latency_ms"] for r in both]))
    cost = None
    if costs and sum(r["primary_cost_nano"] for r in costs) > 0:
        cost = sum(r["candidate_cost_nano"] for r in costs) / sum(r["primary_cost_nano"] for r in costs)
    sims = [r["similarity"] for r in ok]
    return {
        "n": len(rows), "ok": len(ok), "success_rate": len(ok) / len(rows) if rows else None,
        "latency_ratio": lat, "cost_ratio": cost,
        "exact_rate": rate([r["exact"] for r in ok]),
        "mean_similarity": sum(sims) / len(sims) if sims else None,
        "tool_calls_equal_rate": rate([r["tool_calls_equal"] for r in ok]),
        "schema_valid_rate": rate([r["schema_valid"] for r in ok]),
        "primary_schema_valid_rate": rate([r["primary_schema_valid"] for r in ok]),
    }


def close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != b:
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return bool(a == b)


@settings(max_examples=400, deadline=None)
@given(pairs())
def test_summary_matches_the_brute_force_oracle(rows: list[dict[str, Any]]) -> None:
    got, want = summarize(rows), oracle(rows)
    assert got.keys() == want.keys()
    for k in want:
        assert close(got[k], want[k]), (k, got[k], want[k])
    if got["success_rate"] is not None:
        assert 0 <= got["success_rate"] <= 1
