"""``ethen mesh route``: table with the per-stage breakdown, JSON output, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethen.cli import app

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "mesh-states.json")
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["mesh", "route", *args])


def test_route_prints_the_table_with_the_breakdown():
    result = run(EXAMPLE, "--layers", "0-11")
    assert result.exit_code == 0, result.output
    out = result.output
    expected = ("node term", "hop term", "prefill term", "mini", "laptop", "0-7", "8-11", "35.83", "20.67",
                "15.00", "71.50", "mini -> laptop: cost 71.5", "not on the cheapest chain): gpu")  # fmt: skip
    for text in expected:
        assert text in out
    assert "smollm2-135m-instruct" in out  # model from the document


def test_route_json_with_window_prompt_and_weights():
    result = run(EXAMPLE, "--layers", "8-11", "--prompt-tokens", "2048", "--weight", "hop=0.3",
                 "--weight", "latency=2", "--json", "--model", "m")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["nodes"] == ["laptop"]
    assert data["model"] == "m"
    assert data["weights"]["hop"] == 0.3 and data["weights"]["latency"] == 2.0
    assert data["stages"][0]["prefill_cost"] == 20.0
    assert data["cost"] == pytest.approx(18 + 0 + 35 / 3 + 20)


def test_weights_change_the_cost_from_the_command_line():
    data = json.loads(run(EXAMPLE, "--json", "--weight", "hop=20").output)
    assert data["nodes"] == ["mini", "laptop"]
    assert data["cost"] == pytest.approx(35 + 5 / 6 + 20 + 2 / 3 + 300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "0-13"], "error: no route covers layers 0-13"),
        (["--layers", "11-8"], "error: layer_range is inverted: first layer 11 > last layer 8"),
        (["--layers", "a-b"], "error: --layers must look like FIRST-LAST"),
        (["--weight", "hop"], "error: --weight must look like NAME=VALUE"),
        (["--weight", "hops=1"], "error: unknown weight 'hops'"),
        (["--weight", "hop=-1"], "error: weight hop must be >= 0"),
        (["--weight", "hop=x"], "error: --weight hop must be a number, got 'x'"),
        (["--prompt-tokens", "many"], "error: --prompt-tokens must be an integer, got 'many'"),
        (["--prompt-tokens", "-3"], "error: prompt_tokens must be >= 0"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(args, message):
    result = run(EXAMPLE, *args)
    assert result.exit_code == 2
    assert result.output.startswith(message)
    assert result.output.count("\n") == 1


def test_bad_files_are_one_line_errors(tmp_path):
    missing = run(str(tmp_path / "nope.json"))
    assert missing.exit_code == 2
    assert "error: cannot read" in missing.output and "No such file" in missing.output
    broken = tmp_path / "broken.json"
    broken.write_text("{nodes: ")
    result = run(str(broken))
    assert result.exit_code == 2 and "is not valid JSON" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"node_id": "x", "latency_ms": -1, "current_load": 0, "capacity_score": 1,
                                "served_layers": [[0, 1]]}]))  # fmt: skip
    result = run(str(bad))
    assert result.exit_code == 2
    assert result.output == "error: nodes[0]: node 'x': latency_ms must be >= 0, got -1\n"


def test_a_file_with_one_health_object_is_a_one_node_mesh(tmp_path):
    single = tmp_path / "node.json"
    health = {"node_id": "mini", "latency_ms": 6, "current_load": 0.2, "capacity_score": 6,
              "served_layers": [[0, 7]], "alive": True}  # fmt: skip
    single.write_text(json.dumps(health))
    result = run(str(single), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["nodes"] == ["mini"]


def test_the_installed_command_runs_in_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "ethen", "mesh", "route", EXAMPLE, "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nodes"] == ["mini", "laptop"]
    proc = subprocess.run(
        [sys.executable, "-m", "ethen", "mesh", "route", EXAMPLE, "--layers", "20-30"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no route covers layers 20-30") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""
