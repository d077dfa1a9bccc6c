"""Prometheus metrics of one gateway app (a private registry per app, so several apps can live in a process,
as the tests do). Exposed at ``GET /api/gateway/v1/metrics`` in the text exposition format.

Labels are bounded: ``model`` is the requested model only when it is configured (a concrete id or an alias),
otherwise ``"other"``, so a client cannot blow up the series count with made-up model names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class GatewayMetrics:
    """The gateway's counters and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
