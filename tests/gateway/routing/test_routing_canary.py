"""Canary gate: bucket distribution, stability, promotion only when feasible, acceptance on the receipt."""

from __future__ import annotations

import random
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import pytest

from ethen.gateway.routing import (
    CANARY_PERCENTS,
    CanaryTarget,
    Candidate,
    CandidateStats,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    bucket,
    decide,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BEST = Candidate("a", "best", ModelInfo(128_000, 8192, supports_tools=True, quality=0.95), Prices(0, 0))
CANARY = Candidate("b", "new", ModelInfo(128_000, 8192, quality=0.2), Prices(5, 20))
BODY: dict[str, Any] = {"model": "ethen/auto", "messages": [{"role": "user", "content": "hi"}]}


def ids(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return [f"req_{rnd.getrandbits(96):024x}" for _ in range(n)]


def ctx(target: CanaryTarget, request_id: str, stats: dict[tuple[str, str], CandidateStats] | None = None,
        ) -> RoutingContext:
    return RoutingContext((BEST, CANARY), ProjectPolicy(), TelemetrySnapshot(stats or {}), (target,), NOW,
                          request_id)


@pytest.mark.parametrize("percent", CANARY_PERCENTS)
def test_bucket_share_within_1_5_points(percent: int) -> None:
    sample = ids(20_000, seed=percent)
    share = sum(bucket("ethen/auto", "b/new", rid) < percent for rid in sample) / len(sample) * 100
    assert abs(share - percent) <= 1.5


def test_promoted_share_through_decide() -> None:
    target = CanaryTarget("ethen/auto", "b/new", 20)
    sample = ids(20_000, seed=7)
    promoted = sum(decide(BODY, ctx(target, rid)).receipt.selected_model == "new" for rid in sample)
    assert abs(promoted / len(sample) * 100 - 20) <= 1.5


def test_same_id_same_bucket_across_processes() -> None:
    first = [bucket("ethen/auto", "b/new", rid) for rid in ids(200, seed=1)]
    assert first == [bucket("ethen/auto", "b/new", rid) for rid in ids(200, seed=1)]
    code = (
        "from ethen.gateway.routing import bucket;"
        "print(bucket('ethen/auto', 'b/new', 'req-123'), bucket('ethen/fast', 'b/new', 'req-123'))"
    )
    for seed in ("0", "12345"):  # different hash seeds: the bucket must not use Python's salted hash()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}, timeout=60)
        assert out.stdout.split() == [str(bucket("ethen/auto", "b/new", "req-123")),
                                      str(bucket("ethen/fast", "b/new", "req-123"))]
    # the bucket depends on alias, candidate and request id
    assert len({bucket(a, c, "r") for a in ("ethen/auto", "ethen/fast") for c in ("x/1", "x/2", "x/3")}) > 1


def _hit_id(target: CanaryTarget, hit: bool = True) -> str:
    for rid in ids(1000, seed=3):
        if (bucket(target.alias, target.candidate, rid) < target.percent) is hit:
            return rid
    raise AssertionError("no such id")


def _miss_id(target: CanaryTarget) -> str:
    return _hit_id(target, hit=False)


def test_hit_promotes_to_rank_1_and_keeps_the_rest_as_fallback() -> None:
    target = CanaryTarget("ethen/auto", "b/new", 50)
    d = decide(BODY, ctx(target, _hit_id(target)))
    assert [sc.id for sc in d.chain] == ["b/new", "a/best"]
    assert "canary_promoted" in d.receipt.reason_codes
    block = d.receipt.to_dict()["canary"]
    assert block["promoted"] and block["hit"] and block["eligible"] and block["candidate"] == "b/new"
    miss = decide(BODY, ctx(target, _miss_id(target)))
    assert [sc.id for sc in miss.chain] == ["a/best", "b/new"]
    assert miss.receipt.to_dict()["canary"]["promoted"] is False


def test_no_promotion_when_the_canary_fails_the_filter() -> None:
    target = CanaryTarget("ethen/auto", "b/new", 100)
    tools_body = {**BODY, "tools": [{"type": "function", "function": {"name": "f"}}]}
    d = decide(tools_body, ctx(target, "any"))
    assert [sc.id for sc in d.chain] == ["a/best"]
    block = d.receipt.to_dict()["canary"]
    assert block["hit"] and not block["eligible"] and not block["promoted"]
    assert "canary_promoted" not in d.receipt.reason_codes


def test_zero_percent_never_promotes_and_other_alias_is_ignored() -> None:
    zero = CanaryTarget("ethen/auto", "b/new", 0)
    assert all(decide(BODY, ctx(zero, rid)).chain[0].id == "a/best" for rid in ids(300, seed=5))
    other = CanaryTarget("ethen/fast", "b/new", 100)
    d = decide(BODY, ctx(other, "r"))
    assert d.chain[0].id == "a/best" and "canary" not in d.receipt.to_dict()


@pytest.mark.parametrize(
    ("stats", "met"),
    [
        (None, False),
        (CandidateStats(10, 10), False),  # too few samples
        (CandidateStats(40, 37), False),  # 92.5% < 95%
        (CandidateStats(40, 38), True),  # 95%
    ],
)
def test_acceptance_from_telemetry_on_receipt(stats: CandidateStats | None, met: bool) -> None:
    target = CanaryTarget("ethen/auto", "b/new", 5, min_success_rate=0.95, min_samples=20)
    telemetry = {("b", "new"): stats} if stats is not None else None
    d = decide(BODY, ctx(target, "r1", telemetry))
    assert d.receipt.to_dict()["canary"]["acceptance_met"] is met


def test_invalid_target_percent_rejected() -> None:
    for bad in (2, 10, 101, -1, True):
        with pytest.raises(ValueError, match="percent"):
            CanaryTarget("ethen/auto", "b/new", bad)
