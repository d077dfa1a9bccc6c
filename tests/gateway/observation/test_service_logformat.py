"""``--log-format json`` (issue 14) and no secret in any log record: a real ``ethen gateway`` process writing
JSON lines, and every record of an in-process gateway scanned (text and JSON) for the keys it handled."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from ethen.gateway.observation.logformat import TEXT_FORMAT, JsonFormatter
from tests.gateway.api.test_service_cli import ethen_cmd, free_port, write_toml
from tests.gateway.service_harness import CLIENT_KEY, ENV, PROVIDER_KEY, config_dict, live
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

USER = [{"role": "user", "content": "hello"}]
WRONG_KEY = "ethen-wrong-0f9e8d7c6b5a4938271605f4e3d2c1b0"


def _wait_healthy(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120  # a start-up bound (a loaded CI machine took over 30 s)
    while True:  # bounded: the deadline
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "gateway exited"
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.1)


def test_gateway_log_format_json_writes_json_lines_without_secrets(tmp_path: Path) -> None:
    script = Script(behaviors={"up-beta-small": Behavior(fail_status=500, echo_credentials=True)})
    with ServerThread(make_upstream_app(script)) as up:
        cfg = tmp_path / "gateway.toml"
        write_toml(config_dict(up.url), cfg)
        port = free_port()
        proc = subprocess.Popen(
            [*ethen_cmd(), "gateway", "--config", str(cfg), "--port", str(port), "--log-format", "json",
             "--log-level", "info"],
            env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            base = f"http://127.0.0.1:{port}/api/gateway/v1"
            _wait_healthy(base, proc)
            auth = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": "json-log-1"}
            r = httpx.post(f"{base}/chat/completions", headers=auth, timeout=15,
                           json={"model": "ethen/auto", "messages": USER, "max_tokens": 5})
            assert r.status_code == 200 and "fallback_used" in r.json()["ethen"]["routing"]["reason_codes"]
            r = httpx.post(f"{base}/chat/completions", headers={"authorization": f"Bearer {WRONG_KEY}"},
                           json={"model": "ethen/auto", "messages": USER}, timeout=15)
            assert r.status_code == 401
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=30)
    text = (out + err).decode()
    lines = [json.loads(x) for x in err.decode().splitlines() if x.strip()]  # each line is one JSON object
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    warned = [x for x in lines if x["level"] == "WARNING" and x["logger"] == "ethen.gateway.api.execute"]
    assert any("json-log-1" in x["message"] and "falling back" in x["message"] for x in warned), lines
    assert any(x["logger"].startswith("uvicorn") for x in lines)  # uvicorn's own lines are JSON too
    for secret in (CLIENT_KEY, PROVIDER_KEY, WRONG_KEY):
        assert secret not in text


def test_log_format_is_checked(tmp_path: Path) -> None:
    cmd = [*ethen_cmd(), "gateway", "--config", str(tmp_path / "x.toml"), "--log-format", "xml"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--log-format = 'xml'" in out.stderr


def test_json_formatter_carries_extra_fields() -> None:
    rec = logging.LogRecord("ethen.gateway", logging.WARNING, __file__, 1, "request %s failed", ("r1",), None)
    rec.request_id = "r1"
    rec.candidate = object()
    out = json.loads(JsonFormatter().format(rec))
    assert out["message"] == "request r1 failed" and out["level"] == "WARNING" and out["request_id"] == "r1"
    assert out["logger"] == "ethen.gateway" and out["candidate"].startswith("<object") and out["time"]


def test_no_secret_in_any_log_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    leaky = {
        "up-beta-small": Behavior(fail_status=500, echo_credentials=True),
        "up-alpha-large": Behavior(fail_status=401, echo_credentials=True),
        "up-gamma-claude": Behavior(fail_status=400, echo_credentials=True),
    }
    with live(leaky) as lv:
        hdr = {"authorization": f"Bearer {CLIENT_KEY}"}
        for model in ("ethen/auto", "alpha-large", "gamma-claude", "beta-small", "ethen/best"):
            for stream in (False, True):
                httpx.post(f"{lv.base_url}/chat/completions", headers=hdr, timeout=15,
                           json={"model": model, "messages": USER, "stream": stream})
        httpx.post(f"{lv.base_url}/chat/completions", headers={"authorization": f"Bearer {WRONG_KEY}"},
                   json={"model": "ethen/auto", "messages": USER}, timeout=15)
        time.sleep(0.3)  # the request log's writer logs nothing secret either
    assert any(r.levelno >= logging.WARNING for r in caplog.records)
    text, js = logging.Formatter(TEXT_FORMAT), JsonFormatter()
    for r in caplog.records:
        for line in (text.format(r), js.format(r)):
            for secret in (CLIENT_KEY, PROVIDER_KEY, WRONG_KEY):
                assert secret not in line, line
