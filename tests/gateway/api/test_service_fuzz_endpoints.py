"""Non-string and unhashable values in every field of ``/responses``, ``/completions``, ``/embeddings``,
``/messages`` and ``/messages/count_tokens`` (issue 42 item 9; ``/chat/completions`` has its own in
``test_service_fuzz.py``), against one live gateway: a rich, valid body per endpoint, then every field (top
level and nested: tool types, content part types, roles, ``tool_choice``, metadata...) replaced by each of
:data:`WRONG` (``[]``, ``{}`` and the rest: a value compared to a string or used as a dict key / set member
must be checked first), buffered and streamed. No 5xx, a refused body never reaches the upstream, and its
error names a ``code``.

Before the fix, ``{"tools": [{"type": {}}]}`` on ``/responses`` was a 500 (``TypeError: unhashable type``:
the tool type was looked up in a frozenset before its type was checked).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.api.test_service_embeddings import EMBED_ROUTES
from tests.gateway.api.test_service_fuzz import _dropped, _paths, _replaced
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, Live, live
from tests.gateway.upstream import Behavior

#: wrong JSON types; the unhashable ones ([], {}, nested) first
WRONG: list[Any] = [[], {}, [[]], {"a": []}, ["x"], {"type": "x"}, None, True, 0, 1.5, "", "x"]
NAMESPACE: dict[str, Any] = {"type": "namespace", "name": "ns", "description": "d",
                             "tools": [{"type": "function", "name": "g", "parameters": {"type": "object"}}]}
ROUTING = {"budget_ceiling_usd": 1.0, "latency_target": "fast", "certification_level": "any"}

RESPONSES: dict[str, Any] = {
    "model": "ethen/auto",
    "instructions": "be brief",
    "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "what is this"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "low"},
        ]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "function_call", "call_id": "c2", "name": "g", "namespace": "ns", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]},
    ],
    "tools": [
        {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
         "strict": False},
        NAMESPACE,
        {"type": "web_search"},
    ],
    "tool_choice": {"type": "function", "name": "f"},
    "parallel_tool_calls": True,
    "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    "max_output_tokens": 20,
    "temperature": 0.5,
    "top_p": 1,
    "truncation": "disabled",
    "store": False,
    "user": "u1",
    "metadata": {"routing": ROUTING, "team": "x"},
    "providerOptions": {"gateway": {"only": ["alpha", "beta", "gamma"]}},
}
COMPLETIONS: dict[str, Any] = {
    "model": "ethen/auto",
    "prompt": ["say hi"],
    "max_tokens": 20,
    "temperature": 0.5,
    "top_p": 1,
    "n": 1,
    "stop": ["\n"],
    "echo": False,
    "seed": 1,
    "user": "u1",
    "metadata": {"routing": ROUTING, "team": "x"},
    "providerOptions": {"gateway": {"only": ["alpha", "beta", "gamma"]}},
}
EMBEDDINGS: dict[str, Any] = {
    "model": "embed-small", "input": ["abc", "hello world"], "encoding_format": "float", "user": "u1",
    "metadata": {"routing": ROUTING},
}
MESSAGES: dict[str, Any] = {
    "model": "ethen/auto",
    "max_tokens": 20,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
        ]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": 1}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
            {"type": "text", "text": "and now?"},
        ]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"},
    "temperature": 0.5,
    "top_p": 1,
    "top_k": 5,
    "stop_sequences": ["zz"],
    "metadata": {"user_id": "u1"},
}
#: (path, the good body, whether it is sent streamed too)
ENDPOINTS: list[tuple[str, dict[str, Any], bool]] = [
    ("/responses", RESPONSES, True),
    ("/completions", COMPLETIONS, True),
    ("/embeddings", EMBEDDINGS, False),
    ("/messages", MESSAGES, True),
    ("/messages/count_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, False),
]


@pytest.fixture(scope="module")
def lv() -> Iterator[Live]:
    # tool_call=False: the scripted upstream would index a malformed tool; a real one answers 400 instead
    with live(routes=[*ROUTES, *EMBED_ROUTES]) as running:
        running.script.default = Behavior(tool_call=False)
        yield running


def _send(lv: Live, client: httpx.Client, path: str, body: Any, what: object) -> httpx.Response:
    before = len(lv.script.calls)
    raw = json.dumps(body).encode()
    r = client.post(f"{lv.base_url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, f"{r.status_code} on {path} for {what!r} {raw[:300]!r}: {r.text[:300]}"
    if r.status_code >= 400:
        assert len(lv.script.calls) == before, f"refused body reached the upstream: {path} {what!r}"
        err = r.json()["error"]
        assert err["type"] and (err.get("code") or path.startswith("/messages")), (path, what, r.text)
    return r


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30) as c:
        yield c


@pytest.mark.parametrize(("path", "good", "streams"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_the_good_bodies_are_served(lv: Live, client: httpx.Client, path: str, good: dict[str, Any],
                                    streams: bool) -> None:
    for stream in (False, True) if streams else (None,):
        body = good if stream is None else {**good, "stream": stream}
        r = _send(lv, client, path, body, "good")
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "good", "streams"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_every_field_with_every_wrong_type(lv: Live, client: httpx.Client, path: str, good: dict[str, Any],
                                           streams: bool) -> None:
    paths = list(_paths(good))
    assert len(paths) > 10
    statuses: dict[int, int] = {}
    for where in paths:
        variants = [(_replaced(good, where, w), where) for w in WRONG]
        variants.append((_dropped(good, where), ("without", where)))
        for body, what in variants:
            for stream in (False, True) if streams else (None,):  # buffered and streamed
                sent = body if stream is None else {**body, "stream": stream}
                r = _send(lv, client, path, sent, (what, stream))
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(400, 0) > 20, statuses  # the refusals were exercised


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", [{}, [], [[]], {"a": 1}, 5, None, True])
def test_a_responses_tool_type_that_is_no_string_is_a_400_naming_it(lv: Live, client: httpx.Client,
                                                                   kind: Any, stream: bool) -> None:
    body = {"model": "m", "input": "hi", "tools": [{"type": kind}], "stream": stream}
    r = _send(lv, client, "/responses", body, kind)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_type", "tools[0].type"), err
