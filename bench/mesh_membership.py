"""Mesh membership benchmark: time to detect a joined node and a silent one, on the instance whose registry
got the announcement and on another instance that reads the shared membership, from Redis and from the
gateway's store (SQLite file, Postgres), one after the other in one run.

    .venv/bin/python bench/mesh_membership.py [--rounds 5] [--expiry 2] [--redis-url URL] [--pg URL]

One worker process (layers 0-29, not joined by itself) and two orchestrators in this process: A opens the
join registry (:func:`~ethen.mesh.orchestrator.registry.open_join_point`, shared membership in the backend),
B only reads the shared membership (another gateway instance, or another process of ``--workers N``). Each
round an :class:`~ethen.mesh.worker.membership.Announcer` (the worker's own code, real gRPC) announces the
worker under a new node id:

- **join**: from the announcer's start (its first ``Join``) to the first route of A, and of B, that
  includes the node (``Orchestrator.route_for``, what a request would take);
- **expiry**: the announcer stops without ``Leave`` (a killed or partitioned worker); from its last answered
  ``Join`` to the node's removal from A's and B's membership (target: ``--expiry`` + at most one poll).

Baselines of the same run: one Health round trip to the worker (a node is routable only after one answers)
and one read of the shared membership from each backend; B polls Redis every 0.25 s and the store every
0.5 s, so B's join figure should be about A's plus half a poll (the rounds start at spread offsets of B's
poll). Backends: SQLite always (a temporary file), Redis with ``--redis-url`` (default
``ETHEN_TEST_REDIS_URL``), Postgres with ``--pg`` (default ``ETHEN_TEST_PG_URL``; migrated, rows under a
provider id of this run, deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from ethen.mesh.auth import ClientCredentials  # noqa: E402
from ethen.mesh.errors import MeshError  # noqa: E402
from ethen.mesh.orchestrator import Orchestrator, WorkerClient  # noqa: E402
from ethen.mesh.orchestrator.members import Membership  # noqa: E402
from ethen.mesh.orchestrator.registry import open_join_point  # noqa: E402
from ethen.mesh.orchestrator.shared_members import MemberBackend, SharedMembers  # noqa: E402
from ethen.mesh.orchestrator.store_members import StoreMembers  # noqa: E402
from ethen.mesh.worker.launch import spawn_worker  # noqa: E402
from ethen.mesh.worker.membership import Announcer, JoinSpec  # noqa: E402
from ethen.store import MemberTable, Store  # noqa: E402


def _routes(orch: Orchestrator, node: str) -> bool:
    try:
        return node in orch.route_for(32).nodes
    except MeshError:
        return False


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.1f} ms  (" + \
        ", ".join(f"{v * 1000:.0f}" for v in values) + ")"


def _migrate(url: str) -> None:
    async def run() -> None:
        st = await Store.open(url)
        await st.aclose()

    asyncio.run(run())


def _drop_rows(url: str, provider: str) -> None:
    async def run() -> None:
        st = await Store.open(url, migrate=False)
        try:
            table = MemberTable(st.engine, provider)
            for row in await table.live():
                await table.forget(row.node_id, row.address)
            await table.sweep()
        finally:
            await st.aclose()

    asyncio.run(run())


def measure(kind: str, shared: Callable[[], MemberBackend], a: Orchestrator, b: Orchestrator,
            worker_address: str, health: list[float], args: argparse.Namespace) -> None:
    """The join and expiry rounds of one backend; prints its lines."""
    point = open_join_point(a, "127.0.0.1", 0, expiry_s=args.expiry, shared=shared())
    member_b = Membership(b, expiry_s=args.expiry, shared=shared()).start()
    probe = shared()
    poll = member_b.poll_s
    try:
        reads = []
        for _ in range(20):
            t0 = time.monotonic()
            probe.read()
            reads.append(time.monotonic() - t0)
        join_a, join_b, gone_a, gone_b = [], [], [], []
        spec = JoinSpec(f"127.0.0.1:{point.port}", None, ClientCredentials.load(None, None))
        for r in range(args.rounds):
            node = f"{kind}{r}"
            ann = Announcer(spec, node, worker_address, [(0, 29)])
            # each round starts right after a removal B saw on one of its polls: offset the start across the
            # poll interval, or every join would land just after a poll and wait a whole one
            time.sleep((r * 0.618) % 1.0 * poll)
            t0 = time.monotonic()
            ann.start()
            seen: dict[str, float] = {}
            while len(seen) < 2 and time.monotonic() - t0 < 10:
                for name, orch in (("a", a), ("b", b)):
                    if name not in seen and _routes(orch, node):
                        seen[name] = time.monotonic() - t0
                time.sleep(0.002)
            join_a.append(seen["a"])
            join_b.append(seen["b"])
            ann.stop()
            last = ann.last_joined_at
            assert last is not None
            left: dict[str, float] = {}
            while len(left) < len(seen) and time.monotonic() - last < args.expiry + 10:
                for name, orch in (("a", a), ("b", b)):
                    if name not in left and node not in orch.monitor.clients:
                        left[name] = time.monotonic() - last
                time.sleep(0.005)
            gone_a.append(left["a"])
            gone_b.append(left["b"])
        print(f"{kind}: poll {poll:.2f} s")
        print(f"  baseline: one Health round trip        median {statistics.median(health) * 1000:.2f} ms "
              "(20, before the backends)")
        print(f"  baseline: one shared-membership read  median {statistics.median(reads) * 1000:.2f} ms (20)")
        print(f"  join -> routed, same instance (A)     {_ms(join_a)}")
        print(f"  join -> routed, other instance (B)    {_ms(join_b)}")
        print(f"  last announcement -> removed (A)      {_ms(gone_a)}")
        print(f"  last announcement -> removed (B)      {_ms(gone_b)}")
    finally:
        probe.close()
        point.close()
        member_b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--expiry", type=float, default=2.0, help="member_expiry_s of both instances")
    ap.add_argument("--redis-url", default=os.environ.get("ETHEN_TEST_REDIS_URL"))
    ap.add_argument("--pg", default=os.environ.get("ETHEN_TEST_PG_URL"), help="PostgreSQL URL (optional)")
    args = ap.parse_args()
    logging.getLogger("ethen.mesh").setLevel(logging.ERROR)  # one line per join and expiry: not the output
    run_id = uuid.uuid4().hex[:8]
    provider = f"bench-{run_id}"

    worker = spawn_worker("w", "0-29")
    a = Orchestrator.load({}).start()
    b = Orchestrator.load({}).start()
    client = WorkerClient("w", worker.address)
    tmp = tempfile.TemporaryDirectory(prefix="ethen-bench-members-")
    sqlite_url = f"sqlite:///{Path(tmp.name) / 'ethen.db'}"
    try:
        health = []
        for _ in range(20):
            t0 = time.monotonic()
            client.health()
            health.append(time.monotonic() - t0)
        print(f"mesh membership, {args.rounds} rounds per backend, member_expiry_s {args.expiry}, heartbeat "
              f"{min(2.0, args.expiry / 4):.2f} s")
        backends: list[tuple[str, Callable[[], MemberBackend]]] = []
        if args.redis_url:
            url = args.redis_url
            backends.append(("redis", lambda: SharedMembers(url, "mesh", key_prefix=f"ethen-bench-{run_id}")))
        _migrate(sqlite_url)
        backends.append(("sqlite", lambda: StoreMembers(sqlite_url, provider)))
        if args.pg:
            pg = args.pg
            _migrate(pg)
            backends.append(("postgres", lambda: StoreMembers(pg, provider)))
        for kind, make in backends:
            measure(kind, make, a, b, worker.address, health, args)
        if not args.redis_url:
            print("  (no Redis URL: Redis was not measured)")
        if not args.pg:
            print("  (no Postgres URL: Postgres was not measured)")
        print(f"  load average {os.getloadavg()[0]:.1f}")
    finally:
        if args.pg:
            _drop_rows(args.pg, provider)
        client.close()
        a.close()
        b.close()
        worker.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
