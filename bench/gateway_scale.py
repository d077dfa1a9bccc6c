"""Gateway at scale (issue 11): requests/s and p50/p99 overhead of one ``ethen gateway`` without a store, with
a store and a budgeted key (SQLite, and Postgres when given), and ``--workers 2`` on Postgres + Redis, in one
run, in front of the same scripted upstream (``tests/gateway/upstream.py``, fixed latency).

Load: ``bench/gateway_overhead.py``'s open-loop generator (aiohttp + uvloop in this process; request i
leaves at ``start + i / rate`` and its latency counts from then). Overhead = the gateway's latency percentile
minus the direct-to-upstream percentile at the same offered rate. Max rate = the highest rung of the ladder
sustained with every request 200, achieved >= 95 % of offered and p99 < 1 s. Budgeted targets use a key of
a project with a large day budget (every request authenticates, holds budget and settles into the ledger); the
``--workers 2`` target also has a ``[shared]`` Redis and an RPM limit far above the load on its project, so
each request also runs the rate-limit script.

Everything (load generator, upstream, gateways, databases) shares this machine's cores: a second worker
competes with the load generator, so ``--workers 2`` shows what one host gains, not what two hosts would.

Run:  .venv/bin/python bench/gateway_scale.py [--pg URL] [--redis URL] [--rates 100,300] [--duration 5]
(``--pg`` defaults to ``$ETHEN_TEST_PG_URL``, ``--redis`` to ``$ETHEN_TEST_REDIS_URL``; see
``.ci/postgres.sh`` and ``.ci/redis.sh``.)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import Result, Target, free_port, run_open_loop, settle, wait_ready

ROOT = Path(__file__).resolve().parent.parent
CLIENT_KEY = "ethen-bench-scale-0123456789abcdef0123"
BODY = json.dumps({"model": "ethen/auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})


def project_key(url: str, rpm: int | None = None) -> tuple[str, str]:
    """(key, project name) of a new project with a large day budget in the store at ``url``."""
    from ethen.store import Store

    async def go() -> tuple[str, str]:
        st = await Store.open(url)
        try:
            name = f"bench{uuid.uuid4().hex[:8]}"
            await st.create_project(name, budget_usd=1e6, budget_window="day")
            key, _ = await st.create_key(name)
            return key, name
        finally:
            await st.aclose()

    return asyncio.run(go())


def write_config(path: Path, upstream: str, store: str | None = None, redis: str | None = None,
                 project: str | None = None) -> None:
    routes = "".join(f"""
[[routes]]
model = "bench-model-{i}"
provider = "up"
upstream_model = "bench-model"
info = {{ context_window = 128000, max_output_tokens = 8192, supports_tools = true, quality = {q} }}
prices = {{ input_per_mtok = {p}, output_per_mtok = {p * 4} }}
""" for i, (q, p) in enumerate(((0.6, 0.5), (0.7, 1.0), (0.8, 3.0))))
    text = f"""
[[providers]]
id = "up"
kind = "openai_compat"
base_url = "{upstream}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
max_connections = 1000
timeouts = {{ connect_s = 5.0, first_byte_s = 10.0, total_s = 30.0 }}
{routes}
[[api_keys]]
name = "bench"
sha256 = "{hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}"
"""
    if store:
        text += f'\n[store]\nurl = "{store}"\n'
    if redis:
        text += f'\n[shared]\nredis_url = "{redis}"\nkey_prefix = "bench{uuid.uuid4().hex[:6]}"\n'
    if redis and project:
        text += f"\n[rate_limits.projects.{project}]\nrpm = 10000000\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rates", default="100,300", help="offered rates (RPS) for the overhead figures")
    ap.add_argument("--ladder", default="200,400,600,800,1000,1200", help="rates for the max-rate search")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--ladder-duration", type=float, default=4.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--pg", default=os.environ.get("ETHEN_TEST_PG_URL"), help="Postgres URL (optional)")
    ap.add_argument("--redis", default=os.environ.get("ETHEN_TEST_REDIS_URL"), help="Redis URL (for c)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    ladder = [int(r) for r in args.ladder.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ethen-scale-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, env=env, stdout=(tmp / log).open("wb"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    def gateway(name: str, cfg: Path, workers: int = 1) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        cmd = [sys.executable, "-m", "ethen", "gateway", "--config", str(cfg), "--port", str(port)]
        p = spawn(cmd + (["--workers", str(workers)] if workers > 1 else []), f"{name}.log")
        base = f"http://127.0.0.1:{port}/api/gateway/v1"
        wait_ready(f"{base}/healthz", p, 120)
        return base, p

    results: dict[str, dict[str, object]] = {}
    try:
        up_port = free_port()
        up = spawn([sys.executable, str(ROOT / "tests/gateway/upstream.py"), "--port", str(up_port),
                    "--latency-ms", str(args.latency_ms)], "upstream.log")
        upstream = f"http://127.0.0.1:{up_port}"
        wait_ready(f"{upstream}/v1/models", up, 30)
        direct = Target("direct", f"{upstream}/v1/chat/completions", {"authorization": "Bearer sk-bench"},
                        BODY.replace("ethen/auto", "bench-model"))
        targets: list[tuple[str, Path, dict[str, str], int, subprocess.Popen[bytes] | None]] = []

        def add(name: str, store: str | None, redis: str | None = None, workers: int = 1) -> None:
            key, project = (CLIENT_KEY, None) if store is None else project_key(store)
            cfg = tmp / f"{name}.toml"
            write_config(cfg, upstream, store, redis, project)
            targets.append((name, cfg, {"authorization": f"Bearer {key}"}, workers, None))

        add("a: 1 process, no store", None)
        add("b: 1 process, SQLite store, budgeted key", f"sqlite:///{tmp / 'b.db'}")
        if args.pg:
            add("b: 1 process, Postgres store, budgeted key", args.pg)
        if args.redis:
            store = args.pg or f"sqlite:///{tmp / 'c.db'}"
            db = "Postgres" if args.pg else "SQLite (no --pg)"
            add(f"c: --workers 2, {db} + Redis, budgeted + rate-limited key", store, args.redis, 2)
        else:
            print("(c) skipped: no --redis / ETHEN_TEST_REDIS_URL", file=sys.stderr)

        def measure(t: Target, rate: int, duration: float) -> Result:
            settle(t, 60)
            return run_open_loop(t, rate, duration)

        base_direct = {r: measure(direct, r, args.duration) for r in rates}
        for name, cfg, headers, workers, _ in targets:
            base, proc = gateway(name.split(":")[0], cfg, workers)
            t = Target(name, f"{base}/chat/completions", headers, BODY)
            row: dict[str, object] = {}
            for r in rates:
                res = measure(t, r, args.duration)
                d = base_direct[r]
                row[f"{r} rps"] = {
                    "ok": f"{res.ok}/{res.sent}",
                    "p50_overhead_ms": round(res.p50_ms - d.p50_ms, 2),
                    "p99_overhead_ms": round(res.p99_ms - d.p99_ms, 2),
                }
            best = 0
            for r in ladder:
                res = measure(t, r, args.ladder_duration)
                if not res.sustained:
                    break
                best = r
            row["max_sustained_rps"] = best
            results[name] = row
            print(json.dumps({name: row}), flush=True)
            proc.terminate()
            proc.wait(30)
            procs.remove(proc)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    print("\n| target | " + " | ".join(f"p50 / p99 overhead @ {r} rps (ms)" for r in rates) + " | max rps |")
    print("|---|" + "---|" * (len(rates) + 1))
    for name, row in results.items():
        cells = [f"{row[f'{r} rps']['p50_overhead_ms']} / {row[f'{r} rps']['p99_overhead_ms']}"  # type: ignore[index]
                 for r in rates]
        print(f"| {name} | " + " | ".join(cells) + f" | {row['max_sustained_rps']} |")
    print(f"(direct upstream p50 at {rates[0]} rps: {base_direct[rates[0]].p50_ms:.2f} ms; "
          f"{time.strftime('%Y-%m-%d')})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
