"""``POST /responses`` with what Codex CLI sends by default (issue 26): ``namespace`` tool groups become
chat function tools with qualified names and the model's calls come back with ``name`` + ``namespace``
(buffered and streamed); hosted tools are dropped with a notice (receipt and ``x-ethen-dropped-tools``), or
refused with ``[compat] drop_unsupported_tools = false``; every streamed ``response`` object carries
``usage``."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.gateway.api.responses_tools import qualify
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, Live, config_dict, live
from tests.gateway.upstream import Behavior

NS_DESC = "Tools for spawning and managing sub-agents."
QUALIFIED = "multi_agent_v1__spawn_agent"
PARAMS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
# the shapes Codex 0.171 sends (captured from `codex exec`): functions, a namespace group, a hosted web_search
CODEX_TOOLS: list[Any] = [
    {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
     "parameters": PARAMS},
    {"type": "namespace", "name": "multi_agent_v1", "description": NS_DESC, "tools": [
         {"type": "function", "name": "spawn_agent", "description": "Spawn one", "strict": False,
          "parameters": PARAMS},
         {"type": "function", "name": "wait_agent", "description": "Wait", "strict": False,
          "parameters": PARAMS},
     ]},
    {"type": "web_search", "external_web_access": False},
]  # fmt: skip
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}


@pytest.fixture(scope="module")
def lv() -> Live:
    with live({"up-beta-tools": Behavior(tool_name=QUALIFIED, answer_tool_results=True)}) as running:
        yield running  # type: ignore[misc]


def _valid(name: str, obj: Any) -> None:
    errors = sorted(validator(name).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].path)}"


def _post(lv: Live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{lv.base_url}/responses", headers=HEADERS, json=body, timeout=15)


def test_namespace_tools_are_qualified_functions_and_calls_map_back_buffered(lv: Live) -> None:
    r = _post(lv, {"model": "beta-tools", "input": "spawn one", "tools": CODEX_TOOLS})
    assert r.status_code == 200, r.text
    sent = lv.script.calls[-1]["body"]
    assert [t["function"]["name"] for t in sent["tools"]] == ["exec_command", QUALIFIED,
                                                              "multi_agent_v1__wait_agent"]
    assert sent["tools"][1]["function"]["description"] == f"{NS_DESC}\n\nSpawn one"
    out = r.json()
    _valid("Response", out)
    (call,) = out["output"]
    assert call["type"] == "function_call"
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert out["tools"][1]["type"] == "namespace" and len(out["tools"]) == 2  # web_search left out
    assert r.headers["x-ethen-dropped-tools"] == "web_search"
    assert out["ethen"]["routing"]["dropped_tools"] == [{"param": "tools[2]", "type": "web_search"}]


def test_namespace_call_maps_back_streamed_and_every_response_carries_usage(lv: Live) -> None:
    body = {"model": "beta-tools", "input": "spawn one", "tools": CODEX_TOOLS, "stream": True}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{lv.base_url}/responses", headers=HEADERS, json=body, timeout=15) as r:
        assert r.status_code == 200 and r.headers["x-ethen-dropped-tools"] == "web_search"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    for ev in events:
        _valid("ResponseStreamEvent", ev)
    responses = [e["response"] for e in events if "response" in e]
    assert len(responses) == 3 and all("usage" in resp for resp in responses)  # llm-comply requires it
    assert responses[0]["usage"] is None and responses[-1]["usage"]["input_tokens"] == 11
    items = [e["item"] for e in events if e["type"].startswith("response.output_item.")]
    assert [(i["name"], i["namespace"]) for i in items] == [("spawn_agent", "multi_agent_v1")] * 2
    (call,) = responses[-1]["output"]
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert responses[-1]["ethen"]["routing"]["dropped_tools"][0]["type"] == "web_search"


def test_a_namespaced_call_in_the_history_goes_upstream_qualified(lv: Live) -> None:
    history: list[Any] = [
        {"role": "user", "content": "spawn one"},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
    ]
    r = _post(lv, {"model": "beta-tools", "input": history, "tools": CODEX_TOOLS,
                   "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}})
    assert r.status_code == 200, r.text
    sent = lv.script.calls[-1]["body"]
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == QUALIFIED
    assert sent["tool_choice"] == {"type": "function", "function": {"name": QUALIFIED}}
    assert r.json()["output"][0]["type"] == "message"  # the upstream answered the tool result


def _logged(lv: Live, rid: str) -> dict[str, Any]:
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows = [r for r in list(ring) if r["request_id"] == rid]
        if rows:
            return rows[0]
        time.sleep(0.02)
    raise AssertionError(f"{rid} not in the request log")


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_log_receipt_names_the_dropped_tools(lv: Live, stream: bool) -> None:
    rid = f"dropped-{stream}"
    r = httpx.post(f"{lv.base_url}/responses", headers={**HEADERS, "x-request-id": rid}, timeout=15,
                   json={"model": "beta-tools", "input": "spawn one", "tools": CODEX_TOOLS, "stream": stream})
    assert r.status_code == 200
    row = _logged(lv, rid)
    assert row["receipt"]["dropped_tools"] == [{"param": "tools[2]", "type": "web_search"}]


def test_a_request_without_hosted_tools_has_no_dropped_notice(lv: Live) -> None:
    r = _post(lv, {"model": "beta-tools", "input": "spawn one", "tools": CODEX_TOOLS[:2]})
    assert r.status_code == 200 and "x-ethen-dropped-tools" not in r.headers
    assert "dropped_tools" not in r.json()["ethen"]["routing"]


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "custom", "name": "apply_patch"}], "tools[0].type"),
        ([{"type": "namespace", "name": "n", "description": "d", "tools": [{"type": "custom", "name": "p"}]}],
         "tools[0].tools[0].type"),
        ([{"type": "namespace", "name": "n", "description": "d", "tools": []}], "tools[0].tools"),
        ([{"type": "namespace", "name": "", "description": "d", "tools": [CODEX_TOOLS[0]]}], "tools[0].name"),
        ([{"type": "function", "name": "n__f", "parameters": PARAMS},
          {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}]}],
         "tools[1].tools[0].name"),  # two tools, one chat name
    ],
)
def test_unsupported_or_bad_tools_are_400_naming_the_field(lv: Live, tools: list[Any], param: str) -> None:
    before = len(lv.script.calls)
    r = _post(lv, {"model": "beta-tools", "input": "hi", "tools": tools})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and len(lv.script.calls) == before


def test_compat_drop_unsupported_tools_false_refuses_hosted_tools() -> None:
    with live(compat={"drop_unsupported_tools": False}) as strict:
        r = _post(strict, {"model": "beta-tools", "input": "hi", "tools": CODEX_TOOLS})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("tools[2].type", "unsupported_value")
        assert "drop_unsupported_tools" in err["message"] and not strict.script.calls


def test_compat_config_errors_name_the_key_and_value() -> None:
    with pytest.raises(GatewayConfigError) as ei:
        parse_config(config_dict("http://127.0.0.1:1", compat={"drop_unsupported_tools": "no"}))
    assert "compat.drop_unsupported_tools" in str(ei.value) and "'no'" in str(ei.value)
    with pytest.raises(GatewayConfigError) as ei:
        parse_config(config_dict("http://127.0.0.1:1", compat={"drop_tools": True}))
    assert "compat.drop_tools" in str(ei.value)


_NAME = st.text(st.sampled_from("abcxyz_-0189ABZ"), min_size=1, max_size=70)


@given(_NAME, _NAME, _NAME, _NAME)
def test_qualified_names_are_chat_names_and_distinct(ns1: str, n1: str, ns2: str, n2: str) -> None:
    q1, q2 = qualify(ns1, n1), qualify(ns2, n2)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", q1), q1  # chat's pattern (a long name ends in a hex digest)
    assert qualify(ns1, n1) == q1  # deterministic: the history's calls qualify the same way
    if (ns1, n1) != (ns2, n2) and f"{ns1}__{n1}" != f"{ns2}__{n2}":
        assert q1 != q2


def test_plain_functions_keep_their_names_as_before(lv: Live) -> None:
    """Only a namespaced name is checked for clashes (two plain functions of one name go upstream as sent)."""
    plain = {"type": "function", "name": "f__g", "parameters": PARAMS}
    r = _post(lv, {"model": "beta-tools", "input": "hi", "tools": [plain, plain]})
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in lv.script.calls[-1]["body"]["tools"]] == ["f__g", "f__g"]
