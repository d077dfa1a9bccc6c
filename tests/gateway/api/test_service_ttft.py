"""TTFT times the first chunk that carries content, not a role-only first chunk (issue 10, item 16).

The scripted upstream sends ``{"role": "assistant", "content": ""}`` at once, then each content piece after
``chunk_delay_s``: the gateway's ``ethen_gateway_ttft_seconds`` histogram and the telemetry record the
router's ``ttft_ms`` comes from must both show that delay, not the ~ms of the role chunk.
"""

from __future__ import annotations

import re

import httpx

from tests.gateway.service_harness import CLIENT_KEY, live
from tests.gateway.upstream import Behavior

DELAY_S = 0.3
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}


def _ttft_histogram(base_url: str) -> tuple[int, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    count = re.search(r"^ethen_gateway_ttft_seconds_count (\S+)$", text, re.M)
    total = re.search(r"^ethen_gateway_ttft_seconds_sum (\S+)$", text, re.M)
    assert count is not None and total is not None, text
    return int(float(count.group(1))), float(total.group(1))


def _stream(base_url: str, body: dict[str, object]) -> str:
    with httpx.stream("POST", f"{base_url}/chat/completions", headers=HEADERS, timeout=10,
                      json={"model": "beta-small", "stream": True, **body}) as r:
        assert r.status_code == 200
        return "".join(r.iter_text())


def test_ttft_times_the_first_content_not_the_role_chunk() -> None:
    with live({"up-beta-small": Behavior(chunk_delay_s=DELAY_S)}) as lv:
        text = _stream(lv.base_url, {"messages": [{"role": "user", "content": "hi"}]})
        assert "Hello" in text
        count, total = _ttft_histogram(lv.base_url)
        assert count == 1
        assert total >= DELAY_S, total  # was ~ms: the role-only chunk
        (rec,) = lv.store.records("beta", "beta-small")
        assert rec.ttft_ms is not None and rec.ttft_ms >= DELAY_S * 1000, rec


def test_a_tool_call_chunk_is_content() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with live({"up-beta-tools": Behavior(ttft_s=0.0, chunk_delay_s=DELAY_S)}) as lv:
        with httpx.stream("POST", f"{lv.base_url}/chat/completions", headers=HEADERS, timeout=10,
                          json={"model": "beta-tools", "stream": True, "tools": tools,
                                "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status_code == 200
            assert "tool_calls" in "".join(r.iter_text())
        count, total = _ttft_histogram(lv.base_url)
        assert count == 1
        assert total < DELAY_S  # the tool call follows the role chunk at once: it is the first content
        (rec,) = lv.store.records("beta", "beta-tools")
        assert rec.ttft_ms is not None and rec.ttft_ms < DELAY_S * 1000


def test_has_content_on_chunk_bytes() -> None:
    from ethen.gateway.api.execute import has_content

    def chunk(delta: str) -> bytes:
        return b'{"id":"c","choices":[{"index":0,"delta":' + delta.encode() + b',"finish_reason":null}]}'

    assert not has_content(chunk('{"role":"assistant","content":""}'))
    assert not has_content(chunk('{"role": "assistant", "content": null, "refusal": null}'))
    assert not has_content(chunk('{}'))
    assert not has_content(chunk('{"reasoning_content": ""}'))
    assert not has_content(chunk('{"tool_calls": []}'))
    assert has_content(chunk('{"content":"Hi"}'))
    assert has_content(chunk('{"content": "\\"quoted\\""}'))
    assert has_content(chunk('{"refusal": "No."}'))
    assert has_content(chunk('{"tool_calls": [{"index": 0, "id": "call_1"}]}'))
