"""The official ``openai`` SDK against a live gateway on 127.0.0.1 (scripted upstream behind it)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from ethen.gateway.api.app import PREFIX
from tests.gateway.service_harness import CLIENT_KEY, Live, live

USER = [{"role": "user", "content": "Summarize this transcript"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
IMAGE_MSG = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]


@pytest.fixture(scope="module")
def lv() -> Live:
    with live() as running:
        yield running  # type: ignore[misc]


def test_buffered_call_carries_receipt_in_model_extra(lv: Live) -> None:
    raw = lv.client().chat.completions.with_raw_response.create(model="ethen/auto", messages=USER)
    r = raw.parse()
    assert r.choices[0].message.content == "Hello from upstream"
    assert r.usage is not None and r.usage.total_tokens == 14
    routing = r.model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto"
    assert routing["routing_policy_version"] == "ethen.routing-policy.v1"
    assert routing["selected_provider"] == "beta" and routing["selected_model"] == "beta-small"
    assert routing["attempts"] == [
        {"candidate": "beta/beta-small", "outcome": "ok",
         "latency_ms": routing["attempts"][0]["latency_ms"]}
    ]
    for key in ("reason_codes", "candidate_count", "rejected_count", "score_components"):
        assert key in routing
    overhead = float(raw.headers["x-ethen-overhead-ms"])
    assert 0 <= overhead < 1000
    assert raw.headers["x-request-id"]


def test_streaming_call_has_receipt_on_terminal_chunk_and_usage(lv: Live) -> None:
    chunks = list(
        lv.client().chat.completions.create(
            model="ethen/auto", messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from upstream"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.prompt_tokens == 11 and last.usage.completion_tokens == 3
    routing = last.model_extra["ethen"]["routing"]
    assert routing["selected_model"] == "beta-small"
    assert routing["attempts"][0]["outcome"] == "ok"
    assert "overhead_ms" in routing
    # only the terminal chunk carries the receipt; no upstream usage-only chunk leaks through
    assert all("ethen" not in (c.model_extra or {}) for c in chunks[:-1])
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_stream_without_include_usage_has_no_usage(lv: Live) -> None:
    chunks = list(lv.client().chat.completions.create(model="ethen/fast", messages=USER, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].model_extra["ethen"]["routing"]["requested_model"] == "ethen/fast"
    # the receipt rides on the upstream's finish chunk: every chunk has a choice (naive clients index [0]),
    # the text is intact and finish_reason appears once, on the terminal chunk
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello from upstream"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    assert all("ethen" not in (c.model_extra or {}) for c in chunks[:-1])
    # the gateway asked the upstream for usage anyway (telemetry)
    assert lv.script.calls[-1]["body"]["stream_options"] == {"include_usage": True}


def test_tools_request_gets_tool_calls_from_a_tool_model(lv: Live) -> None:
    r = lv.client().chat.completions.create(
        model="ethen/auto", messages=USER, tools=TOOLS, tool_choice="auto"
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    routing = r.model_extra["ethen"]["routing"]
    assert "tools" in routing["hard_requirements"]
    assert "beta/beta-small" not in routing["chain"]
    assert lv.script.calls[-1]["body"]["tools"] == TOOLS


def test_tools_request_streaming(lv: Live) -> None:
    chunks = list(
        lv.client().chat.completions.create(model="ethen/coding", messages=USER, tools=TOOLS, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert chunks[-1].model_extra["ethen"]["routing"]["requested_model"] == "ethen/coding"


def test_image_parts_route_to_a_vision_model(lv: Live) -> None:
    r = lv.client().chat.completions.create(model="ethen/auto", messages=IMAGE_MSG)
    routing = r.model_extra["ethen"]["routing"]
    assert "vision" in routing["hard_requirements"]
    assert routing["selected_model"] != "beta-small"
    sent = lv.script.calls[-1]["body"]["messages"][0]["content"][1]
    assert sent["type"] == "image_url"


def test_concrete_model_goes_to_its_route(lv: Live) -> None:
    r = lv.client().chat.completions.create(model="alpha-large", messages=USER)
    assert r.model_extra["ethen"]["routing"]["selected_provider"] == "alpha"
    assert lv.script.calls[-1]["body"]["model"] == "up-alpha-large"


def test_gateway_only_fields_are_not_sent_upstream(lv: Live) -> None:
    lv.client().chat.completions.create(
        model="ethen/auto",
        messages=USER,
        metadata={"trace": "abc"},
        extra_body={
            "metadata": {"trace": "abc", "routing": {"budget_ceiling_usd": 1.0}},
            "providerOptions": {"gateway": {"only": ["beta"]}},
        },
    )
    sent = lv.script.calls[-1]["body"]
    assert sent["metadata"] == {"trace": "abc"} and "providerOptions" not in sent
    assert sent["model"].startswith("up-beta")


def test_models_lists_concrete_models_and_aliases(lv: Live) -> None:
    ids = [m.id for m in lv.client().models.list()]
    for mid in (
        "alpha-large",
        "beta-small",
        "beta-tools",
        "gamma-claude",
        "ethen/auto",
        "ethen/long-context",
    ):
        assert mid in ids
    assert len([i for i in ids if i.startswith("ethen/")]) == 8


# --- errors arrive as the SDK's exceptions, carrying our code ---


def test_bad_key_is_401_invalid_api_key(lv: Live) -> None:
    for key in ("ethen-wrong-key", "sk-not-ours"):
        with pytest.raises(openai.AuthenticationError) as ei:
            lv.client(key=key).chat.completions.create(model="ethen/auto", messages=USER)
        assert ei.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as ei2:
        lv.client(key="ethen-wrong").models.list()
    assert ei2.value.code == "invalid_api_key"
    r = httpx.post(f"{lv.base_url}/chat/completions", json={"model": "ethen/auto", "messages": USER})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_unknown_model_and_unknown_alias_are_model_not_found(lv: Live) -> None:
    for model in ("no-such-model", "ethen/nope"):
        with pytest.raises(openai.NotFoundError) as ei:
            lv.client().chat.completions.create(model=model, messages=USER)
        assert ei.value.code == "model_not_found" and ei.value.param == "model"


def test_no_candidate_is_422_with_rejection_reasons(lv: Live) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        lv.client().chat.completions.create(model="beta-small", messages=IMAGE_MSG)
    assert ei.value.code == "no_smart_route_candidate"
    body = ei.value.body
    assert isinstance(body, dict)
    assert body["rejections"][0]["candidate"] == "beta/beta-small"
    assert body["rejections"][0]["reasons"]


def test_invalid_field_is_400_naming_the_field(lv: Live) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        lv.client().chat.completions.create(
            model="ethen/auto",
            messages=USER,
            extra_body={"metadata": {"routing": {"budget_ceiling_usd": "x"}}},
        )
    assert ei.value.param == "metadata.routing.budget_ceiling_usd"
    with pytest.raises(openai.BadRequestError) as ei2:
        lv.client().chat.completions.create(model="ethen/auto", messages=USER, extra_body={"stream": "yes"})
    assert ei2.value.code == "invalid_type" and ei2.value.param == "stream"


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b'"text"',
        b"",
        b'{"model": 5, "messages": []}',
        b'{"model": "ethen/auto"}',
        b'{"model": "ethen/auto", "messages": "hi"}',
        b'{"model": "ethen/auto", "messages": [5]}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": 7}]}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "stream_options": 3}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "tools": "x"}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "metadata": []}',
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1'
        + b"0" * 400
        + b"}",
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], "metadata": {"routing": '
        b'{"budget_ceiling_usd": 1' + b"0" * 400 + b"}}}",
        b'{"model": "ethen/auto", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        b"\xff\xfe",
        b"[" * 100_000,
    ],
)
def test_client_mistakes_are_4xx_never_500(lv: Live, content: bytes) -> None:
    r = httpx.post(
        f"{lv.base_url}/chat/completions",
        content=content,
        headers={"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] and err["message"]


@pytest.mark.parametrize(
    ("field", "param"),
    [
        (b'"temperature": NaN', "temperature"),
        (b'"max_tokens": Infinity', "max_tokens"),
        (b'"top_p": 1e400', "top_p"),
        (b'"metadata": {"routing": {"budget_ceiling_usd": -Infinity}}',
         "metadata.routing.budget_ceiling_usd"),
        (b'"tools": [{"type": "function", "function": {"name": "f", "x": [1, NaN]}}]',
         "tools[0].function.x[1]"),
    ],
)
def test_nan_and_infinity_are_refused_naming_the_field(lv: Live, field: bytes, param: str) -> None:
    """Python's json reads them, JSON does not: never forwarded to an upstream as invalid JSON."""
    before = len(lv.script.calls)
    r = httpx.post(
        f"{lv.base_url}/chat/completions",
        content=b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "x"}], ' + field + b"}",
        headers={"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_value"
    assert len(lv.script.calls) == before


def test_explain_returns_decision_without_calling_providers(lv: Live) -> None:
    before = len(lv.script.calls)
    r = httpx.post(
        f"{lv.base_url}/routing/explain",
        json={"model": "ethen/coding", "messages": USER, "tools": TOOLS},
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
    )
    assert r.status_code == 200
    d = r.json()
    assert d["receipt"]["requested_model"] == "ethen/coding"
    assert [c["candidate"] for c in d["chain"]] == d["receipt"]["chain"]
    assert {rj["candidate"] for rj in d["rejected"]} == {"beta/beta-small"}
    assert len(lv.script.calls) == before
    # explain refuses what chat refuses: same 400, same param
    for bad in ({"stream": "yes"}, {"stream_options": {"include_usage": True}}):
        r = httpx.post(
            f"{lv.base_url}/routing/explain",
            json={"model": "ethen/auto", "messages": USER, **bad},
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] in {"stream", "stream_options"}, r.text
    r2 = httpx.post(f"{lv.base_url}/routing/explain", json={"model": "ethen/auto", "messages": USER})
    assert r2.status_code == 401


def test_healthz_metrics_and_unknown_paths(lv: Live) -> None:
    assert httpx.get(f"{lv.base_url}/healthz").json() == {"status": "ok"}
    lv.client().chat.completions.create(model="ethen/auto", messages=USER)
    text = httpx.get(f"{lv.base_url}/metrics").text
    for name in (
        "ethen_gateway_requests_total",
        "ethen_gateway_request_latency_seconds_bucket",
        "ethen_gateway_ttft_seconds",
        "ethen_gateway_fallbacks",
        "ethen_gateway_upstream_errors",
        "ethen_gateway_overhead_seconds_bucket",
    ):
        assert name in text
    assert 'ethen_gateway_requests_total{model="ethen/auto",status="200",stream="false"}' in text
    r = httpx.get(f"{lv.gateway.url}{PREFIX}/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{lv.base_url}/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_oversized_body_is_413(lv: Live) -> None:
    from ethen.gateway.api.app import MAX_BODY_BYTES

    head = b'{"model": "ethen/auto", "messages": [{"role": "user", "content": "'
    big = head + b"x" * MAX_BODY_BYTES + b'"}]}'
    r = httpx.post(
        f"{lv.base_url}/chat/completions",
        content=big,
        headers={"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no content-length: the limit is enforced while reading
        yield big[: MAX_BODY_BYTES // 2]
        yield big[MAX_BODY_BYTES // 2 :]

    r = httpx.post(
        f"{lv.base_url}/chat/completions",
        content=chunked(),
        headers={"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
