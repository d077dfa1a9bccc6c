"""Claude Code itself (npm ``@anthropic-ai/claude-code``, on Debian's node) through the gateway (issue 26): in
headless mode (``claude -p``) with ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_AUTH_TOKEN`` pointing at a live
gateway over the scripted tool-capable upstream, it completes a task that uses a tool: the upstream asks for
its ``Write`` tool, Claude Code writes the file and sends the tool result back, the upstream answers.

The ``claude`` executable is ``$ETHEN_TEST_CLAUDE`` (``.ci/run`` installs it) or the one on ``PATH``; the test
skips without one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.gateway.service_harness import CLIENT_KEY, live
from tests.gateway.upstream import Behavior

CLAUDE = os.environ.get("ETHEN_TEST_CLAUDE") or shutil.which("claude")
pytestmark = pytest.mark.skipif(not CLAUDE, reason="Claude Code is not installed (see .ci/run)")


@pytest.mark.parametrize(("route", "path"), [("beta-tools", "chat"), ("gamma-claude", "messages")])
def test_claude_code_completes_a_tool_task_through_the_gateway(
    tmp_path: Path, route: str, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a chat upstream (translated both ways) and a ``kind = "anthropic"`` one (passed through)."""
    assert CLAUDE is not None
    caplog.set_level(logging.WARNING, logger="ethen.gateway")
    target = tmp_path / "hello.txt"
    args = json.dumps({"file_path": str(target), "content": "hello from ethen\n"})
    upstream = Behavior(tool_name="Write", tool_args=args, answer_tool_results=True, pieces=("Wrote", " it."))
    with live({f"up-{route}": upstream}, model_map={"claude-*": route}) as lv:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": lv.gateway.url, "ANTHROPIC_AUTH_TOKEN": CLIENT_KEY,
            # the route's max output is 8,000; Claude Code asks 32,000 (the max-output gate would refuse it)
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4000",
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
        }  # fmt: skip
        argv = [CLAUDE, "-p", "Write hello.txt saying hello", "--permission-mode", "acceptEdits",
                "--output-format", "json"]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
        calls = [c for c in lv.script.calls if c["body"].get("model") == f"up-{route}"]
        metrics = httpx.get(f"{lv.base_url}/metrics", timeout=5).text
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"] == "Wrote it."
    assert target.read_text() == "hello from ethen\n"  # Claude Code ran the tool the upstream asked for
    assert {c["path"] for c in calls} == {path}
    assert all(c["body"]["stream"] is True for c in calls)  # Claude Code reads the event stream
    # its first call, HEAD / (a path the gateway does not serve): counted and logged with its user agent
    assert 'ethen_gateway_unknown_path_requests_total{method="HEAD"} 1.0' in metrics
    assert any(r.getMessage().startswith("unknown path: HEAD '/' from 127.0.0.1 (user agent '")
               for r in caplog.records)
    last = calls[-1]["body"]["messages"]
    if path == "chat":
        assert any(t["function"]["name"] == "Write" for t in calls[0]["body"]["tools"])
        assert last[-1]["role"] == "tool" and last[-1]["tool_call_id"] == "call_1"
        assert last[-2]["tool_calls"][0]["function"]["name"] == "Write"
    else:  # Claude Code's own body: its tools, cache_control and the tool_use / tool_result blocks as sent
        assert any(t["name"] == "Write" for t in calls[0]["body"]["tools"])
        assert last[-2]["content"][-1]["type"] == "tool_use" and last[-2]["content"][-1]["name"] == "Write"
        assert last[-1]["content"][0]["type"] == "tool_result"
        assert last[-1]["content"][0]["tool_use_id"] == "toolu_1"
