"""The gateway's own overhead at two git revisions, in one run: did a change grow the hot path?

    .venv/bin/python bench/gateway_versions.py BASE_REV [--rounds 5] [--requests 300]
        [--store sqlite|postgresql://...] [--store-option 'postgres_synchronous_commit = "off"']

Issue 14 asks that the request log, metrics and tracing grow the gateway's p50 overhead by at most 0.1 ms.
``bench/gateway_overhead.py`` runs one gateway, so this script runs two: the working tree's and ``BASE_REV``
checked out into a temporary ``git worktree`` (imported from there), both with the same config (no store, a
config key), in front of one scripted upstream (``tests/gateway/upstream.py``, 20 ms). They are measured in
alternating rounds (``--rounds``) of ``--requests`` requests from 4 concurrent clients, so a load change hits
both alike. Printed per revision: the median of the gateway's self-reported overhead (``x-ethen-overhead-ms``:
time in the gateway minus the upstream's time, which the load generator's own delays do not touch) and of the
client-side latency, and the difference between the two revisions.

With ``--store`` both gateways get a ``[store]`` (``sqlite``: a database file each; a Postgres URL: that
database, shared) and each its own project with a large day budget and its key, so every request reserves,
settles and commits a ledger entry; ``--store-option`` lines are added to the ``[store]`` section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import free_port, wait_ready
from gateway_scale import BODY, CLIENT_KEY, project_key, write_config

ROOT = Path(__file__).resolve().parent.parent


async def load(url: str, n: int, conc: int = 4, key: str = CLIENT_KEY) -> tuple[float, float]:
    """(median self-reported overhead, median client latency), ms, of ``n`` requests."""
    overhead: list[float] = []
    latency: list[float] = []
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=30) as client:
        async def worker(k: int) -> None:
            for _ in range(k):
                t = time.perf_counter()
                r = await client.post(url, content=BODY, headers=headers)
                latency.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
                overhead.append(float(r.headers["x-ethen-overhead-ms"]))

        await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
    return statistics.median(overhead), statistics.median(latency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("base", help="the git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--store", default=None, help="sqlite (a file per revision) or a Postgres URL")
    ap.add_argument("--store-option", action="append", default=[], help="a line for the [store] section")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ethen-versions-"))
    tree = tmp / "base"
    git = ["git", "-C", str(ROOT), "worktree"]
    subprocess.run([*git, "add", "-q", "--detach", str(tree), args.base], check=True)
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        upstream_cmd = [sys.executable, str(ROOT / "tests/gateway/upstream.py"), "--port", str(up_port),
                        "--latency-ms", "20"]
        procs.append(subprocess.Popen(upstream_cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        upstream = f"http://127.0.0.1:{up_port}"
        wait_ready(f"{upstream}/v1/models", procs[0], 30)
        urls: dict[str, str] = {}
        keys: dict[str, str] = {}
        for i, (name, src) in enumerate((("working tree", ROOT), (f"base {args.base}", tree))):
            cfg = tmp / f"gateway-{i}.toml"
            keys[name] = CLIENT_KEY
            if args.store is None:
                write_config(cfg, upstream)
            else:
                store = f"sqlite:///{tmp / f'store-{i}.db'}" if args.store == "sqlite" else args.store
                keys[name], project = project_key(store)
                write_config(cfg, upstream, store, project=project)
                cfg.write_text(cfg.read_text() + "".join(f"{line}\n" for line in args.store_option))
            port = free_port()
            boot = (f"import sys; sys.path.insert(0, {str(src)!r}); sys.argv[0] = 'ethen'; "
                    "from ethen.cli import main; main()")
            cmd = [sys.executable, "-c", boot, "gateway", "--config", str(cfg), "--port", str(port)]
            p = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=(tmp / f"{port}.log").open("wb"),
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            wait_ready(f"http://127.0.0.1:{port}/api/gateway/v1/healthz", p, 120)
            urls[name] = f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions"
        for name, url in urls.items():
            asyncio.run(load(url, 40, key=keys[name]))  # warm-up
        own: dict[str, list[float]] = {k: [] for k in urls}
        client: dict[str, list[float]] = {k: [] for k in urls}
        for _ in range(args.rounds):
            for name, url in urls.items():
                o, c = asyncio.run(load(url, args.requests, key=keys[name]))
                own[name].append(o)
                client[name].append(c)
        print(f"medians of {args.rounds} alternating rounds of {args.requests} requests (4 clients), "
              f"load average {os.getloadavg()[0]:.2f}")
        for name in urls:
            print(f"  {name:32s} self-reported overhead p50 {statistics.median(own[name]):.3f} ms   "
                  f"client p50 {statistics.median(client[name]):.2f} ms")
        new, base = (statistics.median(own[k]) for k in urls)
        print(f"working tree - base: {new - base:+.3f} ms of self-reported p50 overhead")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        subprocess.run([*git, "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
