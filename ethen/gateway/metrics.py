"""Prometheus metrics of one gateway app (a private registry per app, so several apps can live in a process,
as the tests do). Exposed at ``GET /api/gateway/v1/metrics`` in the text exposition format.

Labels are bounded: ``model`` is the requested model only when it is configured (a concrete id or an alias),
otherwise ``"other"``, so a client cannot blow up the series count with made-up model names.

Per-node families (the mesh's workers; labels ``provider``, ``node``): ``ethen_mesh_node_alive`` (1/0),
``ethen_mesh_node_latency_ewma_seconds`` and ``ethen_mesh_node_load`` (the worker's own EWMA and busy
fraction, from its last Health poll; absent while it does not answer), ``ethen_mesh_node_active_sessions``,
``ethen_mesh_node_sessions_total`` (generations this gateway routed through the node) and
``ethen_mesh_node_failovers_total`` (generations that failed over away from it). A custom collector reads
them from the providers' :meth:`~ethen.gateway.providers.base.Provider.node_stats` at scrape time, so the
request path does not update any of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ethen.gateway.providers.base import Provider

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "NodeCollector"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class NodeCollector(Collector):
    """The per-node families of every provider that has nodes, read at scrape time."""

    def __init__(self, providers: Mapping[str, Provider]) -> None:
        self.providers = providers

    def describe(self) -> list[Metric]:
        return []  # names depend on the providers' state; nothing to reserve at registration

    def collect(self) -> Iterator[Metric]:
        labels = ["provider", "node"]
        alive = GaugeMetricFamily("ethen_mesh_node_alive", "1 if the node answers Health and is routable.",
                                  labels=labels)
        latency = GaugeMetricFamily("ethen_mesh_node_latency_ewma_seconds",
                                    "The node's EWMA of compute + queue time per Forward.", labels=labels)
        load = GaugeMetricFamily("ethen_mesh_node_load", "The node's busy fraction, 0-1.", labels=labels)
        active = GaugeMetricFamily("ethen_mesh_node_active_sessions", "Sessions the node holds now.",
                                   labels=labels)
        sessions = CounterMetricFamily("ethen_mesh_node_sessions",
                                       "Generations this gateway routed through the node.", labels=labels)
        failovers = CounterMetricFamily("ethen_mesh_node_failovers",
                                        "Generations that failed over away from the node.", labels=labels)
        any_node = False
        for name, provider in self.providers.items():
            for n in provider.node_stats():
                any_node = True
                key = [name, n.node_id]
                alive.add_metric(key, 1.0 if n.alive else 0.0)
                if n.latency_ms is not None:
                    latency.add_metric(key, n.latency_ms / 1000.0)
                if n.load is not None:
                    load.add_metric(key, n.load)
                if n.active_sessions is not None:
                    active.add_metric(key, float(n.active_sessions))
                sessions.add_metric(key, float(n.sessions))
                failovers.add_metric(key, float(n.failovers))
        if any_node:
            yield from (alive, latency, load, active, sessions, failovers)


class GatewayMetrics:
    """The gateway's counters and histograms, and the providers' per-node families."""

    def __init__(self, providers: Mapping[str, Provider] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if providers:
            r.register(NodeCollector(providers))
        self.requests = Counter(
            "ethen_gateway_requests",
            "Chat completion requests by outcome.",
            ["model", "stream", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ethen_gateway_request_latency_seconds",
            "End-to-end request latency (to the last byte).",
            ["stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ethen_gateway_ttft_seconds",
            "Time to the first streamed chunk sent to the client.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "ethen_gateway_fallbacks",
            "Attempts beyond the first candidate of a chain.",
            ["provider"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "ethen_gateway_upstream_errors",
            "Failed upstream attempts by provider and error class.",
            ["provider", "error_class"],
            registry=r,
        )
        self.usage_not_credible = Counter(
            "ethen_gateway_usage_not_credible",
            "Upstream usage reports not billed (over what the request allowed; its reservation is settled).",
            ["provider"],
            registry=r,
        )
        self.overhead = Histogram(
            "ethen_gateway_overhead_seconds",
            "Gateway overhead: total time minus upstream time.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
