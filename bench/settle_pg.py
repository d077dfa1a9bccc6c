"""One Postgres settlement's round trip, next to ``SELECT 1`` on the same connection, in one run.

    .venv/bin/python bench/settle_pg.py [--pg URL] [--gaps 0,0.01] [--n 300]

On a fresh database (created and dropped on ``--pg``'s server, default ``$ETHEN_TEST_PG_URL``) with the
store's schema, one asyncpg connection with ``synchronous_commit = off`` (the ledger writer's default) runs,
``--n`` times each and with ``--gaps`` seconds between calls (0: back to back; 0.01: the server's backend
asleep between calls, as at 100 req/s): ``SELECT 1`` (the round-trip floor), the ledger writer's batch
statement for one entry (``_PG_BATCH``: ``unnest`` over arrays) and its single-row statement (``_PG_ONE``,
what a one-entry batch sends), then all three again with the ledger's and day totals' foreign keys dropped.
Medians and p90 in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ethen.store import Store
from ethen.store.groupcommit import _PG_BATCH, _PG_ONE, Entry, _pg_args, _pg_statement
from tests.pgdb import fresh_pg_database


async def run(url: str, gaps: list[float], n: int) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    st = await Store.open(url)
    await st.create_project("p", budget_usd=1e6, budget_window="day")
    await st.aclose()
    plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    c = await asyncpg.connect(plain)
    try:
        pid = await c.fetchval("SELECT id FROM projects LIMIT 1")
        await c.execute("INSERT INTO gateway_instances VALUES ('bench', 0, 0)")
        await c.execute("INSERT INTO budget_grants VALUES ('bench', $1, 1000000000000)", pid)
        await c.execute("SET synchronous_commit = off")
        loop = asyncio.get_running_loop()

        def entry() -> list[Entry]:
            row = {"request_id": uuid.uuid4().hex, "project_id": pid, "key_id": "k", "provider": "up",
                   "model": "m", "prompt_tokens": 10, "completion_tokens": 16, "cost_nano": 1000,
                   "estimated": 0, "at": datetime.now(UTC), "cache_read_tokens": 0,
                   "cache_write_tokens": 0, "saved_nano": 0}  # fmt: skip
            return [Entry(row, pid, 1000, loop.create_future())]

        variants: dict[str, tuple[str, Callable[[], list[Any]]]] = {
            "SELECT 1": ("SELECT 1", lambda: []),
            "batch statement (unnest)": (_PG_BATCH, lambda: _pg_args("bench", entry())),
            "single-row statement": (_PG_ONE, lambda: _pg_statement("bench", entry())[1]),
        }

        async def measure(tag: str) -> None:
            for gap in gaps:
                for name, (sql, args) in variants.items():
                    ts = []
                    for _ in range(n):
                        a = args()
                        t = time.perf_counter()
                        await c.execute(sql, *a)
                        ts.append(time.perf_counter() - t)
                        if gap:
                            await asyncio.sleep(gap)
                    ts.sort()
                    med, p90 = statistics.median(ts) * 1000, ts[int(0.9 * len(ts))] * 1000
                    print(f"{tag:15s} gap {gap * 1000:4.0f} ms  {name:26s} median {med:.3f} ms  "
                          f"p90 {p90:.3f} ms")

        await measure("foreign keys")
        for table in ("ledger", "daily_spend"):
            await c.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_project_id_fkey")
        await measure("no foreign keys")
    finally:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--pg", default=os.environ.get("ETHEN_TEST_PG_URL"), help="Postgres URL")
    ap.add_argument("--gaps", default="0,0.01", help="seconds between calls")
    ap.add_argument("--n", type=int, default=300, help="calls per variant and gap")
    args = ap.parse_args()
    if not args.pg:
        sys.exit("no --pg and no ETHEN_TEST_PG_URL (bash .ci/postgres.sh starts a server and prints its URL)")
    with fresh_pg_database(args.pg) as url:
        asyncio.run(run(url, [float(g) for g in args.gaps.split(",")], args.n))


if __name__ == "__main__":
    main()
