"""Benchmark: median microseconds per gateway routing decision, against LiteLLM's Router in the same run.

    .venv/bin/python bench/gateway_decide.py                  # pools of 10, 50, 200 candidates
    .venv/bin/python bench/gateway_decide.py --install        # pip-installs litellm first if missing

What is timed, per call (median CPU time over batches of calls, GC paused, same method for both sides):

* ours: ``ethen.gateway.routing.decide(body, ctx)`` - parse and validate the raw body, filter every
  candidate (with reasons), score, rank, canary gate, receipt - over a pool of N candidates with a
  telemetry snapshot entry for each and one canary target.
* baseline: ``litellm.Router.get_available_deployment(model=..., messages=...)`` over the same N
  deployments in one model group, with ``routing_strategy="latency-based-routing"``. For a like-for-like
  comparison its latency store is seeded with the same telemetry our snapshot holds: per deployment, as many
  streamed successes as the snapshot counts (capped at LiteLLM's own ``max_latency_list_size`` of 10) at the
  snapshot's mean latency / TTFT, through LiteLLM's own ``log_success_event``; so it ranks by the same
  latency data ``decide`` sees. Deployments carry the same model info (context window,
  max output, prices, tools, vision). Also printed, for reference: the same router with
  ``enable_pre_call_checks=True`` (LiteLLM's context-window filtering, the nearest thing it has to our
  capability filter; it counts the prompt's tokens), and ``"simple-shuffle"`` (LiteLLM's default: a
  weighted random pick, no per-deployment filtering or scoring). The target is checked against the plain
  latency-based router, the fastest LiteLLM configuration that ranks deployments. LiteLLM is a bench-only
  dependency (not a runtime one); ``LITELLM_LOCAL_MODEL_COST_MAP=True`` keeps it off the network.

Targets (issue 3): >= 10x faster than the LiteLLM Router; time growing at most linearly with the pool
(``growth exponent`` = log(t_200 / t_10) / log(20) should be <= 1).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from ethen.gateway.routing import (
    CanaryTarget,
    Candidate,
    CandidateStats,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
)

BODY: dict[str, Any] = {
    "model": "ethen/auto",
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Summarize this transcript in three bullet points. " * 20},
    ],
    "metadata": {"routing": {"budget_ceiling_usd": 0.05, "latency_target": "balanced"}},
}


def make_pool(n: int, seed: int = 0) -> tuple[Candidate, ...]:
    rnd = random.Random(seed)
    pool = []
    for i in range(n):
        info = ModelInfo(
            context_window=rnd.choice([32_768, 128_000, 200_000, 1_048_576]),
            max_output_tokens=rnd.choice([4096, 8192, 16_384, 65_536]),
            supports_tools=rnd.random() < 0.8,
            supports_vision=rnd.random() < 0.5,
            supports_structured_output=rnd.random() < 0.7,
            supports_reasoning=rnd.random() < 0.3,
            quality=round(rnd.uniform(0.2, 0.95), 3),
            latency_ms=rnd.uniform(300, 6000),
            ttft_ms=rnd.uniform(80, 1500),
        )
        prices = Prices(rnd.choice([0.05, 0.15, 0.3, 1.0, 3.0]), rnd.choice([0.2, 0.6, 2.5, 8.0, 15.0]))
        pool.append(Candidate(f"prov{i % 10}", f"model-{i:03d}", info, prices))
    return tuple(pool)


def make_ctx(pool: tuple[Candidate, ...], seed: int = 0) -> RoutingContext:
    rnd = random.Random(seed)
    stats = {}
    for c in pool:
        n = rnd.randint(0, 50)
        stats[(c.provider, c.model)] = CandidateStats(
            n, rnd.randint(n // 2, n) if n else 0, rnd.uniform(300, 6000), rnd.uniform(80, 1500)
        )
    canary = (CanaryTarget("ethen/auto", pool[-1].id, 5, 0.95, 20),)
    return RoutingContext(pool, ProjectPolicy(), TelemetrySnapshot(stats), canary, datetime.now(UTC), "req_0")


def median_us(fn: Callable[[], object], calls: int) -> float:
    """Median CPU microseconds per call. Calls run in batches of about 2 ms of CPU each; each batch gives
    one sample (its CPU time / its calls). CPU time (``time.process_time``), not wall time: on a shared
    machine wall time also counts the time the process waits for a core. Same method for every contender."""
    for _ in range(min(50, calls)):
        fn()  # warm-up
    clock = time.process_time
    t0 = clock()
    probe = 0
    while clock() - t0 < 0.01:
        fn()
        probe += 1
    per_call = (clock() - t0) / probe
    batch = max(1, min(calls, int(0.002 / per_call)))
    samples = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(max(15, calls // batch)):
            t0 = clock()
            for _ in range(batch):
                fn()
            samples.append((clock() - t0) / batch)
    finally:
        gc.enable()
    return statistics.median(samples) * 1e6


def ensure_litellm(install: bool) -> bool:
    if importlib.util.find_spec("litellm") is not None:
        return True
    if not install:
        print("litellm is not installed (bench-only baseline). Install it with:\n"
              f"  {sys.executable} -m pip install litellm\nor rerun with --install.", file=sys.stderr)
        return False
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "litellm"], check=True)
    return importlib.util.find_spec("litellm") is not None


def _seed_latency(router: Any, ctx: RoutingContext) -> None:
    """Feed LiteLLM's latency handler the snapshot's latency/TTFT means via its own success callback."""
    import litellm
    from litellm.router_strategy.lowest_latency import LowestLatencyLoggingHandler

    handlers = [c for c in litellm.callbacks if isinstance(c, LowestLatencyLoggingHandler)]
    if not handlers:
        raise RuntimeError("LiteLLM's latency handler not found in litellm.callbacks (API changed?)")
    handler = handlers[-1]  # the router built last
    start = datetime.now()
    for c in ctx.pool:
        st = ctx.telemetry.get(c.provider, c.model)
        latency = st.latency_ms_mean or c.info.latency_ms
        ttft = st.ttft_ms_mean or c.info.ttft_ms
        kwargs = {
            "litellm_params": {"metadata": {"model_group": "ethen/auto"}, "model_info": {"id": c.id}},
            "stream": True,
            "completion_start_time": start + timedelta(milliseconds=ttft),
        }
        # as many successes as our snapshot counts, up to LiteLLM's own list cap (max_latency_list_size=10)
        for _ in range(min(st.successes, 10)):
            handler.log_success_event(kwargs, None, start, start + timedelta(milliseconds=latency))


def litellm_router(
    pool: tuple[Candidate, ...],
    strategy: str,
    ctx: RoutingContext | None = None,
    pre_call_checks: bool = False,
) -> Callable[[], object]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    from litellm import Router

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    logging.getLogger("LiteLLM").setLevel(logging.ERROR)
    model_list = [
        {
            "model_name": "ethen/auto",
            "litellm_params": {
                "model": f"openai/{c.model}",
                "api_key": "sk-bench-not-used",
                "api_base": f"http://127.0.0.1:9/{c.provider}/v1",
            },
            "model_info": {  # the same model intelligence decide() sees
                "id": c.id,
                "max_input_tokens": c.info.context_window,
                "max_output_tokens": c.info.max_output_tokens,
                "input_cost_per_token": c.prices.input_per_mtok / 1e6,
                "output_cost_per_token": c.prices.output_per_mtok / 1e6,
                "supports_function_calling": c.info.supports_tools,
                "supports_vision": c.info.supports_vision,
            },
        }
        for c in pool
    ]
    router = Router(model_list=model_list, routing_strategy=strategy, enable_pre_call_checks=pre_call_checks)
    if ctx is not None:
        _seed_latency(router, ctx)
    messages = BODY["messages"]

    def pick() -> object:
        return router.get_available_deployment(model="ethen/auto", messages=messages)

    pick()  # fail fast if the API changed
    return pick


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--calls", type=int, default=2000, help="timed decide() calls per size (LiteLLM: 1/10)")
    ap.add_argument("--install", action="store_true", help="pip install litellm if missing")
    args = ap.parse_args()

    have_litellm = ensure_litellm(args.install)
    rows = []
    for n in args.sizes:
        pool = make_pool(n)
        ctx = make_ctx(pool)
        decision = decide(BODY, ctx)
        assert decision.chain, "bench pool must route"
        ours = median_us(lambda ctx=ctx: decide(BODY, ctx), args.calls)
        lat = checked = shuffle = math.nan
        if have_litellm:
            lite_calls = max(50, args.calls // 10)
            lat = median_us(litellm_router(pool, "latency-based-routing", ctx), lite_calls)
            checked = median_us(litellm_router(pool, "latency-based-routing", ctx, pre_call_checks=True), 30)
            shuffle = median_us(litellm_router(pool, "simple-shuffle"), lite_calls)
        rows.append((n, len(decision.chain), ours, lat, checked, shuffle))

    print(f"python {sys.version.split()[0]}; median microseconds per decision (lower is better); "
          "x = LiteLLM time / ethen time")
    print(
        f"{'pool':>5} {'chain':>5} {'ethen decide':>13} {'us/cand':>8}"
        f" {'litellm latency':>16} {'x':>5} {'+pre-call checks':>17} {'x':>6} {'simple-shuffle':>15} {'x':>5}"
    )
    for n, chain, ours, lat, checked, shuffle in rows:
        print(
            f"{n:>5} {chain:>5} {ours:>13.1f} {ours / n:>8.2f} {lat:>16.1f} {lat / ours:>5.1f}"
            f" {checked:>17.1f} {checked / ours:>6.1f} {shuffle:>15.1f} {shuffle / ours:>5.1f}"
        )
    if len(rows) >= 2:
        (n0, _, t0, l0, *_), (n1, _, t1, l1, *_) = rows[0], rows[-1]
        exponent = math.log(t1 / t0) / math.log(n1 / n0)
        print(f"growth exponent ethen {n0}->{n1}: {exponent:.2f} (1.0 = linear)")
        if have_litellm:
            lexp = math.log(l1 / l0) / math.log(n1 / n0)
            print(f"growth exponent litellm latency-based {n0}->{n1}: {lexp:.2f}")
    if have_litellm:
        worst = min(lat / ours for _, _, ours, lat, _, _ in rows)
        print(f"target >= 10x vs LiteLLM latency-based routing: {'met' if worst >= 10 else 'NOT met'} "
              f"(worst {worst:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
