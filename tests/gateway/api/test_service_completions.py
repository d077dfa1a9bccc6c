"""``POST /completions`` (legacy text completions, issue 15) with the official ``openai`` SDK against a live
gateway and the scripted upstream: buffered and streamed answers through the chat path (the prompt is one
user message), ``/v1/completions``, every refusal; bodies and chunks validated against the OpenAPI
description's ``CreateCompletionResponse``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior


@pytest.fixture(scope="module")
def lv() -> Live:
    with live() as running:
        yield running  # type: ignore[misc]


def _valid(name: str, obj: Any) -> None:
    errors = sorted(validator(name).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].path)}"


def _valid_chunk(chunk: dict[str, Any]) -> None:
    """A stream chunk: the schema describes the finished object, so an intermediate chunk's ``finish_reason``
    must be ``null`` (as OpenAI sends it) and the rest must validate."""
    choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
    _valid("CreateCompletionResponse", {**chunk, "choices": choices})


def _raw_chunks(lv: Live, body: dict[str, Any], base: str | None = None) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base or lv.base_url}/completions", json={**body, "stream": True},
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=15) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    done = lines[-1] == "data: [DONE]"  # a stream that broke ends with its error event instead
    for line in lines[:-1] if done else lines:
        chunk = json.loads(line[6:])
        if "error" not in chunk:
            _valid_chunk(chunk)
        chunks.append(chunk)
    assert done == ("error" not in chunks[-1])
    return chunks


def test_buffered_completion_is_a_valid_text_completion_with_the_receipt(lv: Live) -> None:
    raw = lv.client().completions.with_raw_response.create(
        model="ethen/auto", prompt="Say hello", max_tokens=20, temperature=0.2, stop=["\n\n"])
    c = raw.parse()
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.choices[0].text == "Hello from upstream" and c.choices[0].finish_reason == "stop"
    assert c.usage is not None and (c.usage.prompt_tokens, c.usage.completion_tokens) == (11, 3)
    routing = c.model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto" and routing["attempts"][0]["outcome"] == "ok"
    assert c.model == f"up-{routing['selected_model']}"
    assert float(raw.headers["x-ethen-overhead-ms"]) >= 0 and raw.headers["x-request-id"]
    _valid("CreateCompletionResponse", raw.http_response.json())
    sent = lv.script.calls[-1]["body"]  # the chat body the upstream got: the prompt is one user message
    assert sent["messages"] == [{"role": "user", "content": "Say hello"}]
    assert (sent["max_tokens"], sent["temperature"], sent["stop"]) == (20, 0.2, ["\n\n"])
    assert "prompt" not in sent


def test_prompt_list_of_one_string_and_the_legacy_default_max_tokens(lv: Live) -> None:
    c = lv.client().completions.create(model="beta-small", prompt=["Once upon a time"])
    assert c.choices[0].text == "Hello from upstream"
    sent = lv.script.calls[-1]["body"]
    assert sent["model"] == "up-beta-small" and sent["max_tokens"] == 16
    assert sent["messages"] == [{"role": "user", "content": "Once upon a time"}]


def test_streamed_completion_chunks_and_the_receipt_on_the_last(lv: Live) -> None:
    chunks = list(lv.client().completions.create(model="ethen/auto", prompt="hi", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "Hello from upstream"
    assert all(ch.object == "text_completion" for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks] == [None, None, None, "stop"]
    routing = chunks[-1].model_extra["ethen"]["routing"]
    assert routing["requested_model"] == "ethen/auto" and "overhead_ms" in routing
    raw = _raw_chunks(lv, {"model": "ethen/auto", "prompt": "hi"})
    assert [ch["choices"][0]["text"] for ch in raw] == ["Hello", " from", " upstream", ""]
    assert "ethen" in raw[-1] and all("ethen" not in ch for ch in raw[:-1])
    assert len({ch["id"] for ch in raw}) == 1 and raw[0]["id"].startswith("cmpl-")


def test_streamed_with_include_usage_ends_with_a_usage_chunk(lv: Live) -> None:
    raw = _raw_chunks(lv, {"model": "beta-small", "prompt": "hi", "stream_options": {"include_usage": True}})
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["completion_tokens"] == 3
    assert raw[-1]["ethen"]["routing"]["selected_model"] == "beta-small"
    assert raw[-2]["choices"][0]["finish_reason"] == "stop"


def test_v1_base_url_serves_completions(lv: Live) -> None:
    client = openai.OpenAI(base_url=f"{lv.gateway.url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=15)
    assert client.completions.create(model="ethen/auto", prompt="hi").choices[0].text == "Hello from upstream"
    raw = _raw_chunks(lv, {"model": "ethen/auto", "prompt": "hi"}, f"{lv.gateway.url}/v1")
    assert raw[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_cut_after_first_chunk_ends_with_an_error_event() -> None:
    with live({"up-beta-small": Behavior(cut_after=1)}) as lv:
        raw = _raw_chunks(lv, {"model": "beta-small", "prompt": "hi"})
    assert raw[0]["choices"][0]["text"] == "Hello"
    assert raw[-1]["error"]["code"] and raw[-1]["ethen"]["routing"]["selected_model"] == "beta-small"


# --- refusals --------------------------------------------------------------------------------------------


def test_bad_key_is_401_and_no_candidate_is_422(lv: Live) -> None:
    with pytest.raises(openai.AuthenticationError) as ei:
        lv.client(key="ethen-wrong-key").completions.create(model="ethen/auto", prompt="hi")
    assert ei.value.code == "invalid_api_key"
    with pytest.raises(openai.UnprocessableEntityError) as e422:  # beyond beta-small's max output
        lv.client().completions.create(model="beta-small", prompt="hi", max_tokens=10_000, stream=True)
    assert e422.value.code == "no_smart_route_candidate"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"prompt": [1212, 318, 257]}, "prompt", "unsupported_parameter"),
        ({"prompt": [[1212, 318]]}, "prompt", "unsupported_parameter"),
        ({"prompt": ["one", "two"]}, "prompt", "unsupported_parameter"),
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        ({"echo": True}, "echo", "unsupported_parameter"),
        ({"suffix": " the end"}, "suffix", "unsupported_parameter"),
        ({"logprobs": 2}, "logprobs", "unsupported_parameter"),
        ({"prompt": None}, "prompt", "missing_required_parameter"),
        ({"prompt": 5}, "prompt", "invalid_type"),
        ({"prompt": []}, "prompt", "invalid_type"),
        ({"echo": "yes"}, "echo", "invalid_type"),
        ({"best_of": "many"}, "best_of", "invalid_type"),
        ({"max_tokens": "ten"}, "max_tokens", "invalid_type"),
        ({"stream": "yes"}, "stream", "invalid_type"),
    ],
)
def test_unsupported_or_invalid_fields_are_400_naming_the_field(
    lv: Live, extra: dict[str, Any], param: str, code: str
) -> None:
    before = len(lv.script.calls)
    r = httpx.post(f"{lv.base_url}/completions", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                   json={"model": "ethen/auto", "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    _valid("ErrorResponse", r.json())
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    assert len(lv.script.calls) == before


def test_sdk_refusal_and_accepted_defaults(lv: Live) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        lv.client().completions.create(model="ethen/auto", prompt="hi", n=3)
    assert (ei.value.code, ei.value.param) == ("unsupported_parameter", "n")
    c = lv.client().completions.create(model="ethen/auto", prompt="hi", n=1, best_of=1, echo=False,
                                       suffix=None, logprobs=None)
    assert c.choices[0].text == "Hello from upstream"
