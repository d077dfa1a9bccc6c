"""Issue 42 item 6: a sampling value out of the API's range is the client's mistake, refused before routing
(400 ``invalid_value`` naming ``param``) on chat, completions, responses and the Messages API (Anthropic's
ranges there); an upstream 4xx the client's request caused never counts against the provider (telemetry,
circuits, the Candidates page, the attempt metric). Real HTTP: a scripted upstream and a live gateway on
127.0.0.1 (with a SQLite store, and with the memory ring)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.gateway.budget_harness import ADMIN_KEY, live_store
from tests.gateway.service_harness import CLIENT_KEY, Live, live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hello"}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}

#: (field, a value out of the OpenAI API's range, a value at its edge)
CHAT_FIELDS = [
    ("temperature", 50, 2), ("temperature", -0.1, 0), ("top_p", 1.5, 1), ("top_p", -1, 0.0),
    ("presence_penalty", 2.5, -2), ("frequency_penalty", -3, 2.0), ("top_logprobs", 21, 20),
    ("top_logprobs", -1, 0), ("seed", 2**63, -(2**63)),
]


def _chat(field: str, value: Any) -> tuple[str, dict[str, Any]]:
    return "/chat/completions", {"model": "beta-small", "messages": USER, field: value}


def _completions(field: str, value: Any) -> tuple[str, dict[str, Any]]:
    return "/completions", {"model": "beta-small", "prompt": "hi", field: value}


def _responses(field: str, value: Any) -> tuple[str, dict[str, Any]]:
    return "/responses", {"model": "beta-small", "input": "hi", field: value}


CASES = (
    [(_chat, f, bad, ok) for f, bad, ok in CHAT_FIELDS]
    + [(_chat, "logit_bias", {"42": 101}, {"42": -100}), (_chat, "logprobs", 1, True)]
    + [(_completions, f, bad, ok) for f, bad, ok in CHAT_FIELDS if f not in ("top_logprobs",)]
    + [(_completions, "logit_bias", {"7": -100.5}, {"7": 100})]
    + [(_responses, "temperature", 2.01, 2), (_responses, "top_p", 1.01, 1),
       (_responses, "top_logprobs", 21, 20), (_responses, "max_output_tokens", 0, 16)]
)


@pytest.fixture(scope="module")
def lv() -> Iterator[Live]:
    with live() as lv_:
        yield lv_


@pytest.mark.parametrize(("make", "field", "bad", "ok"), CASES,
                         ids=[f"{m.__name__[1:]}-{f}-{b}" for m, f, b, _ in CASES])
def test_out_of_range_is_refused_before_routing(lv: Live, make: Any, field: str, bad: Any, ok: Any) -> None:
    path, body = make(field, bad)
    before = len(lv.script.calls)
    r = httpx.post(f"{lv.base_url}{path}", json=body, headers=AUTH, timeout=15)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    param = field if not isinstance(bad, dict) else f"{field}.{next(iter(bad))}"
    assert (err["code"], err["param"]) == ("invalid_value" if field != "logprobs" else "invalid_type", param)
    assert field in err["message"]
    assert len(lv.script.calls) == before  # never reached the upstream
    path, body = make(field, ok)  # the edge of the range is served
    r = httpx.post(f"{lv.base_url}{path}", json=body, headers=AUTH, timeout=15)
    assert r.status_code == 200, r.text
    assert len(lv.script.calls) == before + 1


@pytest.mark.parametrize(("field", "bad", "ok"), [("temperature", 1.5, 1), ("top_p", 1.2, 1),
                                                  ("top_k", -1, 0), ("max_tokens", 0, 1)])
def test_the_messages_api_uses_anthropics_ranges(lv: Live, field: str, bad: Any, ok: Any) -> None:
    before = len(lv.script.calls)
    body = {"model": "beta-small", "max_tokens": 16, "messages": USER}
    r = httpx.post(f"{lv.gateway.url}/v1/messages", json={**body, field: bad}, timeout=15,
                   headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", field)
    assert len(lv.script.calls) == before
    r = httpx.post(f"{lv.gateway.url}/v1/messages", json={**body, field: ok}, timeout=15,
                   headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text


# --- an upstream 4xx the request caused is not the provider's failure -------------------------------------

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@contextmanager
def _gateway(kind: str, tmp: Any) -> Iterator[Live]:
    behaviors = {"up-beta-small": Behavior(fail_status=400)}
    if kind == "store":
        with live_store(f"sqlite:///{tmp / 'gw.db'}", behaviors) as lv_:
            yield lv_
    else:
        sha = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
        with live(behaviors, log={"admin_key_sha256": sha}) as lv_:
            yield lv_


@pytest.mark.parametrize("kind", ["store", "memory"])
def test_a_client_caused_upstream_4xx_never_counts_against_the_provider(kind: str, tmp_path: Any) -> None:
    with _gateway(kind, tmp_path) as lv:
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        body = {"model": "beta-small", "messages": USER}
        for i in range(5):  # more than the failing gate's 3 samples
            r = httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=15,
                           headers={**AUTH, "x-request-id": f"bad-{i}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "upstream_bad_request", r.text
        lv.script.behaviors.pop("up-beta-small")
        r = httpx.post(f"{lv.base_url}/chat/completions", json=body, headers={**AUTH, "x-request-id": "good"},
                       timeout=15)
        assert r.status_code == 200, r.text
        assert "beta/beta-small" not in gw.circuits.circuits  # no circuit opened
        stats = gw.store.snapshot().stats.get(("beta", "beta-small"))
        assert stats is not None and (stats.samples, stats.successes) == (1, 1)  # telemetry: the success only

        base = f"{lv.gateway.url}/api/admin/v1"
        deadline = time.monotonic() + 10
        while True:  # bounded: the request log's writer is asynchronous
            rows = httpx.get(f"{base}/requests", headers=ADMIN, timeout=10).json()["data"]
            if len(rows) >= 6:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        bad = next(x for x in rows if x["request_id"] == "bad-0")
        assert [a["outcome"] for a in bad["attempts"]] == ["client_error"]
        page = httpx.get(f"{base}/observe/providers?window_s=600&buckets=4", headers=ADMIN, timeout=10).json()
        cand = next(c for c in page["candidates"] if c["key"] == "beta/beta-small")
        assert (cand["attempts"], cand["successes"], cand["success_rate"]) == (1, 1, 1.0)
        prov = next(p for p in page["providers"] if p["key"] == "beta")
        assert prov["success_rate"] == 1.0
        metrics = httpx.get(f"{lv.base_url}/metrics", timeout=10).text
        attempts = 'ethen_gateway_attempts_total{model="beta-small",outcome="%s",provider="beta"}'
        assert attempts % "error" not in metrics
        assert f"{attempts % 'client_error'} 5.0" in metrics
