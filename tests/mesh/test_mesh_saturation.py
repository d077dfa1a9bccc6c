"""Issue 42, a full mesh refuses before the first byte: real processes (one ``ethen worker`` serving every
layer with ``--max-sessions-per-caller 1``, an ``ethen gateway --config`` over that mesh). While one stream
holds the worker's only session, a second streaming chat is answered 503 ``mesh_saturated`` with
``Retry-After`` before any byte (the worker's ``RESOURCE_EXHAUSTED``, no other route) when the mesh is the
only candidate, or by the next candidate of the fallback chain (a scripted upstream on loopback) when there is
one; the first stream completes, and the worker is not backed off: the next request after it is served.
Before the fix the second request got 200, a role chunk, then ``upstream_stream_interrupted`` (the full
worker was declared failed).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tomli_w

from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from tests.gateway.upstream import Script, ServerThread, make_upstream_app
from tests.mesh.test_gateway_mesh_config import KEY, Gateway, _config, _free_port

AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = spawn_worker("solo", "0-29", extra_args=["--max-sessions-per-caller", "1"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-full")
    port = _free_port()
    cfg = tmp / "gateway.toml"
    cfg.write_text(tomli_w.dumps(_config({"solo": worker.address}, port)))
    gw = Gateway(cfg, port, tmp / "gateway.log")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def with_fallback(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose chain for the mesh's model has a second candidate: a scripted upstream."""
    tmp = tmp_path_factory.mktemp("gw-full-fallback")
    port = _free_port()
    with ServerThread(make_upstream_app(Script())) as upstream, pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALPHA_KEY", "sk-upstream-test")
        doc = _config({"solo": worker.address}, port)
        doc["providers"].append({"id": "alpha", "kind": "openai_compat", "base_url": f"{upstream.url}/v1",
                                 "api_key_env": "ALPHA_KEY"})
        doc["routes"].append({"model": MODEL, "provider": "alpha", "upstream_model": "up-smol",
                              "info": {"context_window": 8192, "max_output_tokens": 8192, "quality": 0.1},
                              "prices": {"input_per_mtok": 50.0, "output_per_mtok": 50.0}})
        cfg = tmp / "gateway.toml"
        cfg.write_text(tomli_w.dumps(doc))
        gw = Gateway(cfg, port, tmp / "gateway.log")
        yield gw
        gw.stop()


def _body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 200, one number per line."}]}


def _holding(gateway: Gateway) -> tuple[threading.Thread, dict[str, Any]]:
    """A stream that holds the worker's only session (started; returns once its first token arrived)."""
    first_token = threading.Event()
    first: dict[str, Any] = {"done": False, "error": None}

    def hold() -> None:  # the stream that holds the worker's only session
        with httpx.stream("POST", f"{gateway.base}/chat/completions", json=_body(120), headers=AUTH,
                          timeout=120) as r:
            first["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    first["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    first["error"] = first["error"] or event.get("error")
                    if event.get("choices") and event["choices"][0]["delta"].get("content"):
                        first_token.set()
        first_token.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert first_token.wait(60), gateway.log.read_text()[-3000:]
    return holder, first


def test_a_full_worker_refuses_the_next_stream_before_its_first_byte(gateway: Gateway) -> None:
    holder, first = _holding(gateway)
    with httpx.stream("POST", f"{gateway.base}/chat/completions", json=_body(16), headers=AUTH,
                      timeout=60) as r:
        status, retry_after, raw = r.status_code, r.headers.get("retry-after"), r.read()
    holder.join(120)
    log = gateway.log.read_text()
    assert status == 503, (status, raw[:500], log[-3000:])
    error = json.loads(raw)["error"]
    assert error["code"] == "mesh_saturated" and "'solo' is full" in error["message"], error
    assert retry_after is not None and int(retry_after) >= 1 and error["retry_after_s"] == int(retry_after)
    assert first == {"status": 200, "done": True, "error": None}, (first, log[-3000:])
    assert "backed off" not in log and "is dead" not in log, log[-3000:]
    r2 = httpx.post(f"{gateway.base}/chat/completions", headers=AUTH, timeout=60,
                    json={**_body(4), "stream": False})
    assert r2.status_code == 200, r2.text  # the worker was full, not failed: routed to at once


def test_a_full_mesh_falls_back_to_the_next_candidate_before_the_first_byte(with_fallback: Gateway) -> None:
    holder, first = _holding(with_fallback)
    with httpx.stream("POST", f"{with_fallback.base}/chat/completions", json=_body(16), headers=AUTH,
                      timeout=60) as r:
        status = r.status_code
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    holder.join(120)
    log = with_fallback.log.read_text()
    assert status == 200, log[-3000:]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices")) \
        == "Hello from upstream"
    routing = events[-1]["ethen"]["routing"]
    assert [(a["candidate"], a["outcome"], a.get("code")) for a in routing["attempts"]] == [
        (f"mesh/{MODEL}", "error", "mesh_saturated"), (f"alpha/{MODEL}", "ok", None)], routing
    assert first == {"status": 200, "done": True, "error": None}, (first, log[-3000:])
