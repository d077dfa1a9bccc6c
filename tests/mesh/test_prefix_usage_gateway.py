"""The mesh reports its reused prefix as cached tokens (issue 45 items 3-4), through a live gateway with a
mesh provider over real worker processes on 127.0.0.1: the first request with a long system prompt reports
no cache read; once the workers hold its prefix, the next requests sharing it report the positions they took
from the workers' prefix caches as ``prompt_tokens_details.cached_tokens`` (chat),
``cache_read_input_tokens`` (Messages) and ``input_tokens_details.cached_tokens`` (Responses), the same number
as the receipt's ``prefix_reused_tokens``, and the request log counts them as cache reads (saving nothing:
the mesh's price)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, Live, config_dict, live

MODEL = "smollm2-135m-instruct"
SHARED = ("You are a careful assistant for a shipping company. " * 40).strip()
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for node, layers in {"a": "0-14", "b": "15-29"}.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


def _chat(lv: Live, question: str, rid: str) -> dict[str, Any]:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 3,
            "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]}
    deadline = time.monotonic() + 60
    while True:  # bounded: the orchestrator's first Health polls before the mesh can route
        r = httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=120,
                       headers={**HEADERS, "x-request-id": rid})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _wait_held(lv: Live) -> None:
    orch = lv.gateway.server.config.app.state.gateway.providers["mesh"].orchestrator  # type: ignore[attr-defined]
    deadline = time.monotonic() + 15
    while not all(h.names for h in orch.monitor.prefix_holdings().values()) or \
            len(orch.monitor.prefix_holdings()) < 2:
        assert time.monotonic() < deadline, "the workers never reported the prefix"
        time.sleep(0.05)


def _row(lv: Live, rid: str) -> dict[str, Any]:
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while (row := next((r for r in list(ring) if r["request_id"] == rid), None)) is None:
        assert time.monotonic() < deadline, f"{rid} was never logged"
        time.sleep(0.05)
    return row


def test_a_reused_prefix_is_reported_as_cached_tokens(workers: dict[str, WorkerProcess]) -> None:
    mesh = {"id": "mesh", "kind": "mesh", "workers": {n: w.address for n, w in workers.items()},
            "health_interval_s": 0.1}
    providers = [*config_dict("http://127.0.0.1:1")["providers"], mesh]
    with live(providers=providers, routes=[*ROUTES, {"model": MODEL, "provider": "mesh"}]) as lv:
        first = _chat(lv, "Where is my parcel?", "mesh-cache-1")
        assert first["ethen"]["routing"]["mesh"]["prefix_reused_tokens"] == 0
        assert "prompt_tokens_details" not in first["usage"]
        _wait_held(lv)

        second = _chat(lv, "How do I return a damaged box?", "mesh-cache-2")
        reused = second["ethen"]["routing"]["mesh"]["prefix_reused_tokens"]
        assert 256 <= reused < second["usage"]["prompt_tokens"] and reused % 64 == 0
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": reused}
        row = _row(lv, "mesh-cache-2")
        assert (row["cache_read_tokens"], row["cache_write_tokens"], row["saved_nano"]) == (reused, 0, 0)
        assert _row(lv, "mesh-cache-1")["cache_read_tokens"] == 0
        metrics = httpx.get(f"{lv.base_url}/metrics", timeout=5).text
        counter = 'ethen_gateway_prompt_cache_tokens_total{kind="read",provider="mesh"}'
        assert f"{counter} {float(reused)}" in metrics  # counted by the log's writer, before the ring

        _wait_held(lv)  # streamed: the usage chunk carries the reads too
        body = {"model": MODEL, "temperature": 0, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": "Hello?"}]}
        with httpx.stream("POST", f"{lv.base_url}/chat/completions", json=body, headers=HEADERS,
                          timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        (usage,) = [c["usage"] for c in chunks if c.get("usage")]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 256

        _wait_held(lv)
        r = httpx.post(f"{lv.gateway.url}/v1/messages", headers={"x-api-key": CLIENT_KEY}, timeout=120,
                       json={"model": MODEL, "max_tokens": 3, "temperature": 0, "system": SHARED,
                             "messages": [{"role": "user", "content": "Can I change the address?"}]})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["cache_read_input_tokens"] >= 256 and usage["cache_creation_input_tokens"] == 0

        r = httpx.post(f"{lv.base_url}/responses", headers=HEADERS, timeout=120,
                       json={"model": MODEL, "max_output_tokens": 3, "temperature": 0, "instructions": SHARED,
                             "input": "Do you ship abroad?"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 256
