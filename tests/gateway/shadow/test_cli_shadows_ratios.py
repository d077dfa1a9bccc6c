"""Issue 42 item 7: ``ethen shadows`` prints latency and cost ratios with enough significant digits (a ratio
of 0.0031 was printed ``0.00``): the table against a live gateway over real HTTP, and the formatting as a
property (the printed number reads back within half a unit of its third significant digit)."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ethen.admin.shadows_cli import ratio, table
from ethen.cli import app
from tests.gateway.shadow.harness import ADMIN_KEY, TOOLS, USER, rule, shadow_live
from tests.gateway.upstream import Behavior

runner = CliRunner()


def test_a_cheap_shadow_shows_its_cost_ratio(tmp_path: Path) -> None:
    # the primary reports 5,000 prompt tokens at $1/Mtok, the shadow 1 at $20/Mtok: a ratio of ~0.012
    behaviors = {"up-alpha-large": Behavior(prompt_tokens=5000), "up-beta-tools": Behavior(prompt_tokens=1,
                                                                                         pieces=("a",))}
    with shadow_live(tmp_path, [rule()], behaviors) as lv:
        assert lv.post({"model": "ethen/fast", "messages": USER, "max_tokens": 5}).status_code == 200
        lv.wait_pairs(1)
        summary = lv.shadows()["data"][0]["summary"]
        res = runner.invoke(app, ["shadows", "--url", lv.gateway.url, "--admin-key", ADMIN_KEY])
    assert res.exit_code == 0, res.output
    head, row = (line.split() for line in res.output.splitlines()[:2])
    assert row[1] == TOOLS
    cost = row[head.index("cost_x")]
    expected = (1 * 20 + 1 * 40) / (5000 * 1 + 3 * 2)
    assert summary["cost_ratio"] == expected
    assert cost == "0.012" and cost != "0.01"


def test_the_table_keeps_three_significant_digits() -> None:
    summary = {"n": 3, "success_rate": 1.0, "latency_ratio": 0.0031, "cost_ratio": 12.3456, "exact_rate": 1.0,
               "mean_similarity": 1.0, "tool_calls_equal_rate": None, "schema_valid_rate": None}
    out = table([{"alias": "ethen/fast", "candidate": TOOLS, "percent": 5, "summary": summary, "canary": None,
                  "promotable": False, "promotion": "n = 3 < min_samples = 20"}])
    head, row = (line.split() for line in out.splitlines()[:2])
    assert row[head.index("latency_x")] == "0.0031" and row[head.index("cost_x")] == "12.3"


@settings(max_examples=500, deadline=None, database=None)
@given(st.floats(min_value=1e-12, max_value=1e9, allow_nan=False))
def test_a_printed_ratio_reads_back_to_three_significant_digits(v: float) -> None:
    text = ratio(v)
    assert "e" not in text and text != "0"
    back = float(text)
    if v >= 1000:
        assert abs(back - v) <= 0.5
    else:
        digit = 10 ** (math.floor(math.log10(v)) - 2)  # the third significant digit's unit
        assert abs(back - v) <= digit * 0.5 + 1e-12 * v, (v, text)
