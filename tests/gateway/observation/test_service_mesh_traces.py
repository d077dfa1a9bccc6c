"""Mesh stages in the request's trace (issue 14): a gateway with a mesh provider over three real workers
serves a request; the trace has one ``ethen.mesh.stage {node}`` span per stage under the mesh attempt, and
the receipt's ``mesh.stages`` carries the same per-stage calls and times."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ethen.gateway.observation.tracing import Tracing
from tests.gateway.service_harness import CLIENT_KEY, ROUTES, config_dict, live

LAYOUT = {"a": "0-9", "b": "10-19", "c": "20-29"}


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, Any]]:
    from ethen.mesh.worker.launch import spawn_worker

    started: dict[str, Any] = {}
    try:
        for node, layers in LAYOUT.items():
            started[node] = spawn_worker(node, layers)
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_mesh_stages_are_spans_under_the_mesh_attempt(workers: dict[str, Any]) -> None:
    mesh = {"id": "mesh", "kind": "mesh", "workers": {n: w.address for n, w in workers.items()},
            "health_interval_s": 0.1}
    providers = [*config_dict("http://127.0.0.1:1")["providers"], mesh]
    routes = [*ROUTES, {"model": "smollm2-135m-instruct", "provider": "mesh"}]
    with live(providers=providers, routes=routes) as lv:
        exporter = InMemorySpanExporter()
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        gw.requestlog.tracing = Tracing(exporter, batch=False)
        body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 4,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        deadline = time.monotonic() + 60
        while True:  # bounded: the orchestrator's first health polls before the mesh can route
            r = httpx.post(f"{lv.base_url}/chat/completions", json=body, timeout=120,
                           headers={"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": "mesh-trace"})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        tokens = r.json()["usage"]["completion_tokens"]
        stages = r.json()["ethen"]["routing"]["mesh"]["stages"]
        assert [(s["node"], s["layers"]) for s in stages] == [("a", [0, 9]), ("b", [10, 19]), ("c", [20, 29])]
        for s in stages:  # a prefill call, then one call per decoded token after the first
            assert s["calls"] == tokens and s["rows"] > s["calls"]
            assert 0 < s["worker_ms"] <= s["call_ms"] and s["start"] <= s["end"]
        assert all(a["start"] <= b["start"] for a, b in itertools.pairwise(stages))

        def spans() -> Any:
            got = exporter.get_finished_spans()
            return got if sum(s.name.startswith("ethen.mesh.stage") for s in got) >= 3 else None

        deadline = time.monotonic() + 15
        while (got := spans()) is None:
            assert time.monotonic() < deadline, [s.name for s in exporter.get_finished_spans()]
            time.sleep(0.05)
        attempt = next(s for s in got if s.name == "chat smollm2-135m-instruct" and s.kind == SpanKind.CLIENT)
        staged = sorted((s for s in got if s.name.startswith("ethen.mesh.stage")),
                        key=lambda s: s.start_time or 0)
        assert [s.name for s in staged] == ["ethen.mesh.stage a", "ethen.mesh.stage b", "ethen.mesh.stage c"]
        for span, st in zip(staged, stages, strict=True):
            a = dict(span.attributes or {})
            assert span.parent is not None and span.parent.span_id == attempt.context.span_id
            assert span.context.trace_id == attempt.context.trace_id and span.kind == SpanKind.CLIENT
            assert a["ethen.mesh.node"] == st["node"]
            assert a["ethen.mesh.layers"] == "-".join(map(str, st["layers"]))
            assert (a["ethen.mesh.calls"], a["ethen.mesh.rows"]) == (st["calls"], st["rows"])
            assert a["ethen.mesh.worker_ms"] == st["worker_ms"] and a["ethen.mesh.call_ms"] == st["call_ms"]
            assert span.start_time == int(st["start"] * 1e9) and span.end_time == int(st["end"] * 1e9)
