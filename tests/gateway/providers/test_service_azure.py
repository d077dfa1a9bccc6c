"""``kind = "azure_openai"`` over real HTTP (issue 26): deployment URLs with ``api-version``, the ``api-key``
header, Azure's content-filter refusal as a clear 400 ``content_filter``, through chat, Responses and Messages
inbound, streamed and not; the config's keys (``api_base`` / ``endpoint``, ``api_version``) and errors."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.service_harness import CLIENT_KEY, PROVIDER_KEY, ROUTES, Live
from tests.gateway.upstream_cloud import AZURE_VERSION, CLOUD_ROUTES, CloudBehavior, cloud_config, live_cloud

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lv() -> Live:
    with live_cloud({"up-az-deploy": CloudBehavior(answer_tool_results=True)}) as running:
        yield running  # type: ignore[misc]


def _sent(lv: Live) -> dict[str, Any]:
    call = lv.script.calls[-1]
    assert call["path"] == "azure" and call["query"] == {"api-version": AZURE_VERSION}
    assert call["headers"]["api-key"] == PROVIDER_KEY and "authorization" not in call["headers"]
    return call


def test_buffered_and_streamed_chat_reach_the_deployment(lv: Live) -> None:
    r = lv.client().chat.completions.create(model="az-gpt", messages=HI)
    assert r.choices[0].message.content == "Hello from upstream"
    assert r.model_extra["ethen"]["routing"]["served_provider"] == "az"
    assert _sent(lv)["body"]["model"] == "up-az-deploy"
    chunks = list(
        lv.client().chat.completions.create(
            model="az-gpt", messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from upstream"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 11
    assert _sent(lv)["body"]["stream"] is True


def test_tools_responses_and_messages_inbound(lv: Live) -> None:
    r = lv.client().chat.completions.create(
        model="az-gpt", messages=[{"role": "user", "content": "x?"}], tools=TOOLS
    )
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"x": 1})
    _sent(lv)
    resp = lv.client().responses.create(model="az-gpt", input="hi")
    assert resp.output_text == "Hello from upstream"
    _sent(lv)
    events = list(lv.client().responses.create(model="az-gpt", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    _sent(lv)
    client = anthropic.Anthropic(base_url=lv.gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15)
    msg = client.messages.create(model="az-gpt", max_tokens=50, messages=HI)
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello from upstream"
    _sent(lv)
    with client.messages.stream(model="az-gpt", max_tokens=50, messages=HI) as stream:
        assert stream.get_final_message().stop_reason == "end_turn"
    _sent(lv)


@pytest.mark.parametrize("stream", [False, True])
def test_content_filter_refusal_is_a_clear_400(stream: bool) -> None:
    with live_cloud({"up-az-deploy": CloudBehavior(content_filter=True)}) as lv:
        with pytest.raises(openai.BadRequestError) as ei:
            out = lv.client().chat.completions.create(model="az-gpt", messages=HI, stream=stream)
            if stream:
                list(out)  # type: ignore[arg-type]
        assert ei.value.status_code == 400 and ei.value.code == "content_filter"
        assert "Azure's content filter refused the prompt (filtered: violence)" in ei.value.message
        assert len(lv.script.calls) == 1  # request-caused: no other candidate is tried
        client = anthropic.Anthropic(base_url=lv.gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15)
        with pytest.raises(anthropic.BadRequestError) as ea:
            client.messages.create(model="az-gpt", max_tokens=50, messages=HI)
        assert "content filter" in str(ea.value)


def test_filtered_completion_keeps_finish_reason_content_filter() -> None:
    with live_cloud({"up-az-deploy": CloudBehavior(filter_completion=True)}) as lv:
        r = lv.client().chat.completions.create(model="az-gpt", messages=HI)
        assert r.choices[0].finish_reason == "content_filter"


def test_config_keys_and_errors() -> None:
    url = "http://127.0.0.1:9"
    cfg = parse_config(cloud_config(url))
    az = next(p for p in cfg.providers if p.id == "az")
    assert (az.kind, az.base_url, az.api_version) == ("azure_openai", url, AZURE_VERSION)
    data = cloud_config(url)
    data["providers"][-1] = {"id": "az", "kind": "azure_openai", "endpoint": url}
    with pytest.raises(GatewayConfigError, match="api_version is required for kind = 'azure_openai'"):
        parse_config(data)
    data["providers"][-1] = {"id": "az", "kind": "azure_openai", "endpoint": url, "api_version": "latest-ish"}
    with pytest.raises(GatewayConfigError, match=r"providers\[4\]\.api_version = 'latest-ish'"):
        parse_config(data)
    data["providers"][-1] = {"id": "az", "kind": "gemini", "base_url": url, "api_version": AZURE_VERSION}
    with pytest.raises(GatewayConfigError, match="api_version is for kind = 'azure_openai' only"):
        parse_config(data)


def test_embeddings_reach_the_deployment() -> None:
    route = {"model": "az-embed", "provider": "az", "upstream_model": "up-az-embed", "endpoint": "embeddings",
             "info": {"context_window": 8192}, "prices": {"input_per_mtok": 0.02}}  # fmt: skip
    with live_cloud(routes=[*ROUTES, *CLOUD_ROUTES, route]) as lv:
        r = lv.client().embeddings.create(model="az-embed", input=["abc", "hello"], encoding_format="float")
        assert [len(d.embedding) for d in r.data] == [3, 3]
        call = lv.script.calls[-1]
        assert call["path"] == "azure-embeddings" and call["query"] == {"api-version": AZURE_VERSION}
        assert call["body"]["model"] == "up-az-embed" and call["headers"]["api-key"] == PROVIDER_KEY
