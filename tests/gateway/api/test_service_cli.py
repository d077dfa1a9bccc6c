"""``ethen gateway --config FILE --port P`` as a real process, called with the openai SDK."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def write_toml(data: dict[str, object], path: Path) -> None:
    lines: list[str] = []
    for key, value in data.items():
        if isinstance(value, list):
            for item in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items()]
        elif isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    path.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ethen_cmd() -> list[str]:
    return [sys.executable, "-m", "ethen"]


def test_cli_serves_the_gateway(tmp_path: Path) -> None:
    with ServerThread(make_upstream_app(Script())) as up:
        cfg = tmp_path / "gateway.toml"
        write_toml(config_dict(up.url), cfg)
        port = free_port()
        proc = subprocess.Popen(
            [*ethen_cmd(), "gateway", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            base = f"http://127.0.0.1:{port}/api/gateway/v1"
            deadline = time.monotonic() + 120  # a start-up bound
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.1)
            client = openai.OpenAI(base_url=base, api_key=CLIENT_KEY, max_retries=0, timeout=10)
            r = client.chat.completions.create(
                model="ethen/cheap", messages=[{"role": "user", "content": "hi"}]
            )
            assert r.model_extra["ethen"]["routing"]["requested_model"] == "ethen/cheap"
        finally:
            proc.terminate()
            proc.wait(10)


def test_cli_rejects_a_bad_config_naming_key_and_value(tmp_path: Path) -> None:
    data = config_dict("http://127.0.0.1:1")
    data["providers"][0]["kind"] = "grpc"
    cfg = tmp_path / "gateway.toml"
    write_toml(data, cfg)
    out = subprocess.run(
        [*ethen_cmd(), "gateway", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "providers[0].kind = 'grpc'" in out.stderr
