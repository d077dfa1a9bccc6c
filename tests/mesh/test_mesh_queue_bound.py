"""Issue 44 item 3 through real processes: one ``ethen worker`` serving every layer and an ``ethen gateway
--config`` whose mesh provider sets ``max_queue = 1`` (and ``admission_timeout_s = 60``). Four streaming
chats with a long prompt (its prefill takes a while on CPU) start together: one is admitted, and the others,
arriving while it waits for its first token, are refused at once (well under ``admission_timeout_s``): 503
``mesh_saturated`` with ``Retry-After`` when the mesh is the only candidate, or served by the next candidate
of the fallback chain (a scripted upstream on loopback) when there is one. No stream breaks. Today's code
has no bound: the others wait their turn on the worker (and the key is refused by the config)."""

from __future__ import annotations

import json
import threading
import time
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
ADMISSION_S = 60.0
N = 4


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = spawn_worker("solo", "0-29")
    yield w
    w.stop()


def _gateway(worker: WorkerProcess, tmp: Any, upstream_url: str | None) -> Gateway:
    port = _free_port()
    doc = _config({"solo": worker.address}, port, max_queue=1, admission_timeout_s=ADMISSION_S)
    if upstream_url is not None:
        doc["providers"].append({"id": "alpha", "kind": "openai_compat", "base_url": f"{upstream_url}/v1",
                                 "api_key_env": "ALPHA_KEY"})
        doc["routes"].append({"model": MODEL, "provider": "alpha", "upstream_model": "up-smol",
                              "info": {"context_window": 8192, "max_output_tokens": 8192, "quality": 0.1},
                              "prices": {"input_per_mtok": 50.0, "output_per_mtok": 50.0}})
    cfg = tmp / "gateway.toml"
    cfg.write_text(tomli_w.dumps(doc))
    return Gateway(cfg, port, tmp / "gateway.log")


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = _gateway(worker, tmp_path_factory.mktemp("gw-queue"), None)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def with_fallback(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with ServerThread(make_upstream_app(Script())) as upstream, pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALPHA_KEY", "sk-upstream-test")
        gw = _gateway(worker, tmp_path_factory.mktemp("gw-queue-fallback"), upstream.url)
        yield gw
        gw.stop()


def _body(i: int) -> dict[str, Any]:
    long = " ".join(f"item{i}-{k}" for k in range(400))  # ~2k prompt tokens: a prefill that takes a while
    return {"model": MODEL, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Repeat the last item of this list: {long}"}]}


def _burst(gw: Gateway) -> list[dict[str, Any]]:
    """N streams released together; per stream: status, Retry-After, seconds to the response head, the
    events (or the error body), whether [DONE] came."""
    results: list[dict[str, Any]] = [{} for _ in range(N)]
    go = threading.Barrier(N)

    def one(i: int) -> None:
        go.wait()
        t0 = time.monotonic()
        with httpx.stream("POST", f"{gw.base}/chat/completions", json=_body(i), headers=AUTH,
                          timeout=180) as r:
            res = results[i]
            res.update(status=r.status_code, retry_after=r.headers.get("retry-after"),
                       head_s=time.monotonic() - t0, done=False, events=[])
            if r.status_code != 200:
                res["error"] = json.loads(r.read())["error"]
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    res["done"] = True
                elif line.startswith("data: "):
                    res["events"].append(json.loads(line[6:]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    return results


def test_a_full_queue_refuses_at_once_with_503_and_retry_after(gateway: Gateway) -> None:
    results = _burst(gateway)
    log = gateway.log.read_text()[-3000:]
    served = [r for r in results if r.get("status") == 200]
    refused = [r for r in results if r.get("status") == 503]
    assert len(served) + len(refused) == N, (results, log)
    assert served and all(r["done"] and not any(e.get("error") for e in r["events"]) for r in served), \
        (served, log)  # no stream dropped
    assert refused, (results, log)  # the burst found the queue full
    for r in refused:
        assert r["error"]["code"] == "mesh_saturated" and "max_queue = 1" in r["error"]["message"], r
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1, r
        assert r["head_s"] < 5.0 < ADMISSION_S, r  # at once, not after waiting for a worker slot


def test_a_full_queue_sends_the_request_to_the_fallback_at_once(with_fallback: Gateway) -> None:
    results = _burst(with_fallback)
    log = with_fallback.log.read_text()[-3000:]
    assert all(r.get("status") == 200 and r["done"] for r in results), (results, log)
    spilled = []
    for r in results:
        attempts = [(a["candidate"], a["outcome"], a.get("code"))
                    for a in r["events"][-1]["ethen"]["routing"]["attempts"]]
        if attempts == [(f"mesh/{MODEL}", "error", "mesh_saturated"), (f"alpha/{MODEL}", "ok", None)]:
            spilled.append(r)
            text = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in r["events"] if c.get("choices"))
            assert text == "Hello from upstream", r
            assert r["head_s"] < 5.0, r  # refused by the mesh at once, then served by the upstream
        else:
            assert attempts == [(f"mesh/{MODEL}", "ok", None)], (attempts, log)
    assert spilled and len(spilled) < N, (results, log)
