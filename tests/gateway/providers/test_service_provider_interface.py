"""The Provider interface with a non-HTTP, in-process provider (the shape the mesh provider takes): its
``receipt_extra`` lands under ``ethen.routing``; plus client disconnects mid-stream."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import httpx

from ethen.app import PREFIX, create_app
from ethen.gateway.api.sse import dumps
from ethen.gateway.config import parse_config
from ethen.gateway.providers.base import Completion, Provider, ProviderStream, UpstreamCall, Usage
from tests.gateway.service_harness import CLIENT_KEY, live
from tests.gateway.upstream import Behavior, ServerThread

AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
ROUTE = {"mesh-stage": 0, "node": "w1", "layers": "0-29", "cost": 0.5}


def chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return dumps(
        {
            "id": "chatcmpl-mesh",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "smollm",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


class _Stream(ProviderStream):
    def __init__(self) -> None:
        self._items = [chunk("Hi"), chunk(" there"), chunk(None, "stop")]
        self.usage = None
        self.completed = False
        self.receipt_extra = {}

    async def __anext__(self) -> bytes:
        if not self._items:
            self.completed = True
            self.usage = Usage(4, 2)
            self.receipt_extra = {"mesh": {"stages": [ROUTE]}}
            raise StopAsyncIteration
        return self._items.pop(0)

    async def aclose(self) -> None:
        self._items = []


class InProcess(Provider):
    def __init__(self) -> None:
        self.name = "mesh"
        self.calls: list[UpstreamCall] = []

    async def complete(self, call: UpstreamCall) -> Completion:
        self.calls.append(call)
        body: dict[str, Any] = {
            "id": "chatcmpl-mesh",
            "object": "chat.completion",
            "created": 1,
            "model": call.upstream_model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hi there", "refusal": None},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        }
        return Completion(body, Usage(4, 2), {"mesh": {"stages": [ROUTE]}})

    async def stream(self, call: UpstreamCall) -> ProviderStream:
        self.calls.append(call)
        return _Stream()


def test_in_process_provider_and_receipt_extra() -> None:
    cfg = parse_config(
        {
            "providers": [{"id": "mesh", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/unused"}],
            "routes": [
                {
                    "model": "smollm",
                    "provider": "mesh",
                    "upstream_model": "smollm2-135m",
                    "info": {"context_window": 8192, "max_output_tokens": 2048},
                    "prices": {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
                }
            ],
            "api_keys": [{"name": "t", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}],
        }
    )
    provider = InProcess()
    with ServerThread(create_app(cfg, providers={"mesh": provider})) as gw:
        base = f"{gw.url}{PREFIX}"
        r = httpx.post(
            f"{base}/chat/completions",
            json={"model": "ethen/cheap", "messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
        )
        routing = r.json()["ethen"]["routing"]
        assert routing["mesh"] == {"stages": [ROUTE]} and routing["served_provider"] == "mesh"
        assert provider.calls[-1].upstream_model == "smollm2-135m"
        body = {
            "model": "smollm",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{base}/chat/completions", json=body, headers=AUTH) as s:
            data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        terminal = json.loads(data[-2])
        assert terminal["ethen"]["routing"]["mesh"] == {"stages": [ROUTE]}
        assert terminal["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_client_disconnect_mid_stream_is_recorded_as_incomplete_not_as_a_failure() -> None:
    with live({"up-beta-small": Behavior(chunk_delay_s=0.3, pieces=("a", "b", "c", "d", "e"))}) as lv:
        body = {"model": "ethen/auto", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{lv.base_url}/chat/completions", json=body, headers=AUTH) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    break  # first chunk received, then hang up
        deadline = time.monotonic() + 5
        while not lv.store.records("beta", "beta-small") and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = lv.store.records("beta", "beta-small")[-1]
        assert rec.success and rec.stream and rec.stream_completed is False
        metrics = httpx.get(f"{lv.base_url}/metrics").text
        assert 'status="client_closed"' in metrics


def test_a_provider_without_embeddings_refuses_them_with_a_gateway_error() -> None:
    """The base ``embed`` is the refusal of a provider that offers none: an error of the gateway's one tree
    (``gateway_config_error``), not a ``NotImplementedError`` escaping as a 500 of unknown kind."""
    import asyncio

    import pytest

    from ethen.gateway.errors import GatewayConfigError

    p = InProcess()
    assert p.supports_embeddings is False
    with pytest.raises(GatewayConfigError, match="offers no embeddings"):
        asyncio.run(p.embed(UpstreamCall({"input": "x"}, "m", "rid-1")))
