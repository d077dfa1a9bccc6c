"""The runtime state of one gateway (:class:`Gateway`): pool, policy, keys, accounts, providers,
telemetry, circuits, executor, metrics, request log and rate limits, built from its config.

The HTTP app (:func:`ethen.gateway.api.app.gateway_app`) builds one and its endpoints read it; it lives here,
apart from the app, so the modules that read it (pipeline, shared state, the admin's pages) do not import
the app.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from ethen.gateway.accounting.accounts import Accounts, accounts_for
from ethen.gateway.accounting.auth import KeyRing
from ethen.gateway.accounting.ratelimit import RateLimits
from ethen.gateway.api.execute import Executor
from ethen.gateway.api.hedging import Hedger
from ethen.gateway.api.prompt_memory import PromptMemory
from ethen.gateway.api.record import RouteTarget
from ethen.gateway.api.shadow import ShadowRunner
from ethen.gateway.api.sse import dumps
from ethen.gateway.cache import ResponseCache, response_cache_for
from ethen.gateway.catalog import Catalog
from ethen.gateway.circuit import CircuitBoard
from ethen.gateway.config import GatewayConfig, build_canaries, build_policy, build_pool
from ethen.gateway.observation.metrics import GatewayMetrics
from ethen.gateway.observation.requestlog import RequestLog
from ethen.gateway.observation.telemetry_store import TelemetryStore
from ethen.gateway.observation.tracing import tracing_for
from ethen.gateway.providers.base import Provider
from ethen.gateway.routing import ALIASES, EMPTY_CAPACITY, CapacitySnapshot, ProviderCapacity, RoutingContext
from ethen.gateway.routing.hedge import HedgeRule
from ethen.gateway.routing.shadow import ShadowRule
from ethen.gateway.shared import SharedRuntime

__all__ = ["Gateway"]


class Gateway:
    """Runtime state of one gateway: pool, policy, keys, providers, telemetry, metrics."""

    def __init__(
        self,
        cfg: GatewayConfig,
        *,
        providers: Mapping[str, Provider],
        catalog: Catalog | None = None,
        store: TelemetryStore | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = build_pool(cfg, catalog)
        self.policy = build_policy(cfg)
        self.canaries = build_canaries(cfg)
        self.keyring = KeyRing(cfg.api_keys)
        self.providers = dict(providers)
        self.store = store or TelemetryStore()
        self.metrics = GatewayMetrics(self.providers)  # + per-node families, read at scrape time
        upstream = {f"{r.provider}/{r.model}": r.upstream for r in cfg.routes}
        targets = {c.id: RouteTarget(c, self.providers[c.provider], upstream[c.id]) for c in self.pool}
        cc = cfg.circuit
        self.circuits = CircuitBoard(cc.cooldown_s, cc.max_cooldown_s)
        self.executor = Executor(targets, self.store, self.metrics, self.circuits, probe=cc.probe)
        self.metrics.watch_circuits(self.circuits)
        rules = [
            HedgeRule(h.alias, h.after_ms, h.after_percentile, h.min_samples, h.max_extra) for h in cfg.hedges
        ]
        self.wait_targets = MappingProxyType({w.alias: w.max_wait_ms for w in cfg.wait_targets})  # issue 44
        self.hedger: Hedger | None = Hedger(rules, self.executor, self.store) if rules else None  # issue 27
        self.requestlog = RequestLog(cfg.log, self.metrics, tracing_for(cfg.otel))  # issue 14
        self.known_models = frozenset({c.model for c in self.pool} | set(ALIASES))
        created = int(time.time())
        owners: dict[str, list[str]] = {}
        for c in self.pool:
            owners.setdefault(c.model, []).append(c.provider)
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": ",".join(sorted(set(ps)))}
            for m, ps in sorted(owners.items())
        ] + [{"id": a, "object": "model", "created": created, "owned_by": "ethen"} for a in sorted(ALIASES)]
        self.models_body = dumps({"object": "list", "data": data})
        # the accounts: config keys, plus the store's projects and keys with a [store] (secrets from env)
        self.accounts: Accounts = accounts_for(cfg, self.keyring, env)
        acc, m = self.accounts, self.metrics
        self.requestlog.store = lambda: acc.store  # the request log goes to the store when there is one
        self.requestlog.write = lambda: acc.admission.write if acc.admission is not None else None
        acc.on_not_credible = lambda provider: m.usage_not_credible.labels(provider).inc()
        acc.on_capped = lambda provider: m.settled_capped.labels(provider).inc()
        # [shared] Redis: telemetry bus, exact rate limits (rpm/tpm in process memory without it)
        self.shared = SharedRuntime.for_gateway(self.circuits, self.store, cfg, env)
        self.limits: RateLimits = self.shared.limits  # the pipeline admits through gw.limits
        # issue 45: which provider holds a conversation's prompt prefix in its cache (cache-aware cost)
        self.prompt_memory = PromptMemory({p.id: p.kind for p in cfg.providers},
                                          cfg.prompt_cache.auto_breakpoints, state=self.shared.state,
                                          aware=cfg.prompt_cache.cache_aware_routing)
        # [[shadows]] (issue 27): None without rules; shadow calls paid by each rule's store project
        shadow_rules = [ShadowRule(x.alias, x.candidate, x.percent, x.project, x.max_in_flight,
                                   x.min_success_rate, x.min_samples) for x in cfg.shadows]
        self.shadows: ShadowRunner | None = (
            ShadowRunner(shadow_rules, targets, self.accounts, self.metrics) if shadow_rules else None
        )
        # [cache] (issue 27): None unless enabled; redis backend: the [shared] Redis
        self.cache: ResponseCache | None = response_cache_for(cfg.cache, self.shared.state, self.metrics)

    def capacity(self) -> CapacitySnapshot:
        """Issue 44: every provider's capacity now (state reads only, no I/O)."""
        caps: dict[str, ProviderCapacity] = {}
        for name, p in self.providers.items():
            cap = p.capacity()
            if cap is not None and (cap.queue_ms > 0 or cap.prefill_ms_per_token is not None):
                caps[name] = cap  # an idle HTTP provider is left out: the same score, no spillover pass
        return CapacitySnapshot(caps) if caps else EMPTY_CAPACITY

    def context(self, request_id: str) -> RoutingContext:
        telemetry = self.store.snapshot()
        now = datetime.now(UTC)
        self.circuits.sync(telemetry)  # O(1) unless the snapshot changed; opens/closes circuits
        return RoutingContext(
            pool=self.pool,
            policy=self.policy,
            telemetry=telemetry,
            canaries=self.canaries,
            now=now,
            request_id=request_id,
            circuits=self.circuits.view(now),  # half-open keys, trial times (cached; empty when all closed)
            capacity=self.capacity(),
            wait_targets=self.wait_targets,
        )

    def label(self, body: Mapping[str, Any] | None) -> str:
        model = body.get("model") if body else None
        return model if isinstance(model, str) and model in self.known_models else "other"

    async def aclose(self) -> None:
        await self.executor.aclose()  # circuit probes
        for p in self.providers.values():
            await p.aclose()
