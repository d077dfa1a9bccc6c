"""Own machines first, the cloud for the overflow (issue 44): open-loop load on ``ethen/cheap`` over a real
mesh plus a scripted cloud upstream, routing with the capacity signal against three baselines in the same run.
Not a timed test.

.venv/bin/python bench/spillover.py [--step-seconds 60] [--steps 0.5,1,2,3,5] [--target-ms 1000]
                                    [--modes capacity,no-signal,mesh-only,cloud-only] [--calibrate-seconds 20]

* **Mesh**: three ``ethen worker`` processes (SmolLM2-135M, layers 0-9 / 10-19 / 20-29, started with the
  launcher ``ethen up`` uses), the gateway in this process (its orchestrator, as ``ethen up`` runs it) on
  127.0.0.1. **Cloud**: the scripted upstream of the tests on 127.0.0.1: 300 ms to its first token, then 64
  tokens 10 ms apart, priced 1 / 4 USD per million input / output tokens.
* **Modes** (a fresh gateway each, same workers and upstream): ``capacity`` (this issue: the capacity
  snapshot plus ``[[wait_targets]] alias = "ethen/cheap", max_wait_ms = --target-ms``), ``no-signal`` (the
  same config, the capacity snapshot empty: the wait target judges the past averages only), ``mesh-only``
  and ``cloud-only`` (one route each).
* **Load**: the mesh's capacity is measured first (``mesh-only``, 8 closed-loop streams for
  ``--calibrate-seconds``: completed requests per second); each step sends ``step x capacity`` requests per
  second, open loop (request i leaves at i / rate whatever the others do; its times count from then), for
  ``--step-seconds``, streaming, ``max_tokens`` 32-128 (seeded), from a separate client process (so the load
  generator does not share the gateway's interpreter).
* **Printed per step and mode**: p50 / p99 TTFT and latency (ms, successful requests), the share served by
  each provider, the cost (usage x prices), the 5xx count (and transport failures), and for ``capacity`` the
  cost ratio to the ideal: the cloud paid for exactly the load beyond the mesh's capacity
  (``max(0, 1 - capacity / rate)`` of the requests at the cloud's mean cost per request of ``cloud-only``).

Targets (issue 44): at 5x, p99 TTFT <= 2x its value at 0.5x and 0 failures; cost <= 1.15x the ideal; at 0.5x,
0 % to the cloud.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
CLOUD_MODEL = "cloud-mini"
PRICE_IN, PRICE_OUT = 1.0, 4.0  # USD per million tokens, the cloud route
KEY = "ethen-bench-spillover-0123456789abcdef"
PROMPT = "Count from 1 to 200, one number per line."


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q * (len(s) - 1))))]


# --- the client process -------------------------------------------------------------------------------------

async def _one(session: Any, url: str, i: int, intended: float, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {"model": "ethen/cheap", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": PROMPT}]}
    out: dict[str, Any] = {"i": i, "status": 0, "ttft_ms": None, "latency_ms": None, "provider": None,
                           "prompt": 0, "completion": 0}
    clock = time.perf_counter
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}) as r:
            out["status"] = r.status
            if r.status != 200:
                await r.read()
                out["latency_ms"] = (clock() - intended) * 1000
                return out
            ok = False
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    ok = True
                    break
                obj = json.loads(data)
                choices = obj.get("choices") or []
                if out["ttft_ms"] is None and any((c.get("delta") or {}).get("content") for c in choices):
                    out["ttft_ms"] = (clock() - intended) * 1000
                usage = obj.get("usage")
                if usage:
                    out["prompt"], out["completion"] = usage["prompt_tokens"], usage["completion_tokens"]
                routing = (obj.get("ethen") or {}).get("routing")
                if routing:
                    out["provider"] = routing.get("served_provider")
            out["latency_ms"] = (clock() - intended) * 1000
            if not ok:
                out["status"] = -1  # the stream broke
    except (aiohttp.ClientError, TimeoutError, OSError):
        out["latency_ms"] = (clock() - intended) * 1000
    return out


def client_main(url: str, rate: float, seconds: float, seed: int, concurrency: int) -> None:
    """Open loop at ``rate`` for ``seconds`` (``concurrency`` > 0: closed loop of that many instead); one JSON
    line per request on stdout."""
    import aiohttp

    rnd = random.Random(seed)

    async def go() -> list[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4000), timeout=timeout) as s:
            clock = time.perf_counter
            start = clock() + 0.05
            if concurrency > 0:
                results: list[dict[str, Any]] = []

                async def worker(w: int) -> None:
                    n = 0
                    while clock() < start + seconds:
                        results.append(await _one(s, url, w * 10_000 + n, clock(), rnd.randint(32, 128)))
                        n += 1

                await asyncio.gather(*(worker(w) for w in range(concurrency)))
                return results
            tasks = []
            total = max(1, round(rate * seconds))
            for i in range(total):
                intended = start + i / rate
                delay = intended - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(s, url, i, intended, rnd.randint(32, 128))))
            return list(await asyncio.gather(*tasks))

    for rec in asyncio.run(go()):
        print(json.dumps(rec))


def run_client(url: str, rate: float, seconds: float, seed: int,
               concurrency: int = 0) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--client", url, "--rate", str(rate), "--seconds", str(seconds),
           "--seed", str(seed), "--concurrency", str(concurrency)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 600)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


# --- the gateway under test ---------------------------------------------------------------------------------

def _doc(mode: str, upstream: str, workers: dict[str, str], target_ms: float) -> dict[str, Any]:
    from ethen.gateway.accounting.auth import hash_key

    mesh = {"id": "mesh", "kind": "mesh", "workers": workers, "start_timeout_s": 120}
    cloud = {"id": "cloud", "kind": "openai_compat", "base_url": f"{upstream}/v1", "api_key_env": "CLOUD_KEY",
             "max_connections": 256}
    mesh_route = {"model": MODEL, "provider": "mesh"}
    cloud_route = {"model": CLOUD_MODEL, "provider": "cloud", "upstream_model": "up-mini",
                   "info": {"context_window": 128_000, "max_output_tokens": 16_000, "quality": 0.1,
                            "latency_ms": 1000.0, "ttft_ms": 300.0},
                   "prices": {"input_per_mtok": PRICE_IN, "output_per_mtok": PRICE_OUT}}
    doc: dict[str, Any] = {"server": {"host": "127.0.0.1", "port": 0},
                           "api_keys": [{"name": "bench", "sha256": hash_key(KEY)}]}
    if mode == "mesh-only":
        doc |= {"providers": [mesh], "routes": [mesh_route]}
    elif mode == "cloud-only":
        doc |= {"providers": [cloud], "routes": [cloud_route]}
    else:
        doc |= {"providers": [mesh, cloud], "routes": [mesh_route, cloud_route],
                "wait_targets": [{"alias": "ethen/cheap", "max_wait_ms": target_ms}]}
    return doc


class Served:
    """A gateway for one mode, in this process (its orchestrator with it, as ``ethen up`` runs it)."""

    def __init__(self, mode: str, upstream: str, workers: dict[str, str], target_ms: float) -> None:
        from ethen.app import PREFIX, create_app
        from ethen.gateway.config import parse_config
        from ethen.gateway.routing import EMPTY_CAPACITY
        from tests.gateway.upstream import ServerThread

        doc = _doc(mode, upstream, workers, target_ms)
        app = create_app(parse_config(doc), env={"CLOUD_KEY": "sk-bench"})
        self.server = ServerThread(app)
        self.server.__enter__()
        gw = self.server.server.config.app.state.gateway
        if mode == "no-signal":
            gw.capacity = lambda: EMPTY_CAPACITY  # the baseline: no capacity snapshot, past averages only
        self.url = f"{self.server.url}{PREFIX}/chat/completions"

    def close(self) -> None:
        self.server.__exit__(None, None, None)


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if r["status"] == 200]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    lat = [r["latency_ms"] for r in ok]
    by: dict[str, int] = {}
    for r in ok:
        by[r["provider"] or "?"] = by.get(r["provider"] or "?", 0) + 1
    cost = sum((r["prompt"] * PRICE_IN + r["completion"] * PRICE_OUT) / 1e6
               for r in ok if r["provider"] == "cloud")
    return {"n": len(recs), "ok": len(ok), "5xx": sum(1 for r in recs if r["status"] >= 500),
            "broken": sum(1 for r in recs if r["status"] in (0, -1)),
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99),
            "lat_p50": _percentile(lat, 0.5), "lat_p99": _percentile(lat, 0.99),
            "cloud_share": by.get("cloud", 0) / len(ok) if ok else float("nan"), "cost": cost,
            "cloud_cost_per_req": cost / by["cloud"] if by.get("cloud") else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-seconds", type=float, default=60.0)
    ap.add_argument("--steps", default="0.5,1,2,3,5")
    ap.add_argument("--modes", default="capacity,no-signal,mesh-only,cloud-only")
    ap.add_argument("--target-ms", type=float, default=1000.0)
    ap.add_argument("--calibrate-seconds", type=float, default=20.0)
    ap.add_argument("--client")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=0)
    a = ap.parse_args()
    if a.client:
        client_main(a.client, a.rate, a.seconds, a.seed, a.concurrency)
        return

    from ethen.mesh.worker.launch import spawn_worker
    from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app

    steps = [float(x) for x in a.steps.split(",")]
    modes = a.modes.split(",")
    workers = [spawn_worker(f"w{i}", span) for i, span in enumerate(("0-9", "10-19", "20-29"))]
    addresses = {w.node_id: w.address for w in workers}
    pieces = tuple(f" t{i}" for i in range(64))
    script = Script(default=Behavior(ttft_s=0.3, chunk_delay_s=0.01, pieces=pieces, prompt_tokens=20),
                    record=False)
    try:
        with ServerThread(make_upstream_app(script)) as up:
            gw = Served("mesh-only", up.url, addresses, a.target_ms)
            try:
                run_client(gw.url, 1, 3, 0, concurrency=2)  # warm up
                recs = run_client(gw.url, 1, a.calibrate_seconds, 0, concurrency=8)
            finally:
                gw.close()
            done = [r for r in recs if r["status"] == 200]
            capacity = len(done) / a.calibrate_seconds
            print(f"mesh capacity: {capacity:.2f} req/s ({len(done)} streams in {a.calibrate_seconds:g} s, "
                  f"8 concurrent; {len(recs) - len(done)} failed)", flush=True)
            table: dict[tuple[str, float], dict[str, Any]] = {}
            for mode in modes:
                gw = Served(mode, up.url, addresses, a.target_ms)
                try:
                    for k, step in enumerate(steps):
                        s = _summary(run_client(gw.url, step * capacity, a.step_seconds, 100 + k))
                        table[(mode, step)] = s
                        print(f"{mode:>10} {step:>4g}x {step * capacity:6.2f} req/s  n={s['n']:4d}  "
                              f"TTFT p50/p99 {s['ttft_p50']:7.0f}/{s['ttft_p99']:7.0f} ms  "
                              f"latency p50/p99 {s['lat_p50']:7.0f}/{s['lat_p99']:7.0f} ms  "
                              f"cloud {100 * s['cloud_share']:5.1f}%  cost ${s['cost']:.5f}  "
                              f"5xx {s['5xx']}  broken {s['broken']}", flush=True)
                        time.sleep(1.0)
                finally:
                    gw.close()
                threading.Event().wait(1.0)
            _verdict(table, steps, capacity)
    finally:
        for w in workers:
            w.stop()


def _verdict(table: dict[tuple[str, float], dict[str, Any]], steps: list[float], capacity: float) -> None:
    lo, hi = min(steps), max(steps)
    cap_lo, cap_hi = table.get(("capacity", lo)), table.get(("capacity", hi))
    if cap_lo is None or cap_hi is None:
        return
    print(f"capacity, {hi:g}x vs {lo:g}x: p99 TTFT {cap_hi['ttft_p99']:.0f} / {cap_lo['ttft_p99']:.0f} ms = "
          f"{cap_hi['ttft_p99'] / cap_lo['ttft_p99']:.2f}x (target <= 2); failures at {hi:g}x: "
          f"{cap_hi['5xx'] + cap_hi['broken']} (target 0); cloud share at {lo:g}x: "
          f"{100 * cap_lo['cloud_share']:.1f}% (target 0)")
    for step in steps:
        cap, cloud = table.get(("capacity", step)), table.get(("cloud-only", step))
        if cap is None or cloud is None:
            continue
        excess = max(0.0, 1 - 1 / step)  # the share of the requests beyond the mesh's capacity
        ideal = excess * cap["n"] * cloud["cloud_cost_per_req"]
        ratio = cap["cost"] / ideal if ideal > 0 else float("inf") if cap["cost"] > 0 else 1.0
        print(f"cost at {step:g}x: ${cap['cost']:.5f} vs ideal ${ideal:.5f} (the cloud for the "
              f"{100 * excess:.0f}% beyond {capacity:.2f} req/s) = {ratio:.2f}x (target <= 1.15)")


if __name__ == "__main__":
    main()
