"""Issue 44 with a real mesh: one ``ethen worker`` process serving every layer, the real gateway on loopback
(in process, so the test reads its capacity snapshot) with the mesh provider and a scripted cloud upstream.
Idle, ``ethen/cheap`` goes to the mesh (free); while long prompts queue on the mesh, its predicted wait (from
the orchestrator's load book: queued prefill tokens, sessions decoding, measured step and prefill cost)
exceeds the ``[[wait_targets]]`` and the next request spills to the cloud, with ``spillover`` on the receipt;
once the queue drained, the mesh serves again. The dashboard's Mesh tab data (``/api/admin/v1/observe/mesh``)
shows the queue over time and the share spilled."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ethen.app import PREFIX, create_app
from ethen.gateway.config import parse_config
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

MODEL = "smollm2-135m-instruct"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
TARGET_MS = 1000.0
ADMIN_KEY = "ethen-admin-spillover-0123456789abcdef"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = spawn_worker("solo", "0-29")
    yield w
    w.stop()


def _chat(base: str, model: str, content: str, max_tokens: int = 2) -> dict[str, Any]:
    r = httpx.post(f"{base}/chat/completions", headers=AUTH, timeout=120, json={
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["ethen"]["routing"]  # type: ignore[no-any-return]


def test_a_loaded_mesh_spills_to_the_cloud_and_takes_the_traffic_back(worker: WorkerProcess) -> None:
    mesh = {"id": "mesh", "kind": "mesh", "workers": {"solo": worker.address}, "start_timeout_s": 60,
            "health_interval_s": 0.2}
    routes = [{"model": MODEL, "provider": "mesh"},
              {"model": "cloud-smol", "provider": "alpha", "upstream_model": "up-smol",
               "info": {"context_window": 8192, "max_output_tokens": 4096, "quality": 0.1,
                        "latency_ms": 600.0, "ttft_ms": 300.0},
               "prices": {"input_per_mtok": 5.0, "output_per_mtok": 5.0}}]
    with ServerThread(make_upstream_app(Script())) as up:
        doc = config_dict(up.url, routes=routes,
                          wait_targets=[{"alias": "ethen/cheap", "max_wait_ms": TARGET_MS}],
                          log={"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()})
        doc["providers"] = [doc["providers"][0], mesh]  # alpha (the scripted cloud) and the mesh
        with ServerThread(create_app(parse_config(doc), env=ENV)) as server:
            _scenario(f"{server.url}{PREFIX}", server.server.config.app.state.gateway)  # type: ignore
            view = httpx.get(f"{server.url}/api/admin/v1/observe/mesh?prompt_tokens=64", timeout=10,
                             headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["data"][0]["load"]
            assert view["spilled"] == 1.0 and view["started"] == 5  # 1 idle + 3 long + 1 after the drain
            assert view["spilled_share"] == pytest.approx(1 / 6)
            assert max(s["queued_tokens"] for s in view["history"]) > 0
            assert max(s["queue_ms"] for s in view["history"]) > TARGET_MS
            assert (view["prefilling"], view["decoding"], view["queued_tokens"]) == (0, 0, 0)
            assert view["predicted_wait_ms"] > 0
            # per chain (the one worker's): its own queue now and over time, and its reported session cap
            assert view["chain"] == ["solo"] and [c["nodes"] for c in view["chains"]] == [["solo"]]
            assert view["chains"][0]["max_sessions"] == view["max_sessions"] == 64
            assert max(c["queue_ms"] for s in view["history"] for c in s["chains"]) > TARGET_MS


def _scenario(base: str, gw: Any) -> None:
    idle = _chat(base, "ethen/cheap", "Say hi.")
    assert idle["served_provider"] == "mesh" and "spillover" not in idle
    assert idle["predicted_wait_ms"] < TARGET_MS
    # load: long prompts straight to the mesh's model (its only candidate), in flight together
    long_prompt = " ".join(f"item{i}" for i in range(300))
    threads = [threading.Thread(target=_chat, args=(base, MODEL, long_prompt), daemon=True)
               for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # the orchestrator's state, as the router reads it
        cap = gw.capacity().get("mesh")
        if cap is not None and cap.queue_ms > TARGET_MS:
            break
        assert time.monotonic() < deadline, f"the mesh never looked busy: {cap}"
        time.sleep(0.02)
    busy = _chat(base, "ethen/cheap", "Say hi.")
    assert busy["served_provider"] == "alpha", busy
    spill = busy["spillover"]
    assert spill["from"] == "mesh" and spill["reason"] == "predicted_wait_exceeds_target"
    assert spill["target_ms"] == TARGET_MS and spill["predicted_wait_ms"] > TARGET_MS
    for t in threads:
        t.join(timeout=120)
    assert gw.capacity().get("mesh").queue_ms < TARGET_MS  # drained
    again = _chat(base, "ethen/cheap", "Say hi.")
    assert again["served_provider"] == "mesh" and "spillover" not in again
