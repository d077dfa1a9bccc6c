"""Shadow evaluation benchmark (issue 27): the client's latency with ``[[shadows]]`` at ``percent = 100``
against the same gateway set-up without shadows, measured in one run.

Set-up (all on 127.0.0.1, each server its own process):
- one scripted OpenAI-compatible upstream (this file, ``--serve-upstream``) serving two models: the primary
  (``--primary-ms``, default 40 ms) and the shadow candidate (``--shadow-ms``, default 400 ms: a slow
  candidate, ten times the primary's latency, so shadow calls pile up behind the client's answers);
- two ethen gateways, each with its own SQLite store and the same two routes (the primary ranks first for
  ``ethen/fast``): ``plain`` without shadows, ``shadowed`` with ``[[shadows]] alias = "ethen/fast"``,
  ``candidate`` the slow route, ``percent = 100``, ``max_in_flight`` (default 64) and a project
  ``shadow-evals`` (no budget) created through the admin API;
- open-loop load in this process (aiohttp + uvloop): request i leaves at ``start + i / rate``, its latency
  counts from then. The gateways are measured in alternating rounds (``--rounds``, default 4, order flipped
  each round, so drift on a shared machine hits both), the same number of requests at the same rate.

Printed: per gateway p50 / p90 / p99 / max (ms) and errors; the per-round p50s and their median; the ratios
shadowed / plain (p50 of medians, p99 of all); the shadowed gateway's ``ethen_gateway_shadows_total`` and how
many pairs it recorded.

Run:  .venv/bin/python bench/shadow.py [--requests 2000] [--rate 100] [--shadow-ms 400]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
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
CLIENT_KEY = "ethen-bench-shadow-0123456789abcdef0123456789"
ADMIN_KEY = "admin-bench-shadow-0123456789abcdef"
UPSTREAM_KEY = "sk-bench-shadow"
BODY = json.dumps({"model": "ethen/fast", "messages": [{"role": "user", "content": "Say hello"}],
                   "max_tokens": 16}).encode()
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"}


def load(url: str, total: int, rate: float) -> tuple[int, list[float]]:
    """Open loop (benchkit.open_loop): the number of 200s and their latencies (ms)."""
    lat = ok_latencies(open_loop(url, BODY, total, rate, lambda i: HEADERS))
    return len(lat), lat



# --- the upstream (its own process) ---------------------------------------------------------------------


def serve_upstream(port: int, primary_ms: float, shadow_ms: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    calls = {"primary": 0, "shadow": 0}

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        shadow = body["model"] == "shadow-model"
        calls["shadow" if shadow else "primary"] += 1
        await asyncio.sleep((shadow_ms if shadow else primary_ms) / 1000)
        msg = {"role": "assistant", "content": "Hello there!" if shadow else "Hello!"}
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



def write_config(path: Path, upstream: str, db: Path, shadows: str) -> None:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    admin = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    path.write_text(f"""
[[providers]]
id = "up"
kind = "openai_compat"
base_url = "{upstream}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
max_connections = 1000
timeouts = {{ connect_s = 5.0, first_byte_s = 10.0, total_s = 30.0 }}

[[routes]]
model = "primary"
provider = "up"
upstream_model = "primary-model"
info = {{ context_window = 128000, max_output_tokens = 8192, quality = 0.9, latency_ms = 40.0 }}
prices = {{ input_per_mtok = 1.0, output_per_mtok = 4.0 }}

[[routes]]
model = "candidate"
provider = "up"
upstream_model = "shadow-model"
info = {{ context_window = 128000, max_output_tokens = 8192, quality = 0.1, latency_ms = 20000.0 }}
prices = {{ input_per_mtok = 10.0, output_per_mtok = 40.0 }}

[circuit]
probe = false

[store]
url = "sqlite:///{db}"
admin_key_sha256 = "{admin}"

[[api_keys]]
name = "bench"
sha256 = "{digest}"
{shadows}""")


@dataclass
class Result:
    label: str
    sent: int
    ok: int
    lat: list[float]

    def row(self) -> str:
        p = self.lat
        return (f"{self.label:9} {self.sent:6} {self.sent - self.ok:6} {percentile(p, 0.5):8.2f} "
                f"{percentile(p, 0.9):8.2f} {percentile(p, 0.99):8.2f} {max(p, default=float('nan')):8.2f}")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per gateway")
    ap.add_argument("--rate", type=float, default=100.0, help="offered rate (requests/s)")
    ap.add_argument("--primary-ms", type=float, default=40.0, help="the primary upstream's latency")
    ap.add_argument("--shadow-ms", type=float, default=400.0, help="the shadow candidate's latency")
    ap.add_argument("--max-in-flight", type=int, default=64, help="[[shadows]] max_in_flight")
    ap.add_argument("--warmup", type=int, default=100, help="requests per gateway before measuring")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds (requests/rounds each)")
    ap.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.primary_ms, args.shadow_ms)
        return

    tmp = Path(tempfile.mkdtemp(prefix="ethen-bench-shadow-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}

    def spawn(cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(tmp / log, "wb") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
        procs.append(p)
        return p

    try:
        port = free_port()
        up = spawn([sys.executable, __file__, "--serve-upstream", str(port), "--primary-ms",
                    str(args.primary_ms), "--shadow-ms", str(args.shadow_ms)], "up.log")
        upstream = f"http://127.0.0.1:{port}"
        wait_ready(f"{upstream}/stats", up, 30)
        shadow = (f'\n[[shadows]]\nalias = "ethen/fast"\ncandidate = "up/candidate"\npercent = 100\n'
                  f'project = "shadow-evals"\nmax_in_flight = {args.max_in_flight}\n')
        gateways: dict[str, str] = {}
        for label, extra in (("plain", ""), ("shadowed", shadow)):
            write_config(tmp / f"{label}.toml", upstream, tmp / f"{label}.db", extra)
            gport = free_port()
            p = spawn([sys.executable, "-m", "ethen", "gateway", "--config", str(tmp / f"{label}.toml"),
                       "--port", str(gport)], f"{label}.log")
            root = f"http://127.0.0.1:{gport}"
            wait_ready(f"{root}/api/gateway/v1/healthz", p, 60)
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            r = httpx.post(f"{root}/api/admin/v1/projects", json={"name": "shadow-evals"}, headers=admin)
            assert r.status_code == 201, r.text
            gateways[label] = root
        for root in gateways.values():
            load(f"{root}/api/gateway/v1/chat/completions", args.warmup, args.rate)
        time.sleep(2 + args.shadow_ms / 1000)  # the warm-up's shadow calls end
        results = {label: Result(label, 0, 0, []) for label in gateways}
        per_round = args.requests // args.rounds
        p50s: dict[str, list[float]] = {label: [] for label in gateways}
        for k in range(args.rounds):  # alternate the order, so drift on the shared machine hits both
            for label in (list(gateways) if k % 2 == 0 else list(reversed(gateways))):
                ok, lat = load(f"{gateways[label]}/api/gateway/v1/chat/completions", per_round, args.rate)
                time.sleep(1 + args.shadow_ms / 1000)  # the round's shadow calls end before the next round
                r = results[label]
                r.sent += per_round
                r.ok += ok
                r.lat.extend(lat)
                p50s[label].append(percentile(lat, 0.5))
        print(f"\nshadow bench: {args.requests} requests per gateway at {args.rate:g} rps (open loop, "
              f"{args.rounds} alternating rounds); primary upstream {args.primary_ms:g} ms, shadow candidate "
              f"{args.shadow_ms:g} ms; shadowed: percent = 100, max_in_flight = {args.max_in_flight}")
        print(f"{'gateway':9} {'sent':>6} {'errors':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'max ms':>8}")
        for r in results.values():
            print(r.row())
        med = {label: statistics.median(xs) for label, xs in p50s.items()}
        for label, xs in p50s.items():
            print(f"p50 per round, {label}: {', '.join(f'{x:.2f}' for x in xs)} ms (median {med[label]:.2f})")
        plain, shadowed = results["plain"], results["shadowed"]
        p99 = percentile(shadowed.lat, 0.99) / percentile(plain.lat, 0.99)
        print(f"\nshadowed/plain: p50 (median of rounds) x{med['shadowed'] / med['plain']:.3f}, "
              f"p99 x{p99:.3f}")
        counts = counter_by_outcome(f"{gateways['shadowed']}/api/gateway/v1", "ethen_gateway_shadows_total")
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        summary = httpx.get(f"{gateways['shadowed']}/api/admin/v1/shadows", params={"limit": 1},
                            headers=admin, timeout=30).json()["data"][0]["summary"]
        print(f"ethen_gateway_shadows_total (shadowed gateway, warm-up included): {counts}")
        print(f"pairs recorded: {summary['n']} (success {summary['success_rate']}, latency ratio "
              f"{summary['latency_ratio']}, cost ratio {summary['cost_ratio']})")
        print(f"upstream calls: {httpx.get(f'{upstream}/stats', timeout=5).json()}")
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
