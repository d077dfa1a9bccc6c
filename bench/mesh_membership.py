"""Mesh membership benchmark: time to detect a joined node and a silent one, on the instance whose registry
got the announcement and on another instance that reads the shared membership from Redis, in one run.

    .venv/bin/python bench/mesh_membership.py [--rounds 5] [--expiry 2] [--redis-url URL]

One worker process (layers 0-29, not joined by itself) and two orchestrators in this process: A opens the
join registry (:func:`~ethen.mesh.orchestrator.registry.open_join_point`, shared membership in Redis), B
only reads the shared membership (another gateway instance, or another process of ``--workers N``). Each
round an :class:`~ethen.mesh.worker.membership.Announcer` (the worker's own code, real gRPC) announces the
worker under a new node id:

- **join**: from the announcer's start (its first ``Join``) to the first route of A, and of B, that
  includes the node (``Orchestrator.route_for``, what a request would take);
- **expiry**: the announcer stops without ``Leave`` (a killed or partitioned worker); from its last answered
  ``Join`` to the node's removal from A's and B's membership (target: ``--expiry`` + at most one poll).

Baselines of the same run: one Health round trip to the worker (a node is routable only after one answers)
and one read of the shared membership from Redis; B polls Redis every 0.25 s, so B's join figure should be
about A's plus half a poll (the rounds start at spread offsets of B's poll). Without ``--redis-url`` (or
``ETHEN_TEST_REDIS_URL``) only A is measured.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import uuid

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from ethen.mesh.auth import ClientCredentials  # noqa: E402
from ethen.mesh.orchestrator import Orchestrator, WorkerClient  # noqa: E402
from ethen.mesh.orchestrator.members import Membership  # noqa: E402
from ethen.mesh.orchestrator.registry import open_join_point  # noqa: E402
from ethen.mesh.orchestrator.shared_members import SharedMembers  # noqa: E402
from ethen.mesh.routing.errors import MeshRoutingError  # noqa: E402
from ethen.mesh.worker.launch import spawn_worker  # noqa: E402
from ethen.mesh.worker.membership import Announcer, JoinSpec  # noqa: E402


def _routes(orch: Orchestrator, node: str) -> bool:
    try:
        return node in orch.route_for(32).nodes
    except MeshRoutingError:
        return False


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.1f} ms  (" + \
        ", ".join(f"{v * 1000:.0f}" for v in values) + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--expiry", type=float, default=2.0, help="member_expiry_s of both instances")
    ap.add_argument("--redis-url", default=os.environ.get("ETHEN_TEST_REDIS_URL"))
    args = ap.parse_args()
    logging.getLogger("ethen.mesh").setLevel(logging.ERROR)  # one line per join and expiry: not the output
    prefix = f"ethen-bench-{uuid.uuid4().hex[:8]}"

    def shared() -> SharedMembers | None:
        return None if not args.redis_url else SharedMembers(args.redis_url, "mesh", key_prefix=prefix)

    worker = spawn_worker("w", "0-29")
    a = Orchestrator.load({}).start()
    b = Orchestrator.load({}).start() if args.redis_url else None
    point = open_join_point(a, "127.0.0.1", 0, expiry_s=args.expiry, shared=shared())
    member_b = None if b is None else Membership(b, expiry_s=args.expiry, shared=shared()).start()
    client = WorkerClient("w", worker.address)
    probe = shared()
    try:
        health, redis_read = [], []
        for _ in range(20):
            t0 = time.monotonic()
            client.health()
            health.append(time.monotonic() - t0)
            if probe is not None:
                t0 = time.monotonic()
                probe.read()
                redis_read.append(time.monotonic() - t0)
        join_a, join_b, gone_a, gone_b = [], [], [], []
        spec = JoinSpec(f"127.0.0.1:{point.port}", None, ClientCredentials.load(None, None))
        for r in range(args.rounds):
            node = f"n{r}"
            ann = Announcer(spec, node, worker.address, [(0, 29)])
            # each round starts right after a removal B saw on one of its polls: offset the start across the
            # poll interval, or every join would land just after a poll and wait a whole one
            time.sleep((r * 0.618) % 1.0 * 0.25)
            t0 = time.monotonic()
            ann.start()
            seen: dict[str, float] = {}
            while len(seen) < (2 if b is not None else 1) and time.monotonic() - t0 < 10:
                for name, orch in (("a", a), ("b", b)):
                    if orch is not None and name not in seen and _routes(orch, node):
                        seen[name] = time.monotonic() - t0
                time.sleep(0.002)
            join_a.append(seen["a"])
            if b is not None:
                join_b.append(seen["b"])
            ann.stop()
            last = ann.last_joined_at
            assert last is not None
            left: dict[str, float] = {}
            while len(left) < len(seen) and time.monotonic() - last < args.expiry + 10:
                for name, orch in (("a", a), ("b", b)):
                    if orch is not None and name not in left and node not in orch.monitor.clients:
                        left[name] = time.monotonic() - last
                time.sleep(0.005)
            gone_a.append(left["a"])
            if b is not None:
                gone_b.append(left["b"])
        print(f"mesh membership, {args.rounds} rounds, member_expiry_s {args.expiry}, poll 0.25 s, "
              f"heartbeat {point.membership.heartbeat_s:.2f} s")
        print(f"  baseline: one Health round trip        {_ms(health[:5])}  [median of 20: "
              f"{statistics.median(health) * 1000:.2f} ms]")
        if redis_read:
            print(f"  baseline: one shared-membership read  median "
                  f"{statistics.median(redis_read) * 1000:.2f} ms")
        print(f"  join -> routed, same instance (A)     {_ms(join_a)}")
        if join_b:
            print(f"  join -> routed, other instance (B)    {_ms(join_b)}")
        print(f"  last announcement -> removed (A)      {_ms(gone_a)}")
        if gone_b:
            print(f"  last announcement -> removed (B)      {_ms(gone_b)}")
        if b is None:
            print("  (no Redis URL: the other instance was not measured)")
        print(f"  load average {os.getloadavg()[0]:.1f}")
    finally:
        client.close()
        if probe is not None:
            probe.close()
        point.close()
        if member_b is not None:
            member_b.stop()
        a.close()
        if b is not None:
            b.close()
        worker.stop()


if __name__ == "__main__":
    main()
