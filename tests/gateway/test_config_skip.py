"""A provider whose key variable is unset does not stop the gateway (issue 10 item 12): the README's example
(``examples/gateway.toml`` with only ``OPENAI_API_KEY`` and ``ANTHROPIC_API_KEY`` exported) serves, and each
skipped provider gets one WARNING naming its variable."""

from __future__ import annotations

import copy
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ethen.gateway.config import load_config, parse_config, skip_providers_without_keys
from ethen.gateway.errors import GatewayConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gateway.toml"
DEV_KEY = "ethen-dev-0123456789abcdef"  # the example's documented development key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_gateway_example_runs_with_the_two_keys_it_names() -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(OPENAI_API_KEY="sk-test-openai", ANTHROPIC_API_KEY="sk-ant-test")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "gateway", "--config", str(EXAMPLE), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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
        r = httpx.get(f"{base}/models", headers={"authorization": f"Bearer {DEV_KEY}"}, timeout=10)
        assert r.status_code == 200, r.text
        ids = {m["id"] for m in r.json()["data"]}
        assert {"gpt-4o-mini", "claude-sonnet-4", "qwen2.5-7b-local"} <= ids
        assert not {"deepseek-chat", "llama-3.1-8b-instant"} & ids
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert proc.stdout is not None
    log = proc.stdout.read()
    for provider, var in (("deepseek", "DEEPSEEK_API_KEY"), ("groq", "GROQ_API_KEY")):
        warning = f"provider {provider!r} skipped: its api_key_env variable {var} is not set"
        assert f"WARNING ethen.gateway.config: {warning}" in log, log
    assert "OPENAI_API_KEY" not in log and "sk-test-openai" not in log


def test_skipping_drops_routes_and_canaries_and_keeps_a_complete_config(caplog: pytest.LogCaptureFixture
                                                                         ) -> None:
    cfg = load_config(EXAMPLE)
    assert skip_providers_without_keys(cfg, {"OPENAI_API_KEY": "a", "ANTHROPIC_API_KEY": "b",
                                             "DEEPSEEK_API_KEY": "c", "GROQ_API_KEY": "d"}) is cfg
    with caplog.at_level(logging.WARNING, logger="ethen.gateway.config"):
        kept = skip_providers_without_keys(cfg, {"OPENAI_API_KEY": "a", "GROQ_API_KEY": ""})
    assert [p.id for p in kept.providers] == ["openai", "local"]
    assert {r.provider for r in kept.routes} == {"openai", "local"}
    assert kept.canaries == []  # the example's canary is deepseek/deepseek-chat
    assert sorted(r.getMessage().split("variable ")[1].split()[0] for r in caplog.records) == [
        "ANTHROPIC_API_KEY", "DEEPSEEK_API_KEY", "GROQ_API_KEY"]
    parse_config(kept.model_dump(by_alias=False))  # still a valid config (references hold)


def test_no_route_left_is_an_error_naming_every_unset_variable() -> None:
    data = {
        "providers": [
            {"id": "a", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "A_KEY"},
            {"id": "b", "kind": "anthropic", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "B_KEY"},
        ],
        "routes": [{"model": "m1", "provider": "a"}, {"model": "m2", "provider": "b"}],
        "api_keys": [{"name": "k", "sha256": "0" * 64}],
    }
    cfg = parse_config(copy.deepcopy(data))
    with pytest.raises(GatewayConfigError, match=r"no route left: .*'A_KEY'.*'B_KEY'"):
        skip_providers_without_keys(cfg, {})
    assert [p.id for p in skip_providers_without_keys(cfg, {"B_KEY": "x"}).providers] == ["b"]
