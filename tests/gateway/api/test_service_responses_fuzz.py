"""No 5xx from ``POST /responses`` on any client body (issue 15): every ``CreateResponse`` field with every
wrong JSON type, and hostile input items, against a live gateway. A refused body makes no upstream call."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, Live, live

WRONG: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": None}, [[[]]], {"type": 5}]
FIELDS = [
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens",
    "temperature", "top_p", "user", "metadata", "stream", "store", "background", "previous_response_id",
    "reasoning", "include", "truncation", "providerOptions", "conversation", "prompt",
]
ITEM_KEYS = [
    "type", "role", "content", "call_id", "name", "arguments", "output", "image_url", "text", "detail",
    "namespace",
]
NAMESPACE: dict[str, Any] = {"type": "namespace", "name": "ns", "description": "d",
                             "tools": [{"type": "function", "name": "f"}]}  # Codex's tool groups (issue 26)
ITEM_BASES: list[dict[str, Any]] = [
    {"role": "user", "content": "x"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "y"},
]


@pytest.fixture(scope="module")
def lv() -> Live:
    with live() as running:
        yield running  # type: ignore[misc]


def _bodies() -> list[dict[str, Any]]:
    base = {"model": "ethen/auto", "input": "hi"}
    out = [{**base, f: w} for f, w in itertools.product(FIELDS, WRONG)]
    for item, key, w in itertools.product(ITEM_BASES, ITEM_KEYS, WRONG[:9]):
        out.append({**base, "input": [{**item, key: w}]})
        if "content" in item and isinstance(item["content"], list):
            out.append({**base, "input": [{**item, "content": [{**item["content"][0], key: w}]}]})
    out += [
        *({**base, "tools": [{"type": "function", "name": "f", key: w}]}
          for key in ("type", "parameters", "description", "strict", "name") for w in WRONG),
        *({**base, "tools": [{**NAMESPACE, key: w}]}
          for key in ("name", "description", "tools") for w in WRONG),
        *({**base, "tools": [{**NAMESPACE, "tools": [{"type": "function", "name": "f", key: w}]}]}
          for key in ("type", "name", "parameters", "description", "strict") for w in WRONG),
        *({**base, "tools": [NAMESPACE], "tool_choice": {"type": "function", "name": "f", "namespace": w}}
          for w in WRONG),
        {**base, "text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}},
        {**base, "text": {"format": {"type": "json_schema", "name": "n", "schema": "s"}}},
        {**base, "tool_choice": {"type": "function"}},
        {**base, "tool_choice": {"type": "mcp"}},
        {**base,
         "input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}]},
        {**base, "metadata": {"routing": {"budget_ceiling_usd": "cheap"}}},
        {**base, "input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}]},
    ]
    return out


def test_no_5xx_and_no_upstream_call_for_a_refused_body(lv: Live) -> None:
    bodies = _bodies()
    assert len(bodies) > 600
    statuses: dict[int, int] = {}
    with httpx.Client(headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=15) as client:
        for body in bodies:
            for stream in (False, True):
                before = len(lv.script.calls)
                r = client.post(f"{lv.base_url}/responses", json={**body, "stream": stream}
                                if "stream" not in body else body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (body, r.text)
                if r.status_code >= 400:
                    err = r.json()
                    assert not list(validator("ErrorResponse").iter_errors(err)), err
                    assert err["error"]["code"] and len(lv.script.calls) == before, (body, err)
    assert statuses.get(400, 0) > 300 and statuses.get(200, 0) > 50  # both kinds were exercised
