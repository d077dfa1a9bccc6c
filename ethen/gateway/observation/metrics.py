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

Request-log families (issue 14), counted by the request log's writer task from each finished request's record
(:meth:`GatewayMetrics.account`), so the request path does not update them either (they lag it by the
writer's batch, ~50 ms): ``ethen_gateway_tokens_total{project, provider, model, direction}`` (``input`` /
``output``), ``ethen_gateway_prompt_cache_tokens_total{provider, kind}`` (of the input tokens, those the
provider billed as ``read`` from / ``write`` to its prompt cache, issue 45),
``ethen_gateway_cost_usd_total{project, provider, model}``,
``ethen_gateway_attempts_total{provider, model, outcome}`` (``ok`` / ``error``),
``ethen_gateway_fallback_served_total{provider, model}`` (requests a fallback answered, by that candidate),
``ethen_gateway_canary_requests_total{candidate, hit}``, ``ethen_gateway_budget_remaining_usd{project}``
(the remaining window budget the admission layer held in memory at the project's last request), and
``ethen_gateway_request_log_dropped_total`` / ``ethen_gateway_request_log_write_errors_total``.
``project`` is ``-`` for a config key. At scrape time: ``ethen_gateway_circuit_state{circuit, state}`` (1 per
open circuit; ``state`` is ``open`` while cooling down, ``half_open`` once a trial may go).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ethen.gateway.providers.base import Provider

if TYPE_CHECKING:
    from ethen.gateway.api.record import RequestRecord
    from ethen.gateway.circuit import CircuitBoard

__all__ = ["CONTENT_TYPE_LATEST", "HEDGE_OUTCOMES", "SHADOW_OUTCOMES", "CircuitCollector", "GatewayMetrics",
           "NodeCollector"]

#: every ``outcome`` of ``ethen_gateway_hedges_total`` / ``ethen_gateway_shadows_total`` (issue 27): exposed
#: at 0 from the start by a gateway with ``[[hedges]]`` / ``[[shadows]]`` (:meth:`GatewayMetrics.hedging`,
#: :meth:`GatewayMetrics.shadowing`), so a scrape sees the series before the first event
HEDGE_OUTCOMES = ("fired", "won", "lost", "failed", "skipped_budget", "skipped_no_next_candidate",
                  "skipped_opt_out", "skipped_min_samples")
SHADOW_OUTCOMES = ("sent", "ok", "failed", "dropped_in_flight", "skipped_gate", "skipped_budget",
                   "skipped_project", "record_failed")

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


class CircuitCollector(Collector):
    """``ethen_gateway_circuit_state``: one sample per open circuit, read from the board at scrape time."""

    def __init__(self, board: CircuitBoard) -> None:
        self.board = board

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("ethen_gateway_circuit_state",
                                "1 per open circuit: open (cooling down) or half_open (a trial may go).",
                                labels=["circuit", "reason", "state"])
        now = self.board.clock()
        for key, c in list(self.board.circuits.items()):
            fam.add_metric([key, c.reason, "half_open" if c.trial_at <= now else "open"], 1.0)
        yield fam


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
        self.settled_capped = Counter(
            "ethen_gateway_settled_capped",
            "Credible usage priced above its reservation that the project's budget could not top up (the "
            "reservation was settled instead).",
            ["provider"],
            registry=r,
        )
        self.overhead = Histogram(
            "ethen_gateway_overhead_seconds",
            "Gateway overhead: total time minus upstream time.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )

        self.tokens = Counter("ethen_gateway_tokens", "Tokens by project and served model.",
                              ["project", "provider", "model", "direction"], registry=r)
        self.prompt_cache_tokens = Counter(
            "ethen_gateway_prompt_cache_tokens", "Input tokens the provider billed as read from (read) or "
            "written to (write) its prompt cache.", ["provider", "kind"], registry=r)
        self.cost = Counter("ethen_gateway_cost_usd", "Cost (usage x prices) by project and served model.",
                            ["project", "provider", "model"], registry=r)
        self.attempts = Counter("ethen_gateway_attempts", "Upstream attempts by candidate and outcome.",
                                ["provider", "model", "outcome"], registry=r)
        self.fallback_served = Counter("ethen_gateway_fallback_served",
                                       "Requests answered by a fallback, by the candidate that answered.",
                                       ["provider", "model"], registry=r)
        self.canary = Counter("ethen_gateway_canary_requests", "Requests that evaluated a canary, by hit.",
                              ["candidate", "hit"], registry=r)
        self.budget_remaining = Gauge("ethen_gateway_budget_remaining_usd",
                                      "A project's remaining window budget at its last request.",
                                      ["project"], registry=r)
        self.hedges = Counter("ethen_gateway_hedges",  # issue 27: ethen.gateway.api.hedging
                              "Hedged requests by outcome (fired, won, lost, failed, skipped_*).",
                              ["outcome"], registry=r)
        # shadow evaluation (issue 27, ethen.gateway.api.shadow): sampled requests by what became of them
        self.shadows = Counter("ethen_gateway_shadows",
                               "Shadow calls by outcome (sent, ok, failed, dropped_in_flight, skipped_gate, "
                               "skipped_budget, skipped_project, record_failed).", ["outcome"], registry=r)
        self.shadows_in_flight = Gauge("ethen_gateway_shadows_in_flight", "Shadow calls running now.",
                                       registry=r)
        self.log_dropped = Counter("ethen_gateway_request_log_dropped",
                                   "Request-log records dropped because the writer's queue was full.",
                                   registry=r)
        self.log_write_errors = Counter("ethen_gateway_request_log_write_errors",
                                        "Request-log batches the store refused (dropped).", registry=r)
        # the response cache (issue 27, ethen.gateway.cache): lookups by result, and what it holds
        self.cache_hits = Counter("ethen_gateway_cache_hits", "Requests answered from the response cache.",
                                  registry=r)
        self.cache_misses = Counter("ethen_gateway_cache_misses",
                                    "Cacheable requests the response cache had no usable answer for.",
                                    registry=r)
        self.cache_entries = Gauge("ethen_gateway_cache_entries",
                                   "Entries in the response cache (redis: best effort).", registry=r)
        # issue 44 (ethen.gateway.routing.capacity): routing by live capacity
        self.spillover = Counter("ethen_gateway_spillover",
                                 "Requests whose preferred provider was passed over for capacity, by the "
                                 "provider passed over (from) and the one that answered (to).",
                                 ["from", "to"], registry=r)
        self.predicted_wait = Histogram("ethen_gateway_predicted_wait_seconds",
                                        "Predicted wait for the first token (queue plus own prefill) of the "
                                        "candidate that answered, at the routing decision.",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_bytes = Gauge("ethen_gateway_cache_bytes",
                                 "Bytes of the response cache's stored entries (redis: best effort).",
                                 registry=r)

    def hedging(self) -> None:
        """A gateway with ``[[hedges]]``: every hedge outcome's series, at 0 until it happens."""
        for outcome in HEDGE_OUTCOMES:
            self.hedges.labels(outcome)

    def shadowing(self) -> None:
        """A gateway with ``[[shadows]]``: every shadow outcome's series, at 0 until it happens."""
        for outcome in SHADOW_OUTCOMES:
            self.shadows.labels(outcome)

    def watch_circuits(self, board: CircuitBoard) -> None:
        """Expose the board's circuits at scrape time."""
        self.registry.register(CircuitCollector(board))

    def account(self, rec: RequestRecord, row: Mapping[str, Any]) -> None:
        """Count one finished request (called by the request log's writer, off the request path)."""
        project = rec.project or "-"
        for a in row["attempts"]:
            # cancelled: a hedge; client_error: the request's fault, not the provider's (issue 42)
            outcome = a["outcome"] if a["outcome"] in ("ok", "cancelled", "client_error") else "error"
            self.attempts.labels(a["provider"], a["model"], outcome).inc()
        served = rec.served
        if served is not None:
            usage = rec.usage
            if usage is not None:
                self.tokens.labels(project, served.provider, served.model, "input").inc(usage.prompt_tokens)
                self.tokens.labels(project, served.provider, served.model, "output").inc(
                    usage.completion_tokens)
                if usage.cache_read_tokens:
                    self.prompt_cache_tokens.labels(served.provider, "read").inc(usage.cache_read_tokens)
                if usage.cache_write_tokens:
                    self.prompt_cache_tokens.labels(served.provider, "write").inc(usage.cache_write_tokens)
            if row["cost_nano"]:
                self.cost.labels(project, served.provider, served.model).inc(row["cost_nano"] / 1e9)
            if row["fallback_used"]:
                self.fallback_served.labels(served.provider, served.model).inc()
        decision = rec.decision
        if decision is not None and served is not None:  # issue 44
            pick = next((sc for sc in decision.chain if sc.candidate.key == served.key), None)
            if pick is not None:
                self.predicted_wait.observe(pick.predicted_wait_ms / 1000.0)
            spill = decision.receipt.spillover
            if spill is not None and spill.from_provider != served.provider:
                self.spillover.labels(spill.from_provider, served.provider).inc()
        canary = decision.canary if decision is not None else None
        if canary is not None:
            self.canary.labels(canary.target.candidate, "true" if canary.hit else "false").inc()
        if rec.project is not None and rec.remaining_usd is not None:
            self.budget_remaining.labels(rec.project).set(rec.remaining_usd)

    def render(self) -> bytes:
        return generate_latest(self.registry)
