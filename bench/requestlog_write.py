"""The request log's database writes (issue 11): CPU per logged row, before and after the raw inserts.

The gateway's log writer hands each batch to the ledger writer's transaction runner
(``ethen.store.groupcommit.GroupCommit.transaction``: on SQLite its dedicated thread and pysqlite
connection; on Postgres a pooled asyncpg connection). This runs the same runner on a fresh store and
measures, in one run and on the same rows (``bench/dashboard_pages.py``'s: 1-2 attempts, a receipt with a
4-candidate chain), the process's CPU time (all threads: ``time.process_time``) and wall time per row of:

- **before**: what the writer did until now, SQLAlchemy Core's ``conn.execute(request_log.insert(), rows)``
  with the JSON columns serialized by SQLAlchemy (the log rows only: there was no attempts table);
- **now**: ``ethen.store.requests.insert_requests`` with rows encoded by ``encode_row`` (JSON serialized
  once, as the writer does it) and inserted raw: the log rows and their ``request_attempts`` rows.

and, to see what the attempts table costs, **now, no attempts** (the raw inserts of the log rows alone). At
batch sizes 5, 25 and 500 rows: the writer's batches at ~100 requests/s when it lingers 50 ms (5) or 250 ms
(25) after a write, and its largest (500); a batch's fixed cost (transaction, commit, thread hop) is shared
by its rows.
Postgres too when ``--pg-url`` or ``ETHEN_TEST_PG_URL`` names a server (a fresh database is made and
dropped there).

With ``--gateway-before DIR`` (a checkout of the code before, e.g. ``git worktree add /tmp/before <commit>``),
the same run also measures whole gateways: the scripted upstream (20 ms), and two ``ethen gateway``
processes with a SQLite store and a budgeted project key, one from ``DIR`` (before) and one from
``--gateway-now DIR`` (default: this checkout), each offered ``--gateway-rate`` requests/s open-loop for
``--gateway-s`` seconds, alternated for ``--rounds`` rounds; the figure is each gateway process's CPU ms
per request (``/proc``, all threads, including the log writer's batches written within 1 s after the load).

Run:  .venv/bin/python bench/requestlog_write.py [--rows 5000] [--rounds 5] [--pg-url URL]
        [--gateway-before /tmp/before --gateway-rate 100 --gateway-s 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dashboard_pages import rows as bench_rows

from ethen.store import Store
from ethen.store.groupcommit import GroupCommit
from ethen.store.requests import EncodedRow, encode_row, insert_requests, request_log


def _old_insert(rows: Sequence[dict[str, Any]]) -> Callable[[Any], None]:
    def fn(conn: Any) -> None:
        conn.execute(request_log.insert(), [dict(r) for r in rows])
    return fn


def _no_attempts(row: dict[str, Any]) -> EncodedRow:
    return EncodedRow(encode_row(row).values, ())


WAYS = ("before", "now", "now, no attempts")


async def measure(url: str, rows: list[dict[str, Any]], batch: int, rounds: int) -> dict[str, list[float]]:
    """Per way: CPU µs per row and wall µs per row, one sample per round (all rows per round)."""
    st = await Store.open(url)
    gc = GroupCommit(st, "bench", lambda b: None, lambda b: None)
    gc.start()
    out: dict[str, list[float]] = {f"{w} {k}": [] for w in WAYS for k in ("cpu", "wall")}
    try:
        for _ in range(rounds):
            for way in WAYS:  # alternated, so all see the same machine load
                c0, w0 = time.process_time(), time.perf_counter()
                for i in range(0, len(rows), batch):
                    part = rows[i:i + batch]
                    if way == "before":
                        await gc.transaction(_old_insert(part), "bench before")
                    elif way == "now":
                        await insert_requests(st, [encode_row(r) for r in part], gc.transaction)
                    else:
                        await insert_requests(st, [_no_attempts(r) for r in part], gc.transaction)
                out[f"{way} cpu"].append((time.process_time() - c0) * 1e6 / len(rows))
                out[f"{way} wall"].append((time.perf_counter() - w0) * 1e6 / len(rows))
    finally:
        await gc.aclose()
        await st.aclose()
    return out


@contextmanager
def stores(pg_url: str | None) -> Iterator[list[tuple[str, str]]]:
    tmp = Path(tempfile.mkdtemp(prefix="ethen-logwrite-"))
    out = [("sqlite", f"sqlite:///{tmp / 'log.db'}")]
    if not pg_url:
        yield out
        return
    from tests.pgdb import fresh_pg_database  # created for the run, dropped after (retrying an autovacuum)

    with fresh_pg_database(pg_url) as url:
        yield [*out, ("postgres", url)]


_KEY = """
import asyncio, sys, time
from ethen.store import Store
async def go():
    st = await Store.open(sys.argv[1])
    try:
        await st.create_project("bench", budget_usd=1e6, budget_window="day")
        print((await st.create_key("bench"))[0])
    finally:
        await st.aclose()
asyncio.run(go())
"""


def gateways(
    before: Path, now: Path | None, rate: int, seconds: float, rounds: int
) -> dict[str, list[float]]:
    """CPU ms per request of a store-backed gateway from ``before`` and from ``now`` (default: this checkout),
    alternated."""
    import json
    import subprocess

    from dashboard_pages import cpu_ms
    from gateway_overhead import Target, free_port, run_open_loop, wait_ready, write_ethen_config

    root = Path(__file__).resolve().parent.parent
    tmp = Path(tempfile.mkdtemp(prefix="ethen-logwrite-gw-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        up = subprocess.Popen([sys.executable, str(root / "tests/gateway/upstream.py"), "--port", str(port),
                               "--latency-ms", "20"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
        procs.append(up)
        upstream = f"http://127.0.0.1:{port}"
        wait_ready(f"{upstream}/v1/models", up, 30)
        targets: list[tuple[str, Target, int]] = []
        for label, tree in (("before", before.resolve()), ("now", (now or root).resolve())):
            tree_env = {**env, "PYTHONPATH": str(tree)}
            url = f"sqlite:///{tmp / label}.db"
            key = subprocess.run([sys.executable, "-c", _KEY, url], env=tree_env, cwd=tree, check=True,
                                 capture_output=True, text=True).stdout.strip()
            write_ethen_config(tmp / f"{label}.toml", upstream, url)
            gw_port = free_port()
            cmd = [sys.executable, "-m", "ethen", "gateway", "--config", str(tmp / f"{label}.toml"),
                   "--port", str(gw_port)]
            p = subprocess.Popen(cmd, env=tree_env, cwd=tree, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            base = f"http://127.0.0.1:{gw_port}/api/gateway/v1"
            wait_ready(f"{base}/healthz", p, 120)
            body = json.dumps({"model": "ethen/auto", "messages": [{"role": "user", "content": "Say hello"}]})
            auth = {"Authorization": f"Bearer {key}"}
            targets.append((label, Target(label, f"{base}/chat/completions", auth, body), p.pid))
        out: dict[str, list[float]] = {"before": [], "now": []}
        for _, t, _ in targets:  # warm-up
            run_open_loop(t, rate, 1.0)
        for _ in range(rounds):
            for label, t, pid in targets:
                time.sleep(1.0)
                c0 = cpu_ms(pid)
                r = run_open_loop(t, rate, seconds)
                time.sleep(1.0)  # the log writer's last batches
                assert r.ok == r.sent, (label, r)
                out[label].append((cpu_ms(pid) - c0) / r.sent)
        return out
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pg-url", default=os.environ.get("ETHEN_TEST_PG_URL"))
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[5, 25, 500])
    ap.add_argument("--gateway-before", type=Path, default=None, help="a checkout of the code before")
    ap.add_argument("--gateway-now", type=Path, default=None, help="the code after (default: this checkout)")
    ap.add_argument("--gateway-rate", type=int, default=100)
    ap.add_argument("--gateway-s", type=float, default=8.0)
    args = ap.parse_args()
    data = bench_rows(args.rows, 3000.0, random.Random(11))
    print(f"{args.rows} rows per round, {args.rounds} rounds, the ways alternated; CPU µs per row of the "
          f"whole process (all threads), median (min); wall µs per row, median")
    print(f"{'store':<9} {'batch':>5} {'before (SA Core)':>16} {'now (raw)':>16} {'ratio':>6} "
          f"{'now, no attempts':>16} {'wall before':>12} {'wall now':>9}")
    with stores(args.pg_url) as urls:
        for name, url in urls:
            for batch in args.batches:
                r = asyncio.run(measure(url, data, batch, args.rounds))

                def fmt(k: str, r: dict[str, list[float]] = r) -> str:
                    return f"{statistics.median(r[k]):7.1f} ({min(r[k]):5.1f})"

                ratio = statistics.median(r["now cpu"]) / statistics.median(r["before cpu"])
                print(f"{name:<9} {batch:>5} {fmt('before cpu'):>16} {fmt('now cpu'):>16} {ratio:6.2f} "
                      f"{fmt('now, no attempts cpu'):>16} {statistics.median(r['before wall']):12.1f} "
                      f"{statistics.median(r['now wall']):9.1f}", flush=True)
    if not args.pg_url:
        print("postgres: skipped (no --pg-url / ETHEN_TEST_PG_URL)")
    if args.gateway_before is not None:
        g = gateways(args.gateway_before, args.gateway_now, args.gateway_rate, args.gateway_s, args.rounds)
        b, n = statistics.median(g["before"]), statistics.median(g["now"])
        print(f"\nwhole gateway, SQLite store, budgeted key, {args.gateway_rate} requests/s for "
              f"{args.gateway_s} s, {args.rounds} rounds alternated: CPU ms per request, median (all): "
              f"before ({args.gateway_before}) {b:.2f} {[round(x, 2) for x in g['before']]}, now {n:.2f} "
              f"{[round(x, 2) for x in g['now']]}: now - before {n - b:+.2f} ms")


if __name__ == "__main__":
    main()
