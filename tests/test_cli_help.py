"""``--help`` says what the code says (issue 42 item 15): typer renders help as rich markup, which ate every
``[section]`` of a config (``else  of --config``, ``its  section``), and command docstrings showed their
reStructuredText double backticks. Each command's ``--help`` is rendered wide (one line per option) and every
option's help text must appear in it as written, brackets included; no help shows ``````."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from ethen.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command under ``cmd`` (typer's own click: duck-typed)."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _flat(text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


ALL = list(_commands(typer.main.get_command(app)))


@pytest.mark.parametrize(("path", "cmd"), ALL, ids=[" ".join(p) or "ethen" for p, _ in ALL])
def test_every_help_text_is_shown_as_written(path: tuple[str, ...], cmd: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "2000")
    out = CliRunner().invoke(app, [*path, "--help"])
    assert out.exit_code == 0, out.output
    assert "``" not in out.output
    shown = _flat(out.output)
    for param in cmd.params:
        text = getattr(param, "help", None)
        if text and not getattr(param, "hidden", False):
            assert _flat(text.replace("\\[", "[")) in shown, (param.name, text)
    for section in re.findall(r"\[\[?[a-z_]+\]?\]", (cmd.help or "").replace("\\[", "[")):
        assert section in shown, section


@pytest.mark.parametrize("argv", [["logs"], ["keys", "create"], ["usage"]])
def test_the_store_commands_name_the_store_section(argv: list[str]) -> None:
    """The real ``ethen`` entry point, as a user runs it."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "ethen", *argv, "--help"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "else [store] of --config" in out.stdout
    assert "Gateway TOML config (its [store] section)." in out.stdout


def test_ethen_help_has_no_doubled_backticks() -> None:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "ethen", "--help"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "``" not in out.stdout
    assert "Serve the OpenAI-compatible gateway (/api/gateway/v1)" in out.stdout
