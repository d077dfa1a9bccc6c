"""What the dashboard's Providers, Canaries and Mesh pages show (issue 14), built from the gateway's objects.

Functions of their inputs (rows, snapshots, the board's transitions, the clock readings passed in), so the
HTTP shell (:mod:`ethen.admin.observe`) stays a few lines and the numbers can be checked directly.

- **Providers and candidates** (:func:`bucket_attempts`, :func:`open_fractions`, :func:`live_state`): the
  request log's attempts in a time window, cut into equal buckets; per candidate (``provider/model``) and per
  provider: attempts, successes, success rate, latency p50 / p95 (nearest rank over the attempts that carry
  a latency: an attempt that failed before it was timed has none) per bucket and over the window. An attempt
  the upstream refused because of the client's request (outcome ``client_error``) is not counted: a client's
  mistake never counts against a provider. Circuit
  state over time is the fraction of each bucket a circuit was open, from the circuit board's own
  transitions (:attr:`ethen.gateway.circuit.CircuitBoard.history`: the last 1000, since the process started;
  a provider circuit is drawn on the provider, a candidate circuit on the candidate). The live state is the
  telemetry snapshot the router uses (samples, successes, mean latency) and the board's circuit now.
- **Canaries** (:func:`canary_rows`): each ``[[canaries]]`` target with its percent, the requests that
  evaluated it and its hits in the window (as the receipts report them: the promoted target, else the first
  one evaluated), the telemetry samples, and ``acceptance_met`` from ``canary_acceptance``
  (:mod:`ethen.gateway.routing.canary`) on the same snapshot the router reads: its own function, not a copy.
- **Mesh** (:func:`mesh_view`): per mesh provider, its nodes (layers held, alive, the latency EWMA and load
  the router uses, the worker's reported latency / load / active sessions, generations routed and failed
  over), and the route :func:`ethen.mesh.routing.score_route` chooses now for the full layer range from the
  orchestrator's current node states (``Orchestrator.states()``, what it routes with), with the cost of each
  stage (node, hop, prefill) and each node's cost terms (latency, load, capacity: ``RouteWeights.node_cost``
  with the other weights zeroed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ethen.gateway.routing import CanaryTarget, TelemetrySnapshot
from ethen.gateway.routing.canary import canary_acceptance
from ethen.mesh.errors import MeshError
from ethen.mesh.routing import RoutingRequest, score_route
from ethen.store.requeststats import AttemptRow

if TYPE_CHECKING:
    from ethen.gateway.circuit import CircuitBoard
    from ethen.gateway.providers.base import Provider

__all__ = [
    "bucket_attempts",
    "canary_rows",
    "circuit_state",
    "flatten",
    "live_state",
    "mesh_load",
    "mesh_view",
    "open_fractions",
    "percentile",
]


def percentile(ordered: Sequence[float], pct: int) -> float | None:
    """Nearest-rank ``pct``-th percentile of sorted values: the ``ceil(pct * n / 100)``-th (integer
    arithmetic, no float rounding); ``None`` when empty."""
    if not ordered:
        return None
    return ordered[max(0, (pct * len(ordered) + 99) // 100 - 1)]


@dataclass(slots=True)
class _Series:
    n: list[int]
    ok: list[int]
    lat: list[list[float]]
    all_lat: list[float] = field(default_factory=list)

    @classmethod
    def empty(cls, buckets: int) -> _Series:
        return cls([0] * buckets, [0] * buckets, [[] for _ in range(buckets)])

    def add_group(self, b: int, n: int, ok: int, latencies: list[float]) -> None:
        self.n[b] += n
        self.ok[b] += ok
        self.lat[b].extend(latencies)
        self.all_lat.extend(latencies)

    def to_dict(self) -> dict[str, Any]:
        ordered = [sorted(x) for x in self.lat]
        n, ok = sum(self.n), sum(self.ok)
        everything = sorted(self.all_lat)
        return {
            "attempts": n, "successes": ok, "success_rate": ok / n if n else None,
            "p50_ms": percentile(everything, 50), "p95_ms": percentile(everything, 95),
            "series": {
                "attempts": self.n,
                "success_rate": [o / k if k else None for o, k in zip(self.ok, self.n, strict=True)],
                "p50_ms": [percentile(x, 50) for x in ordered],
                "p95_ms": [percentile(x, 95) for x in ordered],
            },
        }


def flatten(rows: Iterable[tuple[float, Sequence[Mapping[str, Any]]]]) -> list[AttemptRow]:
    """The attempts of logged rows (``(epoch s, attempts)``: the memory ring's) as the store's query returns
    them (:func:`ethen.store.requeststats.attempts_between`)."""
    out: list[AttemptRow] = []
    for t, attempts in rows:
        for a in attempts:
            cid = str(a.get("candidate") or "")
            if not cid or a.get("outcome") == "client_error":  # the request's fault, not the provider's
                continue
            lat = a.get("latency_ms")
            latency = float(lat) if isinstance(lat, int | float) and not isinstance(lat, bool) else None
            out.append((t, cid, str(a.get("provider") or cid.partition("/")[0]), a.get("outcome") == "ok",
                        latency))
    return out


def bucket_attempts(
    attempts: Iterable[AttemptRow], start: float, bucket_s: float, buckets: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per candidate and per provider: totals and per-bucket series of ``attempts`` (those outside
    ``[start, start + buckets * bucket_s)`` are skipped). One pass over the attempts into (candidate,
    provider, bucket) groups, then the groups rolled up: one dict lookup per attempt (10k attempts: ~3x
    faster than adding each attempt to its candidate's and its provider's series)."""
    groups: dict[tuple[str, str, int], list[Any]] = {}
    for t, cid, provider, ok, latency in attempts:
        b = int((t - start) // bucket_s)
        if not 0 <= b < buckets:
            continue
        g = groups.get((cid, provider, b))
        if g is None:
            g = groups[(cid, provider, b)] = [0, 0, []]
        g[0] += 1
        g[1] += ok
        if latency is not None:
            g[2].append(latency)
    cands: dict[str, _Series] = {}
    provs: dict[str, _Series] = {}
    for (cid, provider, b), (n, ok, lat) in groups.items():
        for key, into in ((cid, cands), (provider, provs)):
            s = into.get(key)
            if s is None:
                s = into[key] = _Series.empty(buckets)
            s.add_group(b, n, ok, lat)
    return ({k: v.to_dict() for k, v in sorted(cands.items())},
            {k: v.to_dict() for k, v in sorted(provs.items())})


def open_fractions(
    history: Iterable[tuple[float, str, bool]], open_now: Iterable[str], start: float, bucket_s: float,
    buckets: int,
) -> dict[str, list[float]]:
    """Per circuit key: the fraction of each bucket it was open. ``history`` holds ``(time, key, opened)``
    transitions, oldest first, on the same clock as ``start``; ``open_now`` the keys open at the end. A key
    whose first transition is a close was open since before the history; a key open now with no transition
    was open all along (its opening fell out of the bounded history)."""
    intervals: dict[str, list[tuple[float, float]]] = {}
    opened_at: dict[str, float] = {}
    for t, key, opened in history:
        spans = intervals.setdefault(key, [])
        if opened:
            opened_at.setdefault(key, t)
        else:
            spans.append((opened_at.pop(key, -math.inf), t))
    for key in open_now:
        intervals.setdefault(key, []).append((opened_at.pop(key, -math.inf), math.inf))
    end = start + buckets * bucket_s
    out: dict[str, list[float]] = {}
    for key, spans in sorted(intervals.items()):
        fr = [0.0] * buckets
        for a, b in spans:
            a, b = max(a, start), min(b, end)
            i = int((a - start) // bucket_s) if a < b else buckets
            while i < buckets and start + i * bucket_s < b:
                lo, hi = start + i * bucket_s, start + (i + 1) * bucket_s
                fr[i] += (min(b, hi) - max(a, lo)) / bucket_s
                i += 1
        if any(fr):
            out[key] = [round(min(1.0, x), 4) for x in fr]
    return out


def circuit_state(board: CircuitBoard, key: str, now: float) -> str:
    """``closed``, ``open`` (cooling down) or ``half_open`` (a trial may go) for a circuit key now."""
    c = board.circuits.get(key)
    if c is None:
        return "closed"
    return "half_open" if c.trial_at <= now else "open"


def live_state(snapshot: TelemetrySnapshot, board: CircuitBoard, pool_ids: Iterable[str], now: float
               ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per candidate and per provider: what the router sees now (telemetry snapshot, circuit)."""
    cands: dict[str, dict[str, Any]] = {}
    for cid in sorted(set(pool_ids) | {f"{p}/{m}" for p, m in snapshot.stats}):
        provider, _, model = cid.partition("/")
        st = snapshot.get(provider, model)
        cands[cid] = {"samples": st.samples, "successes": st.successes, "success_rate": st.success_rate,
                      "latency_ms_mean": st.latency_ms_mean, "ttft_ms_mean": st.ttft_ms_mean,
                      "circuit": circuit_state(board, cid, now)}
    provs: dict[str, dict[str, Any]] = {}
    for provider in sorted({c.partition("/")[0] for c in cands}):
        n, s = snapshot.provider_totals.get(provider, (0, 0))
        provs[provider] = {"samples": n, "successes": s, "success_rate": s / n if n else None,
                           "health": snapshot.provider_health.get(provider),
                           "circuit": circuit_state(board, provider, now)}
    return cands, provs


def canary_rows(
    targets: Sequence[CanaryTarget], snapshot: TelemetrySnapshot, counts: Mapping[str, tuple[int, int]]
) -> list[dict[str, Any]]:
    """One row per canary target: percent, requests and hits (``counts``), samples, acceptance."""
    out = []
    for t in targets:
        provider, _, model = t.candidate.partition("/")
        st = snapshot.get(provider, model)
        requests, hits = counts.get(t.candidate, (0, 0))
        out.append({
            "alias": t.alias, "candidate": t.candidate, "percent": t.percent,
            "requests": requests, "hits": hits,
            "samples": st.samples, "successes": st.successes, "success_rate": st.success_rate,
            "min_samples": t.min_samples, "min_success_rate": t.min_success_rate,
            "acceptance_met": canary_acceptance(t, snapshot),  # the router's function, same snapshot
        })
    return out


def _terms(weights: Any, state: Any) -> dict[str, float]:
    """Each node-cost term: ``node_cost`` with the other weights zeroed (the router's formula, not a copy)."""
    names = ("latency", "load", "capacity")
    return {n: weights.with_overrides({o: 0.0 for o in names if o != n}).node_cost(state) for n in names}


def mesh_load(orch: Any, prompt_tokens: int, spilled: float) -> dict[str, Any]:
    """Issue 44: the orchestrator's load now (of the chain a new request would take) and per chain, and over
    the last minutes (its load book), the predicted wait of a request of ``prompt_tokens`` now, and the
    share of the requests it was preferred for that spilled elsewhere (``spilled``:
    ``ethen_gateway_spillover_total{from=<this provider>}`` summed)."""
    book = orch.load_book
    now = orch.load_now()
    started = book.started
    return {
        "chain": list(now.chain),
        "prefilling": now.prefilling, "decoding": now.decoding, "queued_tokens": now.queued_tokens,
        "step_ms": now.step_ms, "prefill_ms_per_token": now.prefill_ms_per_token,
        "batch_limit": now.batch_limit, "max_sessions": now.max_sessions,
        "predicted_wait_ms": now.wait_ms(prompt_tokens),
        "started": started, "spilled": spilled,
        "spilled_share": spilled / (spilled + started) if spilled + started else None,
        "chains": [{"nodes": list(c), "prefilling": x.prefilling, "decoding": x.decoding,
                    "queued_tokens": x.queued_tokens, "max_sessions": x.max_sessions,
                    "predicted_wait_ms": x.wait_ms(prompt_tokens)} for c, x in book.chains().items()],
        "history": [{"at": x.at, "prefilling": x.prefilling, "decoding": x.decoding,
                     "queued_tokens": x.queued_tokens, "queue_ms": x.queue_ms, "started": x.started,
                     "chains": [{"nodes": list(c), "prefilling": w, "decoding": d, "queue_ms": q}
                                for c, w, d, q in x.chains]}
                    for x in book.history()],
    }


def mesh_view(providers: Mapping[str, Provider], prompt_tokens: int = 1,
              spilled: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Per mesh provider: nodes, health, the route chosen now over the full layer range, and its load
    (:func:`mesh_load`; ``spilled``: provider -> requests spilled away from it)."""
    from ethen.gateway.providers.mesh import MeshProvider  # the mesh stack loads only when a page asks

    out: list[dict[str, Any]] = []
    for name, p in sorted(providers.items()):
        if not isinstance(p, MeshProvider):
            continue
        orch = p.orchestrator
        if orch is None:
            out.append({"provider": name, "loaded": False, "nodes": [], "route": None,
                        "error": "the orchestrator is not loaded"})
            continue
        states = orch.states()
        stats = {s.node_id: s for s in p.node_stats()}
        n_layers = orch.config.n_layers
        route: dict[str, Any] | None = None
        error = None
        try:
            chosen = score_route(RoutingRequest((0, n_layers - 1), prompt_tokens), states, orch.weights,
                                 orch.model_name)
            route = chosen.to_dict()
        except MeshError as exc:
            error = str(exc)
        in_route = set(route["nodes"]) if route is not None else set()
        nodes = []
        for s in states:
            ns = stats.get(s.node_id)
            nodes.append({
                "node_id": s.node_id, "alive": s.alive, "layers": [list(r) for r in s.served_layers],
                "latency_ms_ewma": s.latency_ms, "load": s.current_load, "capacity_score": s.capacity_score,
                "node_cost": orch.weights.node_cost(s) if s.alive else None,
                "cost_terms": _terms(orch.weights, s) if s.alive else None,
                "worker_latency_ms": ns.latency_ms if ns else None, "worker_load": ns.load if ns else None,
                "active_sessions": ns.active_sessions if ns else None,
                "sessions": ns.sessions if ns else 0, "failovers": ns.failovers if ns else 0,
                "in_route": s.node_id in in_route,
            })
        out.append({"provider": name, "loaded": True, "model": orch.model_name, "n_layers": n_layers,
                    "prompt_tokens": prompt_tokens, "nodes": nodes, "route": route, "error": error,
                    "load": mesh_load(orch, prompt_tokens, (spilled or {}).get(name, 0.0))})
    return out
