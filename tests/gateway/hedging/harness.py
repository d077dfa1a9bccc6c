"""Set-up of the hedging tests: a scripted OpenAI-compatible upstream that records, per call, whether the
gateway closed the connection before the answer was complete, and a live gateway with ``[[hedges]]``.

Three routes (``hx``/``hy``/``hz`` on providers alpha/beta/gamma, upstream models ``up-hx``...) with the same
capabilities; the test reads the chain's order from ``/routing/explain`` and scripts the slow and fast
candidates by their position (:meth:`HedgeLive.script_chain`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ethen.app import PREFIX, create_app
from ethen.gateway.config import GatewayConfig, parse_config
from tests.gateway.upstream import ServerThread

__all__ = ["CLIENT_KEY", "HedgeLive", "Slow", "Upstream", "hedge_live"]

CLIENT_KEY = "ethen-hedge-4f1c2a9b7e6d5c3b2a1f0e9d8c7b6a5f"
ENV = {"HX_KEY": "sk-x", "HY_KEY": "sk-y", "HZ_KEY": "sk-z"}
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
USER = [{"role": "user", "content": "hello there"}]
PRICES = {"input_per_mtok": 2.0, "output_per_mtok": 10.0}


@dataclass
class Slow:
    """How the upstream answers one model: ``delay_s`` before the answer (buffered) or before the first
    content chunk (stream; the role-only chunk comes at once), or ``status`` at once."""

    delay_s: float = 0.0
    status: int | None = None
    prompt_tokens: int = 7
    pieces: tuple[str, ...] = ("Hello", " from", " upstream")


@dataclass
class Upstream:
    behaviors: dict[str, Slow] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # upstream model of each call, in order
    closed: list[str] = field(default_factory=list)  # models whose connection the gateway closed early

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            model = str(body["model"])
            self.calls.append(model)
            b = self.behaviors.get(model, Slow())
            if b.status is not None:
                err = {"error": {"message": f"scripted {b.status}", "type": "invalid_request_error"}}
                return JSONResponse(err, status_code=b.status)
            usage = {"prompt_tokens": b.prompt_tokens, "completion_tokens": len(b.pieces),
                     "total_tokens": b.prompt_tokens + len(b.pieces)}
            base = {"id": "chatcmpl-h", "created": int(time.time()), "model": model}
            if not body.get("stream"):
                deadline = time.monotonic() + b.delay_s
                while time.monotonic() < deadline:  # a slow upstream that notices its client leaving
                    if await request.is_disconnected():
                        self.closed.append(model)
                        return Response(status_code=499)
                    await asyncio.sleep(0.01)
                msg = {"role": "assistant", "content": "".join(b.pieces)}
                return JSONResponse({**base, "object": "chat.completion", "usage": usage,
                                     "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})

            def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
                obj = {**base, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
                return b"data: " + json.dumps(obj).encode() + b"\n\n"

            async def gen() -> AsyncIterator[bytes]:
                done = False
                try:
                    yield chunk({"role": "assistant", "content": ""})
                    await asyncio.sleep(b.delay_s)
                    for piece in b.pieces:
                        yield chunk({"content": piece})
                    yield chunk({}, "stop")
                    if (body.get("stream_options") or {}).get("include_usage"):
                        last = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                        yield b"data: " + json.dumps(last).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    done = True
                finally:
                    if not done:
                        self.closed.append(model)

            return StreamingResponse(gen(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    def wait_closed(self, model: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if model in self.closed:
                return True
            time.sleep(0.02)
        return False


def _route(name: str, provider: str) -> dict[str, Any]:
    return {
        "model": name,
        "provider": provider,
        "upstream_model": f"up-{name}",
        "info": {"context_window": 100_000, "max_output_tokens": 1_000, "supports_tools": True,
                 "quality": 0.8, "latency_ms": 500.0, "ttft_ms": 200.0},
        "prices": dict(PRICES),
    }


def config(url: str, hedges: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    timeouts = {"connect_s": 2.0, "first_byte_s": 10.0, "total_s": 20.0}
    providers = [
        {"id": p, "kind": "openai_compat", "base_url": f"{url}/v1", "api_key_env": env, "timeouts": timeouts}
        for p, env in (("alpha", "HX_KEY"), ("beta", "HY_KEY"), ("gamma", "HZ_KEY"))
    ]
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": providers,
        "routes": [_route("hx", "alpha"), _route("hy", "beta"), _route("hz", "gamma")],
        "api_keys": [{"name": "t", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}],
        "circuit": {"probe": False},
        "hedges": hedges,
    }
    data.update(overrides)
    return data


@dataclass
class HedgeLive:
    up: Upstream
    gateway: ServerThread
    cfg: GatewayConfig

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}{PREFIX}"

    @property
    def gw(self) -> Any:
        return self.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]

    def explain(self, body: dict[str, Any], key: str = CLIENT_KEY) -> dict[str, Any]:
        auth = {"authorization": f"Bearer {key}"}
        r = httpx.post(f"{self.base_url}/routing/explain", json=body, headers=auth)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def chain(self, model: str = "ethen/fast", key: str = CLIENT_KEY) -> list[str]:
        """The decision's chain (upstream model names, ranked) for a plain request to ``model``."""
        chain = self.explain({"model": model, "messages": USER}, key)["receipt"]["chain"]
        return ["up-" + c.split("/", 1)[1] for c in chain]

    def script_chain(self, *behaviors: Slow, model: str = "ethen/fast", key: str = CLIENT_KEY) -> list[str]:
        """Give the chain's candidates these behaviours, in chain order; returns the chain."""
        chain = self.chain(model, key)
        for up, b in zip(chain, behaviors, strict=False):
            self.up.behaviors[up] = b
        return chain

    def post(self, body: dict[str, Any], key: str = CLIENT_KEY, **headers: str) -> httpx.Response:
        return httpx.post(f"{self.base_url}/chat/completions", json=body,
                          headers={"authorization": f"Bearer {key}", **headers}, timeout=30)

    def metric(self, outcome: str) -> float:
        return float(self.gw.metrics.hedges.labels(outcome)._value.get())


@contextmanager
def hedge_live(hedges: list[dict[str, Any]], **overrides: Any) -> Iterator[HedgeLive]:
    up = Upstream()
    with ServerThread(up.app()) as upstream:
        cfg = parse_config(config(upstream.url, hedges, **overrides))
        with ServerThread(create_app(cfg, env=ENV)) as gw:
            yield HedgeLive(up, gw, cfg)
