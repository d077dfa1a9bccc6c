"""Hedged requests benchmark (issue 27): tail latency with and without ``[[hedges]]``, same run and upstreams.

Set-up (all on 127.0.0.1, each server its own process):
- two scripted OpenAI-compatible upstreams (this file, ``--serve-upstream``), one per provider, with a
  heavy-tailed latency: 95 % of calls answer after 50 ms, 5 % after a uniform 2-5 s (seeded RNG, a different
  seed per upstream); each counts the calls it received (``GET /stats``);
- two ethen gateways over the same two routes (one per provider, same capabilities, so the chain of
  ``ethen/fast`` holds both): ``plain`` without hedging, ``hedged`` with ``[[hedges]] alias = "ethen/fast"``,
  ``after_ms`` (default 150), ``max_extra = 1``;
- open-loop load in this process (aiohttp + uvloop): request i leaves at ``start + i / rate`` and its latency
  counts from then. The two gateways are measured in alternating rounds (``--rounds``, default 4, the order
  flipped each round so drift on a shared machine hits both), with the same number of requests at the same
  rate (bounded: ``--requests`` each, default 2000 at 100 rps = 20 s each).

Printed per gateway: p50 / p90 / p99 / max latency (ms), errors, upstream calls per request; then the ratios
(hedged / plain) and the hedged gateway's ``ethen_gateway_hedges_total``.

Run:  .venv/bin/python bench/hedging.py [--requests 2000] [--rate 100] [--after-ms 150]
Targets (issue 27): p99 with hedging <= 1/5 of without, at <= +10 % upstream calls; p50 unchanged (noise).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (
    counter_by_outcome,
    free_port,
    ok_latencies,
    open_loop,
    percentile,
    stop_all,
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
CLIENT_KEY = "ethen-bench-hedging-0123456789abcdef0123456789"
UPSTREAM_KEY = "sk-bench-hedging"
BODY = json.dumps({"model": "ethen/fast", "messages": [{"role": "user", "content": "Say hello"}],
                   "max_tokens": 16}).encode()
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"}


def load(url: str, total: int, rate: float) -> tuple[int, list[float]]:
    """Open loop (benchkit.open_loop): the number of 200s and their latencies (ms)."""
    lat = ok_latencies(open_loop(url, BODY, total, rate, lambda i: HEADERS))
    return len(lat), lat



# --- the heavy-tailed upstream (its own process) ---------------------------------------------------------


def serve_upstream(port: int, seed: int, fast_ms: float, slow_s: tuple[float, float], p_slow: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    rng = random.Random(seed)
    calls = {"n": 0, "slow": 0}

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        calls["n"] += 1
        slow = rng.random() < p_slow
        if slow:
            calls["slow"] += 1
        await asyncio.sleep(rng.uniform(*slow_s) if slow else fast_ms / 1000)
        msg = {"role": "assistant", "content": "Hello!"}
        return JSONResponse({
            "id": "chatcmpl-b", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
        })

    async def stats(request: Request) -> Response:
        return JSONResponse(calls)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/stats", stats)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- orchestration ---------------------------------------------------------------------------------------



def write_config(path: Path, upstreams: list[str], hedge: str) -> None:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    text = ""
    for i, url in enumerate(upstreams):
        text += f"""
[[providers]]
id = "up{i}"
kind = "openai_compat"
base_url = "{url}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
max_connections = 1000
timeouts = {{ connect_s = 5.0, first_byte_s = 10.0, total_s = 30.0 }}

[[routes]]
model = "bench-{i}"
provider = "up{i}"
upstream_model = "bench-model"
info = {{ context_window = 128000, max_output_tokens = 8192, quality = 0.8, latency_ms = 60.0 }}
prices = {{ input_per_mtok = 1.0, output_per_mtok = 4.0 }}
"""
    path.write_text(text + f"""
[circuit]
probe = false

[[api_keys]]
name = "bench"
sha256 = "{digest}"
{hedge}""")



@dataclass
class Result:
    label: str
    sent: int
    ok: int
    lat: list[float]
    upstream_calls: int
    upstream_slow: int

    def row(self) -> str:
        p = self.lat
        per = self.upstream_calls / max(self.sent, 1)
        return (f"{self.label:8} {self.sent:6} {self.sent - self.ok:6} {percentile(p, 0.5):8.1f} "
                f"{percentile(p, 0.9):8.1f} {percentile(p, 0.99):8.1f} {max(p, default=float('nan')):8.1f} "
                f"{self.upstream_calls:7} {per:8.3f} {self.upstream_slow:6}")


def upstream_stats(upstreams: list[str]) -> tuple[int, int]:
    n = slow = 0
    for u in upstreams:
        st = httpx.get(f"{u}/stats", timeout=5).json()
        n += st["n"]
        slow += st["slow"]
    return n, slow



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per gateway")
    ap.add_argument("--rate", type=float, default=100.0, help="offered rate (requests/s)")
    ap.add_argument("--after-ms", type=float, default=150.0, help="the hedge delay (after_ms)")
    ap.add_argument("--warmup", type=int, default=50, help="requests per gateway before measuring")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds (requests/rounds each)")
    ap.add_argument("--serve-upstream", nargs=2, type=int, metavar=("PORT", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream[0], args.serve_upstream[1], 50.0, (2.0, 5.0), 0.05)
        return

    tmp = Path(tempfile.mkdtemp(prefix="ethen-bench-hedging-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}

    def spawn(cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(tmp / log, "wb") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
        procs.append(p)
        return p

    try:
        upstreams = []
        for seed in (1, 2):
            port = free_port()
            p = spawn([sys.executable, __file__, "--serve-upstream", str(port), str(seed)], f"up{seed}.log")
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/stats", p, 30)
            upstreams.append(url)
        hedge = f'\n[[hedges]]\nalias = "ethen/fast"\nafter_ms = {args.after_ms}\nmax_extra = 1\n'
        gateways: dict[str, str] = {}
        for label, extra in (("plain", ""), ("hedged", hedge)):
            write_config(tmp / f"{label}.toml", upstreams, extra)
            port = free_port()
            p = spawn([sys.executable, "-m", "ethen", "gateway", "--config", str(tmp / f"{label}.toml"),
                       "--port", str(port)], f"{label}.log")
            base = f"http://127.0.0.1:{port}/api/gateway/v1"
            wait_ready(f"{base}/healthz", p, 60)
            gateways[label] = base
        for base in gateways.values():
            load(f"{base}/chat/completions", args.warmup, args.rate)
        time.sleep(6)  # the warm-up's slow calls end
        results = {label: Result(label, 0, 0, [], 0, 0) for label in gateways}
        per_round = args.requests // args.rounds
        p50s: dict[str, list[float]] = {label: [] for label in gateways}
        for k in range(args.rounds):  # alternate the order, so drift on the shared machine hits both
            for label in (list(gateways) if k % 2 == 0 else list(reversed(gateways))):
                n0, s0 = upstream_stats(upstreams)
                ok, lat = load(f"{gateways[label]}/chat/completions", per_round, args.rate)
                time.sleep(5.5)  # calls still running upstream (a cancelled loser counts when received)
                n1, s1 = upstream_stats(upstreams)
                r = results[label]
                r.sent += per_round
                r.ok += ok
                r.lat.extend(lat)
                r.upstream_calls += n1 - n0
                r.upstream_slow += s1 - s0
                p50s[label].append(percentile(lat, 0.5))
        print(f"\nhedging bench: {args.requests} requests per gateway at {args.rate:g} rps (open loop), "
              f"2 upstreams: 95% 50 ms, 5% 2-5 s; hedge after_ms = {args.after_ms:g}, max_extra = 1")
        print(f"{'gateway':8} {'sent':>6} {'errors':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'max ms':>8} {'calls':>7} {'calls/req':>8} {'slow':>6}")
        for r in results.values():
            print(r.row())
        for label, xs in p50s.items():
            print(f"p50 per round, {label}: {', '.join(f'{x:.1f}' for x in xs)} ms")
        plain, hedged = results["plain"], results["hedged"]
        p99 = percentile(hedged.lat, 0.99) / percentile(plain.lat, 0.99)
        p50 = percentile(hedged.lat, 0.5) / percentile(plain.lat, 0.5)
        calls = hedged.upstream_calls / max(plain.upstream_calls, 1)
        print(f"\nhedged/plain: p99 x{p99:.3f} (target <= 0.2), p50 x{p50:.3f} (target ~1), "
              f"upstream calls x{calls:.3f} (target <= 1.10)")
        counts = counter_by_outcome(gateways["hedged"], "ethen_gateway_hedges_total")
        print(f"ethen_gateway_hedges_total (hedged gateway, warm-up included): {counts}")
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
