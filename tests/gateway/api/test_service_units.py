"""Unit tests of the service's pieces: SSE parsing, telemetry store, config validation, auth, Anthropic
translation, payload stripping."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ethen.gateway.accounting.auth import KeyRing, hash_key
from ethen.gateway.api.execute import upstream_payload
from ethen.gateway.api.sse import SSEEvent, iter_events
from ethen.gateway.catalog import Catalog
from ethen.gateway.config import (
    ApiKeyConfig,
    build_canaries,
    build_pool,
    load_config,
    parse_config,
    resolve_secret,
)
from ethen.gateway.errors import AuthenticationError, GatewayConfigError
from ethen.gateway.observation.telemetry_store import AttemptRecord, TelemetryStore
from ethen.gateway.providers.anthropic import from_anthropic, to_anthropic
from tests.gateway.service_harness import config_dict

ROOT = Path(__file__).resolve().parents[3]


# --- SSE ---


async def _aiter(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def _parse(parts: list[bytes]) -> list[SSEEvent]:
    async def run() -> list[SSEEvent]:
        return [ev async for ev in iter_events(_aiter(parts))]

    return asyncio.run(run())


def test_sse_parser_handles_split_lines_crlf_multiline_and_comments() -> None:
    events = _parse(
        [b'data: {"a"', b": 1}\n", b"\n: comment\r\n", b"event: error\r", b"\ndata: x\ndata: y\r\n\r\n"]
    )
    assert events == [SSEEvent(None, b'{"a": 1}'), SSEEvent(b"error", b"x\ny")]


def test_sse_parser_drops_an_unterminated_trailing_event() -> None:
    assert _parse([b'data: one\n\ndata: {"half']) == [SSEEvent(None, b"one")]
    assert _parse([b"data: [DONE]\n\n"]) == [SSEEvent(None, b"[DONE]")]


# --- telemetry store ---


def rec(provider: str, model: str, at: float, ok: bool = True, latency: float = 100.0) -> AttemptRecord:
    return AttemptRecord(provider, model, at, latency, ok, ttft_ms=10.0 if ok else None)


def test_store_is_bounded_per_key_and_in_keys() -> None:
    s = TelemetryStore(max_outcomes=3, max_keys=2)
    for i in range(10):
        s.record(rec("p", "m", 100 + i))
    assert len(s.records("p", "m")) == 3 and s.records("p", "m")[0].at == 107
    s.record(rec("q", "m", 200))
    s.record(rec("r", "m", 201))  # evicts the least recently written key ("p", "m")
    assert s.records("p", "m") == () and len(s) == 2


def test_snapshot_counts_recent_outcomes_only_and_is_cached() -> None:
    s = TelemetryStore(window_seconds=60)
    s.record(rec("p", "m", 0.0, ok=False))
    s.record(rec("p", "m", 50.0, latency=100))
    s.record(rec("p", "m", 55.0, latency=300))
    snap = s.snapshot(now=59.0)
    st = snap.get("p", "m")
    assert (st.samples, st.successes, st.latency_ms_mean, st.ttft_ms_mean) == (3, 2, 200.0, 10.0)
    assert s.snapshot(now=59.5) is snap  # cached
    st2 = s.snapshot(now=61.0).get("p", "m")  # the failure at t=0 left the window
    assert (st2.samples, st2.successes) == (2, 2)
    s.record(rec("p", "m", 62.0, ok=False))
    assert s.snapshot(now=62.5).get("p", "m").samples == 3  # a new record invalidates the cache
    assert s.snapshot(now=1000.0).stats == {}


# --- config ---


def test_config_errors_name_the_key_and_the_value() -> None:
    base = config_dict("http://127.0.0.1:1")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"routes": [{**base["routes"][0], "provider": "opneai"}]}, "routes[0].provider = 'opneai'"),
        (
            {"canaries": [{"alias": "ethen/auto", "candidate": "alpha/alpha-large", "percent": 7}]},
            "canaries[0].percent = 7",
        ),
        (
            {"canaries": [{"alias": "ethen/nope", "candidate": "alpha/alpha-large", "percent": 5}]},
            "canaries[0].alias = 'ethen/nope'",
        ),
        (
            {"canaries": [{"alias": "ethen/auto", "candidate": "alpha/none", "percent": 5}]},
            "canaries[0].candidate = 'alpha/none'",
        ),
        (
            {"providers": [{**base["providers"][0], "timeouts": {"connect_s": -1}}]},
            "providers[0].timeouts.connect_s = -1",
        ),
        ({"providers": [{**base["providers"][0], "kind": "grpc"}]}, "providers[0].kind = 'grpc'"),
        ({"api_keys": [{"name": "k", "sha256": "plaintext-key"}]}, "api_keys[0].sha256 = 'plaintext-key'"),
        ({"server": {"port": "80"}}, "server.port = '80'"),
        ({"surprise": 1}, "surprise = 1"),
        ({"policy": {"allowed_providers": ["zeta"]}}, "policy.allowed_providers[0] = 'zeta'"),
    ]
    for override, expected in cases:
        with pytest.raises(GatewayConfigError) as ei:
            parse_config({**base, **override})
        assert expected in ei.value.message, (expected, ei.value.message)
    missing = {k: v for k, v in base.items() if k != "api_keys"}
    with pytest.raises(GatewayConfigError, match="api_keys: required key is missing"):
        parse_config(missing)


def test_route_without_catalog_entry_must_set_limits_and_prices() -> None:
    base = config_dict("http://127.0.0.1:1")
    route = {"model": "mystery", "provider": "alpha"}
    cfg = parse_config({**base, "routes": [*base["routes"], route]})
    with pytest.raises(GatewayConfigError, match=r"routes\[4\] \(alpha/mystery\)"):
        build_pool(cfg)


def test_secret_env_var_missing_is_named_without_a_value() -> None:
    cfg = parse_config(config_dict("http://127.0.0.1:1"))
    with pytest.raises(GatewayConfigError, match="api_key_env = 'ALPHA_KEY': variable is not set"):
        resolve_secret(cfg.providers[0], {})
    assert resolve_secret(cfg.providers[0], {"ALPHA_KEY": "sk-x"}) == "sk-x"


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "g.toml"
    bad.write_text("[server\nport = 1\n")
    with pytest.raises(GatewayConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(GatewayConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")


def test_example_config_is_valid() -> None:
    cfg = load_config(ROOT / "examples" / "gateway.toml")
    assert cfg.providers and cfg.routes and cfg.api_keys
    assert all(p.api_key_env is None or p.api_key_env.isupper() for p in cfg.providers)
    pool = build_pool(cfg, Catalog.load())  # every route resolves against the shipped catalog
    assert len(pool) == len(cfg.routes)
    assert KeyRing(cfg.api_keys).authenticate("Bearer ethen-dev-0123456789abcdef") == "dev"


# --- auth ---


def test_keyring_accepts_only_configured_ethen_keys() -> None:
    key = "ethen-abc123"
    ring = KeyRing([ApiKeyConfig(name="dev", sha256=hashlib.sha256(key.encode()).hexdigest())])
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert ring.authenticate(f"Bearer {key}") == "dev"
    assert ring.authenticate(f"bearer {key}") == "dev"
    for header in (None, "", key, f"Basic {key}", "Bearer ", "Bearer ethen-other", "Bearer sk-abc123"):
        with pytest.raises(AuthenticationError) as ei:
            ring.authenticate(header)
        assert ei.value.code == "invalid_api_key" and key not in ei.value.message


# --- Anthropic translation ---


def test_to_anthropic_translates_system_images_tools_and_tool_results() -> None:
    body = {
        "model": "x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": "required",
        "max_completion_tokens": 100,
        "stop": "END",
        "temperature": 0.2,
    }
    out = to_anthropic(body, "claude-x", stream=True)
    assert out["model"] == "claude-x" and out["system"] == "Be brief." and out["stream"] is True
    assert out["max_tokens"] == 100 and out["stop_sequences"] == ["END"] and out["temperature"] == 0.2
    assert out["tools"] == [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    assert out["tool_choice"] == {"type": "any"}
    roles = [m["role"] for m in out["messages"]]
    assert roles == ["user", "assistant", "user"]  # tool result + next user turn merged
    user0 = out["messages"][0]["content"]
    assert user0[1] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"},
    }
    assert user0[2] == {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    assert out["messages"][1]["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert out["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "c1", "content": "42"},
        {"type": "text", "text": "thanks"},
    ]


def test_from_anthropic_maps_tool_use_stop_reason_and_usage() -> None:
    msg = {
        "id": "msg_1",
        "type": "message",
        "model": "claude-x",
        "stop_reason": "tool_use",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        ],
        "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 3},
    }
    out = from_anthropic(msg, "claude-x")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert out["usage"] == {"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18,
                            "prompt_tokens_details": {"cached_tokens": 3}}  # cache reads: priced apart


def test_upstream_payload_strips_gateway_fields_only() -> None:
    body = {
        "model": "m",
        "messages": [],
        "metadata": {"routing": {"x": 1}},
        "providerOptions": {},
        "user": "u",
    }
    assert upstream_payload(body) == {"model": "m", "messages": [], "user": "u"}
    body2 = {"model": "m", "metadata": {"routing": {}, "k": "v"}}
    assert upstream_payload(body2) == {"model": "m", "metadata": {"k": "v"}}
    assert body["metadata"] == {"routing": {"x": 1}}  # the client's body is not mutated


def test_implausible_upstream_usage_counts_are_ignored() -> None:
    from ethen.gateway.providers.base import Usage

    assert Usage.from_openai({"prompt_tokens": 11, "completion_tokens": 3}) == Usage(11, 3)
    for bad in (10**400, -1, True, 2**53, 1.5, None):  # would overflow the cost arithmetic or make no sense
        assert Usage.from_openai({"prompt_tokens": bad, "completion_tokens": 3}) is None
        assert Usage.from_openai({"prompt_tokens": 3, "completion_tokens": bad}) is None
    assert from_anthropic({"id": "m", "type": "message", "role": "assistant", "content": [],
                           "stop_reason": "end_turn", "usage": {"input_tokens": 10**400, "output_tokens": 1}},
                          "m").get("usage") in (None, {})


def test_canary_accepts_the_specs_camel_case_names() -> None:
    base = config_dict("http://127.0.0.1:1")
    spec_style = {"alias": "ethen/auto", "candidate": "alpha/alpha-large", "percent": 5}
    camel = parse_config({**base, "canaries": [{**spec_style, "minSuccessRate": 0.8, "minSamples": 7}]})
    snake = parse_config({**base, "canaries": [{**spec_style, "min_success_rate": 0.8, "min_samples": 7}]})
    assert build_canaries(camel) == build_canaries(snake)
    assert build_canaries(camel)[0].min_samples == 7
    assert build_canaries(camel)[0].min_success_rate == 0.8
