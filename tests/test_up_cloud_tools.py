"""``ethen up --config examples/cloud-tools.toml`` (issue 42 item 12): the overlay the README points
tool-using clients at. It merges into ``ethen up``'s generated config with ``ethen up``'s own code
(:func:`ethen.up_config.gateway_document`, written and loaded as ``ethen up`` does, keys from the
environment), and with a scripted upstream standing in for Anthropic and OpenAI, what Claude Code and Codex
send reaches a tool-capable long-context route: a tool request to ``ethen/auto``, and a Messages request for
Claude Code's own model name (``[model_map]``) with a long system prompt and ``max_tokens`` 32,000. Without
the overlay the same tool request is refused (only the mesh's SmolLM2 is configured: no tools)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ethen.app import PREFIX, create_app
from ethen.gateway.accounting.auth import hash_key
from ethen.gateway.catalog import Catalog
from ethen.gateway.config import load_config, skip_providers_without_keys
from ethen.up_config import gateway_document, write_config
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "examples" / "cloud-tools.toml"
KEY = "ethen-test-cloud-tools-0123456789abcdef"
WORKERS = {"gpu": "127.0.0.1:9", "mini": "127.0.0.1:9", "laptop": "127.0.0.1:9"}  # nothing listens: unused
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
ENV_KEYS = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Script, ServerThread]]:
    script = Script(default=Behavior(tool_name="get_weather", tool_args='{"city": "Paris"}'))
    with ServerThread(make_upstream_app(script)) as up:
        yield script, up


def _overlay(upstream_url: str) -> dict[str, Any]:
    """The shipped overlay, its providers pointed at the scripted upstream (nothing else changed)."""
    user = tomllib.loads(OVERLAY.read_text(encoding="utf-8"))
    for p in user["providers"]:
        p["base_url"] = f"{upstream_url}/v1"
    return user


def _gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: dict[str, Any] | None,
             keys: dict[str, str]) -> ServerThread:
    """What ``ethen up`` does with ``--config``: merge, write, load, skip keyless providers, serve."""
    monkeypatch.setenv("ETHEN_DATA_DIR", str(tmp_path))
    for var in ENV_KEYS:
        monkeypatch.delenv(var, raising=False)
    for var, value in keys.items():
        monkeypatch.setenv(var, value)
    admin = hash_key("ethen-admin-" + "x" * 24)
    doc = gateway_document("127.0.0.1", 0, KEY, WORKERS, user, admin_key_sha256=admin)
    doc["providers"][0]["start_timeout_s"] = 0.5  # no worker listens: do not wait ethen up's 60 s for them
    cfg = skip_providers_without_keys(load_config(write_config(doc, tmp_path / "up-gateway.toml")))
    return ServerThread(create_app(cfg, catalog=Catalog.load()))


def test_the_overlay_merges_into_ethen_ups_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_DATA_DIR", str(tmp_path))
    user = tomllib.loads(OVERLAY.read_text(encoding="utf-8"))
    doc = gateway_document("127.0.0.1", 8080, KEY, WORKERS, user, admin_key_sha256="0" * 64)
    cfg = load_config(write_config(doc, tmp_path / "up-gateway.toml"))
    assert [p.id for p in cfg.providers] == ["mesh", "anthropic", "openai"]
    assert cfg.routes[0].provider == "mesh"  # the mesh's route first, the overlay's appended
    assert {r.model for r in cfg.routes} >= {"claude-sonnet-4-6", "gpt-4.1"}
    assert dict(cfg.model_map) == {"claude-*haiku*": "ethen/cheap", "claude-*": "ethen/coding"}
    assert cfg.store is not None  # ethen up's embedded store stays


def test_ethen_up_takes_the_other_sections_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the README lists: sections besides the four appended lists are used as written, [server] not."""
    monkeypatch.setenv("ETHEN_DATA_DIR", str(tmp_path))
    user = {**tomllib.loads(OVERLAY.read_text(encoding="utf-8")), "server": {"port": 1},
            "cache": {"enabled": True}, "hedges": [{"alias": "ethen/fast", "after_ms": 400}],
            "policy": {"allowed_providers": ["mesh", "anthropic"]},
            "compat": {"drop_unsupported_tools": False}}
    doc = gateway_document("127.0.0.1", 8080, KEY, WORKERS, user, admin_key_sha256="0" * 64)
    assert doc["server"] == {"host": "127.0.0.1", "port": 8080}
    for section in ("cache", "hedges", "policy", "compat", "model_map"):
        assert doc[section] == user[section], section
    load_config(write_config(doc, tmp_path / "up-gateway.toml"))  # valid


@pytest.mark.parametrize("keys", [{"ANTHROPIC_API_KEY": "sk-ant-test", "OPENAI_API_KEY": "sk-test"},
                                  {"ANTHROPIC_API_KEY": "sk-ant-test"}, {"OPENAI_API_KEY": "sk-test"}],
                         ids=["both", "anthropic", "openai"])
def test_tool_requests_reach_a_cloud_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstream: tuple[Script, ServerThread],
    keys: dict[str, str],
) -> None:
    script, up = upstream
    providers = {"ANTHROPIC_API_KEY": "anthropic", "OPENAI_API_KEY": "openai"}
    allowed = {providers[k] for k in keys}
    with _gateway(tmp_path, monkeypatch, _overlay(up.url), keys) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}{PREFIX}", api_key=KEY, max_retries=0, timeout=30)
        r = client.chat.completions.create(model="ethen/auto", tools=TOOLS,  # type: ignore[arg-type]
                                           messages=[{"role": "user", "content": "Weather in Paris?"}])
        routing = r.model_extra["ethen"]["routing"]  # type: ignore[index]
        assert routing["selected_provider"] in allowed, routing
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"

        # Claude Code: its model name and tools, a system prompt past the mesh's context, max_tokens 32,000
        n = len(script.calls)
        write = {"name": "Write", "description": "Write a file",
                 "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}
        body = {"model": "claude-sonnet-4-6", "max_tokens": 32000, "tools": [write],
                "system": "You are a coding agent. " * 4000,  # ~20k tokens: past the mesh's 8k context
                "messages": [{"role": "user", "content": "Write hello.txt"}]}  # fmt: skip
        m = httpx.post(f"{gw.url}/v1/messages", json=body, timeout=30,
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
        assert m.status_code == 200, m.text
        receipt = m.json()["ethen"]["routing"]
        assert receipt["selected_provider"] in allowed, receipt
        if "anthropic" in allowed:  # a route of the overlay under that very name
            assert receipt["selected_model"] == "claude-sonnet-4-6"
        else:  # its route skipped (no key): [model_map] sends it to an alias
            assert receipt["model_map"] == {"requested": "claude-sonnet-4-6", "routed_as": "ethen/coding"}
        assert len(script.calls) == n + 1  # the upstream answered it


def test_without_the_overlay_a_tool_request_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What the README's Clients section warns about: a plain ``ethen up`` has no tool-capable route."""
    with _gateway(tmp_path, monkeypatch, None, {}) as gw:
        body = {"model": "ethen/auto", "tools": TOOLS, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{gw.url}{PREFIX}/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["code"], r.text
