"""Codex CLI itself (npm ``@openai/codex``: a prebuilt native binary in the package, launched by Debian's
node) through the gateway (issue 26): ``codex exec`` with a fresh default config (only a custom
``model_providers`` entry with ``wire_api = "responses"``, ``base_url`` at the gateway and an ``env_key``)
sends its default tool set (functions, a ``namespace`` group, a hosted ``web_search``) and completes a
tool-using task against the scripted upstream: the upstream asks for ``exec_command``, Codex runs it and sends
its output back, the upstream answers.

The ``codex`` executable is ``$ETHEN_TEST_CODEX`` (``.ci/run`` installs it) or the one on ``PATH``; the test
skips without one."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.service_harness import CLIENT_KEY, live
from tests.gateway.upstream import Behavior

CODEX = os.environ.get("ETHEN_TEST_CODEX") or shutil.which("codex")
pytestmark = pytest.mark.skipif(not CODEX, reason="Codex CLI is not installed (see .ci/run)")


def _config(home: Path, base_url: str) -> None:
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "beta-tools"\n'
        'model_provider = "ethen"\n'
        "[model_providers.ethen]\n"
        'name = "Ethen"\n'
        f'base_url = "{base_url}"\n'
        'env_key = "ETHEN_API_KEY"\n'
        'wire_api = "responses"\n'
    )


@pytest.mark.timeout(240)
def test_codex_exec_completes_a_tool_task_through_the_gateway(tmp_path: Path) -> None:
    assert CODEX is not None
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    token = secrets.token_hex(8)
    (work / "marker.txt").write_text(f"marker {token}\n")
    upstream = Behavior(tool_name="exec_command", tool_args=json.dumps({"cmd": "cat marker.txt"}),
                        answer_tool_results=True, pieces=("The marker", " is read."))
    with live({"up-beta-tools": upstream}) as lv:
        _config(home, f"{lv.gateway.url}/v1")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
               "CODEX_HOME": str(home / ".codex"), "ETHEN_API_KEY": CLIENT_KEY}
        argv = [CODEX, "exec", "--skip-git-repo-check", "--json", "Read marker.txt and tell me what it says"]
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=200,
                              stdin=subprocess.DEVNULL)
        calls = [c for c in lv.script.calls if c["body"].get("model") == "up-beta-tools"]
        ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        logged: list[dict[str, Any]] = []
        while time.monotonic() < deadline and len(logged) < len(calls):  # the log's writer lags a little
            time.sleep(0.05)
            logged = [r for r in list(ring) if r["endpoint"] == "responses"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages[-1] == "The marker is read."
    assert len(calls) >= 2 and all(c["body"]["stream"] is True for c in calls)
    first = calls[0]["body"]
    names = [t["function"]["name"] for t in first["tools"]]
    assert "exec_command" in names and any("__" in n for n in names)  # its namespace group, qualified
    last = calls[-1]["body"]["messages"]
    assert last[-1]["role"] == "tool" and token in last[-1]["content"]  # Codex ran the command
    assert len(logged) == len(calls) and all(r["status"] == 200 for r in logged)
    assert all(r["receipt"]["dropped_tools"][0]["type"] == "web_search" for r in logged)  # its hosted tool
