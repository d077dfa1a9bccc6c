"""Benchmark: the per-request database work of a store-backed gateway request, and what durability costs.

    .venv/bin/python bench/store_admission.py                       # SQLite file in a temp dir
    .venv/bin/python bench/store_admission.py --pg URL              # also a PostgreSQL server

One "request" is what ``ethen.gateway.accounting.accounts`` does per chat completion with a project key that
has a
budget: authenticate (key lookup + salted-hash check), read the window spend (for ``decide``), reserve the
estimate (locked write transaction), settle (ledger insert + reservation delete, one transaction).

Two paths, same run: "per-request" is one transaction per step (the protocol before issue 11, still
``Store.reserve``/``Store.settle``); "fast" is :class:`ethen.store.Admission`, the gateway's path since issue
11 (key from the in-memory cache, remaining budget and the hold from memory, the settlement awaited through
the group commit). Measured: median and p99 milliseconds per request, sequential, and requests/second with
32 concurrent requests (one event loop, like one gateway process), on SQLite ``synchronous=NORMAL`` (the
gateway's default: durable across a process crash, not power loss) and ``FULL``, and Postgres with ``--pg``
with ``synchronous_commit`` ``off`` (the gateway's default, the counterpart of NORMAL) and ``on``. A
sequential request's floor is one commit: the settled entry must be committed before the answer leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ethen.store import Admission, Store


async def fast(adm: Admission, key: str, i: int) -> None:
    """The gateway's path since issue 11: cached key, in-memory remaining and hold, group-committed settle."""
    principal = await adm.authenticate(key)
    assert principal is not None
    p = principal.project
    await adm.remaining_usd(p)
    ticket = await adm.reserve(p, 0.0001)
    assert ticket is not None
    await adm.settle(
        p,
        reservation_id=ticket,
        request_id=f"f{i}",
        key_id=principal.key_id,
        provider="bench",
        model="m",
        prompt_tokens=20,
        completion_tokens=10,
        cost_usd=0.00005,
    )


async def one(st: Store, key: str, i: int) -> None:
    principal = await st.authenticate(key)
    assert principal is not None
    p = principal.project
    await st.spend(p)
    rid = await st.reserve(p, 0.0001, request_id=f"b{i}", key_id=principal.key_id)
    assert rid is not None
    await st.settle(
        p,
        reservation_id=rid,
        request_id=f"b{i}",
        key_id=principal.key_id,
        provider="bench",
        model="m",
        prompt_tokens=20,
        completion_tokens=10,
        cost_usd=0.00005,
    )


async def measure(url: str, sync: str, n: int, conc: int, path: str,
                  pg_commit: str = "on") -> tuple[float, float, float]:
    st = await Store.open(url, sqlite_synchronous=sync, postgres_synchronous_commit=pg_commit)
    adm = Admission(st)
    try:
        name = f"bench{time.monotonic_ns()}"
        await st.create_project(name, budget_usd=1e6, budget_window="day")
        key, _ = await st.create_key(name)
        if path == "fast":
            await adm.start()

            def work(i: int) -> Awaitable[None]:
                return fast(adm, key, i)
        else:

            def work(i: int) -> Awaitable[None]:
                return one(st, key, i)

        for i in range(20):  # warm-up: pool, statement caches
            await work(-i - 1)
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            await work(i)
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        sem = asyncio.Semaphore(conc)

        async def bounded(i: int) -> None:
            async with sem:
                await work(n + i)

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(n)))
        rps = n / (time.perf_counter() - t0)
        return statistics.median(times), times[int(0.99 * (len(times) - 1))], rps
    finally:
        await adm.aclose()
        await st.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="requests per measurement")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--pg", help="PostgreSQL URL (optional)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for path in ("per-request", "fast"):
            for label, sync in (("sqlite NORMAL", "NORMAL"), ("sqlite FULL", "FULL")):
                url = f"sqlite:///{d}/{sync}-{path}.db"
                rows.append(
                    (f"{path:12} {label}", *asyncio.run(measure(url, sync, args.n, args.concurrency, path)))
                )
            if args.pg:  # the gateway's default (off) and Postgres's own (on, a WAL flush per commit)
                for commit in ("off", "on"):
                    got = asyncio.run(measure(args.pg, "FULL", args.n, args.concurrency, path, commit))
                    rows.append((f"{path:12} postgresql {commit}", *got))
    base = rows[0]
    print(
        f"per-request store work (auth + spend + reserve + settle), n={args.n}, "
        f"concurrency={args.concurrency}; 'per-request' = one transaction per step (before issue 11), "
        "'fast' = ethen.store.Admission (the gateway's path)"
    )
    print(f"{'path / backend':40} {'median ms':>10} {'p99 ms':>8} {'req/s':>8} {'median vs first':>15}")
    for label, med, p99, rps in rows:
        print(f"{label:40} {med:10.3f} {p99:8.3f} {rps:8.0f} {med / base[1]:14.2f}x")
    with tempfile.TemporaryDirectory() as d:
        fsync_ms, commit_ms = durability_floor(Path(d), args.n)
    print(f"floor, same disk and run: os.fsync median {fsync_ms:.3f} ms; a bare sqlite3 commit of one row "
          f"(WAL, synchronous=FULL) median {commit_ms:.3f} ms: a settlement durable before the answer "
          "costs at least one of these")
    floors = {"sqlite FULL": commit_ms}
    if args.pg:
        floors["postgresql on"] = asyncio.run(pg_floor(args.pg, args.n))
        print(f"floor, Postgres: a bare one-row INSERT committed (asyncpg, autocommit) median "
              f"{floors['postgresql on']:.3f} ms (the server's WAL flush + one round trip)")
    for label, med, _, _ in rows:
        backend = label.split(None, 1)[1]
        if label.startswith("fast") and backend in floors:
            above = med - floors[backend]
            print(f"fast path above its floor, {backend}: {above:+.3f} ms per sequential request")


async def pg_floor(url: str, n: int) -> float:
    """Median ms of one committed one-row INSERT on a bare asyncpg connection (into a real table: a temporary
    table's rows skip the WAL, so its commit would not wait for a flush)."""
    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.engine import make_url

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    table = f"bench_floor_{time.monotonic_ns()}"
    try:
        await conn.execute(f"CREATE TABLE {table} (a int)")
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            await conn.execute(f"INSERT INTO {table} VALUES ($1)", i)
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.close()


def durability_floor(d: Path, n: int) -> tuple[float, float]:
    """Median ms of ``os.fsync`` on a small file, and of a bare one-row sqlite3 commit (WAL, FULL)."""
    import os
    import sqlite3

    times = []
    fd = os.open(d / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        for _ in range(n):
            os.write(fd, b"x" * 100)
            t0 = time.perf_counter()
            os.fsync(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
    conn = sqlite3.connect(d / "floor.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (a INTEGER)")
    commits = []
    for i in range(n):
        t0 = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (?)", (i,))
        conn.execute("COMMIT")
        commits.append((time.perf_counter() - t0) * 1000)
    conn.close()
    return statistics.median(times), statistics.median(commits)


if __name__ == "__main__":
    main()
