"""Set-up of the shadow-evaluation tests (issue 27): the scripted OpenAI-compatible upstream of
``tests/gateway/upstream.py`` on 127.0.0.1, and a live store-backed gateway (SQLite file) with
``[[shadows]]``.

Routes: ``alpha/alpha-large`` (the primary of every alias: best quality, fast, cheap) and two shadow
candidates ranked far below it (poor quality, slow priors, expensive): ``beta/beta-tools`` (tools, structured
output) and ``beta/beta-small`` (no tools). Upstream models: ``up-alpha-large``, ``up-beta-tools``,
``up-beta-small``."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ethen.app import PREFIX, create_app
from ethen.gateway.config import GatewayConfig, parse_config
from tests.gateway.budget_harness import ADMIN_KEY, store_cfg, with_store
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

__all__ = ["ADMIN_KEY", "CLIENT_KEY", "PRIMARY", "SMALL", "TOOLS", "ShadowLive", "shadow_live"]

CLIENT_KEY = "ethen-shadow-4f1c2a9b7e6d5c3b2a1f0e9d8c7b6a5f"
ENV = {"ALPHA_KEY": "sk-a", "BETA_KEY": "sk-b"}
PRIMARY, TOOLS, SMALL = "alpha/alpha-large", "beta/beta-tools", "beta/beta-small"
USER = [{"role": "user", "content": "hello there"}]


def _route(model: str, provider: str, *, good: bool, tools: bool) -> dict[str, Any]:
    return {
        "model": model,
        "provider": provider,
        "upstream_model": f"up-{model}",
        "info": {"context_window": 100_000, "max_output_tokens": 2_000, "supports_tools": tools,
                 "supports_structured_output": tools, "quality": 0.95 if good else 0.1,
                 "latency_ms": 100.0 if good else 30_000.0, "ttft_ms": 50.0 if good else 10_000.0},
        "prices": ({"input_per_mtok": 1.0, "output_per_mtok": 2.0} if good
                   else {"input_per_mtok": 20.0, "output_per_mtok": 40.0}),
    }


def config(url: str, shadows: list[dict[str, Any]], db: str, **overrides: Any) -> dict[str, Any]:
    timeouts = {"connect_s": 2.0, "first_byte_s": 10.0, "total_s": 20.0}
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": [{"id": p, "kind": "openai_compat", "base_url": f"{url}/v1", "api_key_env": env,
                       "timeouts": timeouts} for p, env in (("alpha", "ALPHA_KEY"), ("beta", "BETA_KEY"))],
        "routes": [_route("alpha-large", "alpha", good=True, tools=True),
                   _route("beta-tools", "beta", good=False, tools=True),
                   _route("beta-small", "beta", good=False, tools=False)],
        "api_keys": [{"name": "t", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}],
        "circuit": {"probe": False},
        "store": store_cfg(db),
        "shadows": shadows,
    }
    data.update(overrides)
    return data


def rule(candidate: str = TOOLS, **kw: Any) -> dict[str, Any]:
    return {"alias": "ethen/fast", "candidate": candidate, "percent": 100, "project": "shadow-evals", **kw}


@dataclass
class ShadowLive:
    script: Script
    gateway: ServerThread
    cfg: GatewayConfig
    db: str

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}{PREFIX}"

    @property
    def gw(self) -> Any:
        return self.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.gateway.url}/api/admin/v1",
                            headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)

    def project(self, name: str, **policy: Any) -> str:
        """Create a store project; returns a new key of it."""
        with self.admin() as a:
            r = a.post("/projects", json={"name": name, **policy})
            assert r.status_code == 201, r.text
            r = a.post(f"/projects/{name}/keys", json={"name": f"{name}-key"})
            assert r.status_code == 201, r.text
            key: str = r.json()["key"]
            return key

    def post(self, body: dict[str, Any], key: str = CLIENT_KEY, **headers: str) -> httpx.Response:
        return httpx.post(f"{self.base_url}/chat/completions", json=body,
                          headers={"authorization": f"Bearer {key}", **headers}, timeout=30)

    def metric(self, outcome: str) -> float:
        return float(self.gw.metrics.shadows.labels(outcome)._value.get())

    def wait_metric(self, outcome: str, value: float, timeout: float = 5.0) -> float:
        """The counter once it reached ``value`` (or at the timeout): shadows count from their own task."""
        deadline = time.monotonic() + timeout
        while self.metric(outcome) < value and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.metric(outcome)

    def shadows(self, **params: Any) -> dict[str, Any]:
        with self.admin() as a:
            r = a.get("/shadows", params=params)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

    def wait_pairs(self, n: int, timeout: float = 10.0, **params: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            pairs: list[dict[str, Any]] = self.shadows(**params)["pairs"]
            if len(pairs) >= n or time.monotonic() > deadline:
                return pairs
            time.sleep(0.05)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no shadow call runs."""
        deadline = time.monotonic() + timeout
        while self.gw.shadows.tasks and time.monotonic() < deadline:
            time.sleep(0.02)


@contextmanager
def shadow_live(tmp_path: Path, shadows: list[dict[str, Any]], behaviors: dict[str, Behavior] | None = None,
                *, shadow_budget: float | None = 10.0, db: str | None = None,
                **overrides: Any) -> Iterator[ShadowLive]:
    """A live gateway whose ``shadow-evals`` project exists (with ``shadow_budget`` USD a day); its store is
    ``db`` (default: a SQLite file in ``tmp_path``)."""
    script = Script(behaviors=dict(behaviors or {}))
    db = db or f"sqlite:///{tmp_path / 'gw.db'}"
    # the project exists before the gateway starts: a rule naming a missing one fails the start (issue 42)
    with_store(db, lambda st: st.create_project("shadow-evals", budget_usd=shadow_budget,
                                                budget_window="day"))
    with ServerThread(make_upstream_app(script)) as up:
        cfg = parse_config(config(up.url, shadows, db, **overrides))
        with ServerThread(create_app(cfg, env=ENV)) as gw:
            yield ShadowLive(script, gw, cfg, db)
