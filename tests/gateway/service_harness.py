"""Shared set-up for the gateway service tests: a scripted upstream and a live gateway, both real uvicorn
servers on 127.0.0.1, and a config whose routes carry their own limits and prices (no catalog: hermetic)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai

from ethen.app import PREFIX, create_app
from ethen.gateway.config import GatewayConfig, parse_config
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

CLIENT_KEY = "ethen-test-4f1c2a9b7e6d5c3b2a1f0e9d8c7b6a5f"
PROVIDER_KEY = "sk-upstream-SECRET-a1b2c3d4e5f6a7b8c9d0"
ENV = {"ALPHA_KEY": PROVIDER_KEY, "BETA_KEY": PROVIDER_KEY, "GAMMA_KEY": PROVIDER_KEY}

# (provider, model, upstream model, info overrides, prices)
ROUTES: list[dict[str, Any]] = [
    {
        "model": "alpha-large",
        "provider": "alpha",
        "upstream_model": "up-alpha-large",
        "info": {
            "context_window": 200_000,
            "max_output_tokens": 16_000,
            "supports_tools": True,
            "supports_vision": True,
            "supports_structured_output": True,
            "quality": 0.9,
            "latency_ms": 800.0,
            "ttft_ms": 300.0,
        },
        "prices": {"input_per_mtok": 3.0, "output_per_mtok": 15.0},
    },
    {
        "model": "beta-tools",
        "provider": "beta",
        "upstream_model": "up-beta-tools",
        "info": {
            "context_window": 128_000,
            "max_output_tokens": 8_000,
            "supports_tools": True,
            "supports_vision": True,
            "supports_structured_output": True,
            "quality": 0.7,
            "latency_ms": 600.0,
            "ttft_ms": 250.0,
        },
        "prices": {"input_per_mtok": 0.5, "output_per_mtok": 1.5},
    },
    {
        "model": "beta-small",
        "provider": "beta",
        "upstream_model": "up-beta-small",
        "info": {
            "context_window": 32_000,
            "max_output_tokens": 4_000,
            "supports_tools": False,
            "supports_vision": False,
            "quality": 0.4,
            "latency_ms": 300.0,
            "ttft_ms": 100.0,
        },
        "prices": {"input_per_mtok": 0.05, "output_per_mtok": 0.1},
    },
    {
        "model": "gamma-claude",
        "provider": "gamma",
        "upstream_model": "up-gamma-claude",
        "info": {
            "context_window": 200_000,
            "max_output_tokens": 8_000,
            "supports_tools": True,
            "supports_vision": True,
            "quality": 0.6,
            "latency_ms": 900.0,
            "ttft_ms": 400.0,
        },
        "prices": {"input_per_mtok": 0.8, "output_per_mtok": 4.0},
    },
]


def config_dict(upstream_url: str, **overrides: Any) -> dict[str, Any]:
    timeouts = overrides.pop("timeouts", {"connect_s": 2.0, "first_byte_s": 2.0, "total_s": 5.0})
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": [
            {
                "id": "alpha",
                "kind": "openai_compat",
                "base_url": f"{upstream_url}/v1",
                "api_key_env": "ALPHA_KEY",
                "timeouts": timeouts,
            },
            {
                "id": "beta",
                "kind": "openai_compat",
                "base_url": f"{upstream_url}/v1",
                "api_key_env": "BETA_KEY",
                "timeouts": timeouts,
            },
            {
                "id": "gamma",
                "kind": "anthropic",
                "base_url": f"{upstream_url}/v1",
                "api_key_env": "GAMMA_KEY",
                "timeouts": timeouts,
            },
        ],
        "routes": [dict(r) for r in ROUTES],
        "api_keys": [{"name": "test", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}],
    }
    data.update(overrides)
    return data


@dataclass
class Live:
    script: Script
    upstream: ServerThread
    gateway: ServerThread
    cfg: GatewayConfig

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}{PREFIX}"

    def client(self, key: str = CLIENT_KEY, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url, api_key=key, max_retries=0, timeout=kw.pop("timeout", 15), **kw
        )

    @property
    def store(self) -> Any:
        return self.gateway.server.config.app.state.gateway.store  # type: ignore[attr-defined]


@contextmanager
def live(behaviors: dict[str, Behavior] | None = None, **cfg_overrides: Any) -> Iterator[Live]:
    script = Script(behaviors=dict(behaviors or {}))
    with ServerThread(make_upstream_app(script)) as up:
        cfg = parse_config(config_dict(up.url, **cfg_overrides))
        app = create_app(cfg, env=ENV)
        with ServerThread(app) as gw:
            yield Live(script, up, gw, cfg)
