"""The ledger writer's batches (ethen.store.groupcommit: raw DBAPI batches on SQLite, one statement on
Postgres) and the budget snapshot's reads (ethen.store.admission.remaining_usd). Real SQLite file and (with
ETHEN_TEST_PG_URL) real Postgres."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, select

from ethen.store import Admission, Project, Store, StoreConflictError
from ethen.store import schema as s
from ethen.store.values import to_nano
from tests.store.test_admission import LEASE, run

DAY1 = datetime(2026, 3, 1, 23, 59, 59, 123456, tzinfo=UTC)
DAY2 = DAY1 + timedelta(seconds=1)  # the next UTC day


async def settle_at(adm: Admission, p: Project, ticket: Any, rid: str, cost: float, at: datetime,
                    key_id: str | None = None, estimated: bool = False) -> None:
    await adm.settle(p, reservation_id=ticket, request_id=rid, key_id=key_id, provider="prov", model="mod",
                     prompt_tokens=7, completion_tokens=3, cost_usd=cost, estimated=estimated, now=at)


@pytest.mark.parametrize("serial", [False, True], ids=["one batch", "one by one"])
def test_a_mixed_batch_lands_exactly(store_url: str, serial: bool) -> None:
    """One batch of 40 settlements: two projects, with and without a budget grant, zero-cost ones, two UTC
    days. Every ledger row is stored as given (read back through SQLAlchemy), the day totals are the sums, and
    the grants in the database equal the instance's grants in memory. ``serial``: the same 40 awaited one at a
    time, 40 one-entry batches (Postgres's single-row statement, ``_PG_ONE``), land exactly the same."""

    Held = tuple[int, int]

    async def fn(st: Store) -> tuple[int, list[Any], list[Any], dict[int, int], Held, Held]:
        a = await st.create_project("a", budget_usd=10.0, budget_window="day")
        b = await st.create_project("b", budget_usd=10.0, budget_window="day")
        free = await st.create_project("free")  # no budget: no grant
        adm = Admission(st, lease=LEASE)
        await adm.start()
        try:
            jobs = []
            for i in range(40):
                p = (a, b, free)[i % 3]
                t = await adm.reserve(p, 0.01) if p.budget_usd is not None else None
                cost = 0.0 if i % 7 == 0 else 0.001 * (i + 1)
                jobs.append(settle_at(adm, p, t, f"r{i}", cost, DAY1 if i % 2 else DAY2,
                                      key_id=f"k{i % 4}" if i % 5 else None, estimated=i % 4 == 0))
            before = adm._writer.batches
            if serial:
                for job in jobs:
                    await job
            else:
                await asyncio.gather(*jobs)
            n_batches = adm._writer.batches - before
            async with st.engine.connect() as conn:
                lc, dc = s.ledger.c, s.daily_spend.c
                rows = list(await conn.execute(
                    select(lc.request_id, lc.project_id, lc.key_id, lc.provider, lc.model, lc.prompt_tokens,
                           lc.completion_tokens, lc.cost_nano, lc.estimated, lc.at).order_by(lc.id)))
                days = list(await conn.execute(
                    select(dc.project_id, dc.day, dc.settled_nano).order_by(dc.project_id, dc.day)))
                bg = s.budget_grants.c
                held = await conn.execute(select(bg.project_id, bg.amount_nano))
                db_grants = {r[0]: int(r[1]) for r in held}
            return n_batches, rows, days, db_grants, adm.held_nano(a.id), adm.held_nano(b.id)
        finally:
            await adm.aclose()

    n_batches, rows, days, db_grants, (ga, ra), (gb, rb) = run(store_url, fn)
    assert n_batches == (40 if serial else 1)  # the 40 were one transaction (or 40)
    pids = sorted({r[1] for r in rows})
    want_rows = []
    want_days: dict[tuple[int, str], int] = {}
    for i in range(40):
        pid = pids[i % 3]
        cost = to_nano(0.0 if i % 7 == 0 else 0.001 * (i + 1))
        at = DAY1 if i % 2 else DAY2
        want_rows.append((f"r{i}", pid, f"k{i % 4}" if i % 5 else None, "prov", "mod", 7, 3, cost,
                          int(i % 4 == 0), at))
        want_days[(pid, at.date().isoformat())] = want_days.get((pid, at.date().isoformat()), 0) + cost
    got = [(*r[:9], r[9] if r[9].tzinfo else r[9].replace(tzinfo=UTC)) for r in rows]
    assert got == want_rows
    assert [(d[0], d[1], int(d[2])) for d in days] == sorted((k[0], k[1], v) for k, v in want_days.items())
    assert ra == 0 and rb == 0
    assert db_grants == {pids[0]: ga, pids[1]: gb}  # memory and database agree, per project; none for "free"


@contextmanager
def statements(st: Store, needle: str) -> Iterator[list[str]]:
    """The SQL statements containing ``needle`` run on ``st``'s reader engine while inside."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if needle in statement:
            seen.append(statement)

    event.listen(st.engine.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(st.engine.sync_engine, "before_cursor_execute", before)


def test_a_failed_batch_fails_each_waiter_and_lands_nothing_then_the_writer_goes_on(store_url: str) -> None:
    """A batch holding a settlement of a project that does not exist (a foreign-key violation) fails every
    settlement of that batch with the store's error, none of it lands, and the next batch commits."""

    async def fn(st: Store) -> tuple[list[BaseException | None], int, int]:
        p = await st.create_project("p", budget_usd=10.0, budget_window="day")
        ghost = dataclasses.replace(p, id=p.id + 1000, name="ghost", budget_usd=None)
        adm = Admission(st, lease=LEASE)
        await adm.start()
        try:
            tickets = [await adm.reserve(p, 0.01) for _ in range(5)]
            jobs = [settle_at(adm, p, t, f"ok{i}", 0.002, DAY1) for i, t in enumerate(tickets)]
            jobs.insert(2, settle_at(adm, ghost, None, "bad", 0.001, DAY1))
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
            async with st.engine.connect() as conn:
                after_failure = len(list(await conn.execute(select(s.ledger.c.id))))
            t = await adm.reserve(p, 0.01)
            await settle_at(adm, p, t, "next", 0.002, DAY1)
            async with st.engine.connect() as conn:
                after_next = len(list(await conn.execute(select(s.ledger.c.id))))
            assert adm.held_nano(p.id)[1] == 0  # the failed batch's holds ended
            return list(outcomes), after_failure, after_next
        finally:
            await adm.aclose()

    outcomes, after_failure, after_next = run(store_url, fn)
    assert len(outcomes) == 6 and all(isinstance(o, StoreConflictError) for o in outcomes), outcomes
    assert after_failure == 0 and after_next == 1


def test_waiting_requests_share_one_budget_read_and_a_heartbeat_makes_none_wait(store_url: str) -> None:
    """After a change, 30 concurrent requests wait for one read of the project's spend (not 30). After a
    heartbeat the snapshot is served at once while one read refreshes it in the background: the other
    instance's spend shows up after that read."""

    async def fn(st: Store) -> tuple[int, float | None, int, float | None, float | None]:
        p = await st.create_project("p", budget_usd=1.0, budget_window="day")
        other = await Store.open(store_url)
        quiet = timedelta(seconds=60)  # no heartbeat during the test (it would start a read of its own)
        a, b = Admission(st, lease=quiet), Admission(other, lease=quiet)
        await a.start()
        await b.start()
        try:
            a.invalidate()  # as after a policy change: no snapshot
            with statements(st, "budget_nano") as reads:
                got = await asyncio.gather(*(a.remaining_usd(p) for _ in range(30)))
            assert len(set(got)) == 1
            t = await b.reserve(p, 0.25)  # b takes 0.25 (and some budget ahead) from the window
            await settle_at(b, p, t, "b", 0.25, datetime.now(UTC))
            a._escrow._grants[p.id].fresh = False  # what a heartbeat does (no lease renewal needed here)
            with statements(st, "budget_nano") as stale_reads:
                stale = await a.remaining_usd(p)  # served from the snapshot, no read awaited
                during = len(stale_reads)
                task = a._escrow._grants[p.id].reading
                assert task is not None
                await task
            return len(reads), stale, during, got[0], await a.remaining_usd(p)
        finally:
            await a.aclose()
            await b.aclose()
            await other.aclose()

    n_reads, stale, during, first, refreshed = run(store_url, fn)
    assert n_reads == 1
    assert first == pytest.approx(1.0)
    assert during == 0 and stale == pytest.approx(1.0)
    assert refreshed is not None and refreshed <= 0.75 + 1e-9


@pytest.mark.parametrize("setting", ["on", "off"])
def test_postgres_synchronous_commit_applies_to_the_ledger_writer_only(setting: str) -> None:
    """``postgres_synchronous_commit`` is the setting of the ledger writer's connection (its settlements
    land and are visible to another connection at once either way); the connection goes back to the pool
    with the server's default, so grants, claims and admin writes keep it."""
    from tests.pgdb import pg_or_skip

    async def main(url: str) -> tuple[str, str, int, float]:
        st = await Store.open(url, postgres_synchronous_commit=setting)
        try:
            p = await st.create_project("p", budget_usd=5.0, budget_window="day")
            adm = Admission(st, lease=LEASE)
            await adm.start()
            try:
                for i in range(5):
                    await settle_at(adm, p, await adm.reserve(p, 0.01), f"r{i}", 0.001, DAY1)
                writer = adm._writer
                on_writer = await writer._pg_raw.fetchval("SHOW synchronous_commit")
                await writer._drop_pg(invalidate=False)  # back to the pool, as after an idle spell
                async with st.engine.connect() as conn:
                    pooled = (await conn.exec_driver_sql("SHOW synchronous_commit")).scalar_one()
                    n = (await conn.execute(select(s.ledger.c.id).where(s.ledger.c.project_id == p.id))).all()
                    day = (await conn.execute(select(s.daily_spend.c.settled_nano))).scalar_one()
                return on_writer, pooled, len(n), int(day) / 1e9
            finally:
                await adm.aclose()
        finally:
            await st.aclose()

    with pg_or_skip() as url:
        on_writer, pooled, n, day = asyncio.run(main(url))
    assert on_writer == setting
    assert pooled == "on"  # the server's default, whatever the writer used
    assert n == 5 and day == pytest.approx(0.005)


def test_postgres_synchronous_commit_must_be_on_or_off() -> None:
    from ethen.store import StoreInvalidError
    from ethen.store.engine import make_engine

    with pytest.raises(StoreInvalidError, match=r"postgres_synchronous_commit = 'maybe': use on or off"):
        Store(make_engine("sqlite://"), postgres_synchronous_commit="maybe")
