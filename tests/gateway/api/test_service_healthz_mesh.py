"""``/healthz`` and ``/metrics`` of a gateway whose mesh has no live worker (the worker address answers
nothing): ``degraded`` naming the uncovered layers, 200 while an HTTP provider can still serve, 503 when the
mesh is the only provider; the per-node families list the dead node. Real servers on 127.0.0.1 (the scripted
upstream and the gateway), the real mesh provider (its orchestrator loads the model's ends)."""

from __future__ import annotations

import re
import socket
from typing import Any

import httpx

from tests.gateway.service_harness import ROUTES, config_dict, live

MESH_ROUTE = {"model": "smollm2-135m-instruct", "provider": "mesh"}


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def _mesh(address: str) -> dict[str, Any]:
    return {"id": "mesh", "kind": "mesh", "workers": {"gone": address}, "start_timeout_s": 0.2,
            "health_interval_s": 0.1}


def test_a_mesh_without_live_workers_degrades_healthz_but_http_providers_still_serve() -> None:
    providers = [*config_dict("http://127.0.0.1:1")["providers"], _mesh(_dead_address())]
    with live(providers=providers, routes=[*ROUTES, MESH_ROUTE]) as lv:
        r = httpx.get(f"{lv.base_url}/healthz", timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "degraded", "serving": True, "reasons": [
            "mesh 'mesh': no live chain of workers covers layers 0-29: no live worker holds layers 0-29 "
            "(workers down: gone)"]}
        text = httpx.get(f"{lv.base_url}/metrics", timeout=10).text
        series = dict(re.findall(r'^(ethen_mesh_node_\w+)\{node="gone",provider="mesh"\} (\S+)$', text, re.M))
        assert series == {"ethen_mesh_node_alive": "0.0", "ethen_mesh_node_sessions_total": "0.0",
                          "ethen_mesh_node_failovers_total": "0.0"}, text  # no latency/load: no answer


def test_healthz_is_503_when_the_mesh_is_the_only_provider_and_cannot_serve() -> None:
    with live(providers=[_mesh(_dead_address())], routes=[MESH_ROUTE]) as lv:
        r = httpx.get(f"{lv.base_url}/healthz", timeout=10)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "degraded" and body["serving"] is False
        assert "no live worker holds layers 0-29" in body["reasons"][0]


def test_a_gateway_without_nodes_exports_no_node_families() -> None:
    with live() as lv:
        assert httpx.get(f"{lv.base_url}/healthz", timeout=10).json() == {"status": "ok"}
        assert "ethen_mesh_node" not in httpx.get(f"{lv.base_url}/metrics", timeout=10).text
