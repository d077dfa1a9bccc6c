"""Store behaviour on SQLite and PostgreSQL: migrations, projects, keys, spend windows, usage, receipts,
error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from sqlalchemy import select

from ethen.store import (
    MIGRATIONS,
    Store,
    StoreConflictError,
    StoreError,
    StoreInvalidError,
    StoreNotFoundError,
    StoreUnavailableError,
    parse_key,
)
from ethen.store import schema as s
from ethen.store.values import to_nano, window_start

T = TypeVar("T")
NOW = datetime(2026, 3, 15, 12, 0, tzinfo=UTC)


def run(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        st = await Store.open(url)
        try:
            return await fn(st)
        finally:
            await st.aclose()

    return asyncio.run(main())


def test_migrations_recorded_and_idempotent(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        first = await st.applied_migrations()
        again = await st.migrate()
        async with st.engine.connect() as conn:
            rows = list(await conn.execute(select(s.migrations)))
        return first, again, rows

    first, again, rows = run(store_url, fn)
    assert first == [name for name, _ in MIGRATIONS]
    assert again == []
    assert len(rows) == len(MIGRATIONS) and all(r.applied_at is not None for r in rows)
    # A second process opening the same database migrates nothing and sees the same schema.
    assert run(store_url, lambda st: st.migrate()) == []


def test_concurrent_migrations_are_serialized(store_url: str) -> None:
    async def main() -> list[list[str]]:
        stores = [
            Store(__import__("ethen.store.engine", fromlist=["x"]).make_engine(store_url)) for _ in range(4)
        ]
        try:
            return list(await asyncio.gather(*(st.migrate() for st in stores)))
        finally:
            for st in stores:
                await st.aclose()

    results = asyncio.run(main())
    assert sorted(len(r) for r in results) == [0, 0, 0, len(MIGRATIONS)]


def test_unknown_recorded_migration_is_refused(store_url: str) -> None:
    async def fn(st: Store) -> None:
        async with st.engine.begin() as conn:
            await conn.execute(s.migrations.insert().values(name="9999_future", applied_at=NOW))
        await st.migrate()

    with pytest.raises(StoreError, match="9999_future"):
        run(store_url, fn)


def test_projects_create_update_and_errors(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        p = await st.create_project(
            "acme",
            allowed_providers=["beta", "alpha"],
            budget_usd=1.5,
            budget_window="day",
            default_alias="ethen/fast",
        )
        with pytest.raises(StoreConflictError):
            await st.create_project("acme")
        with pytest.raises(StoreInvalidError, match="budget_window = 'week'"):
            await st.create_project("x", budget_window="week")
        with pytest.raises(StoreInvalidError, match="default_alias = 'ethen/nope'"):
            await st.create_project("x", default_alias="ethen/nope")
        with pytest.raises(StoreInvalidError, match="project = 'bad name'"):
            await st.create_project("bad name")
        with pytest.raises(StoreInvalidError, match="budget_usd = -1"):
            await st.update_project("acme", budget_usd=-1)
        with pytest.raises(StoreInvalidError, match="budget_usd = 1e\\+300"):
            await st.update_project("acme", budget_usd=1e300)
        with pytest.raises(StoreNotFoundError, match="'ghost'"):
            await st.update_project("ghost", budget_usd=1)
        q = await st.update_project("acme", budget_usd=2.0)
        r = await st.update_project("acme", allowed_providers=None)
        return p, q, r, await st.list_projects()

    p, q, r, listed = run(store_url, fn)
    assert p.allowed_providers == ("alpha", "beta") and p.budget_usd == 1.5 and p.budget_window == "day"
    assert p.default_alias == "ethen/fast"
    assert q.budget_usd == 2.0 and q.allowed_providers == ("alpha", "beta")
    assert r.allowed_providers is None and r.budget_usd == 2.0
    assert [x.name for x in listed] == ["acme"]


def test_keys_create_authenticate_revoke_last_used(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        await st.create_project("p")
        key, info = await st.create_key("p", name="ci", now=NOW)
        before = await st.get_key(info.key_id)
        principal = await st.authenticate(key, now=NOW + timedelta(minutes=5))
        after = await st.get_key(info.key_id)
        await st.authenticate(key, now=NOW + timedelta(minutes=5, seconds=30))  # within the granularity
        assert (await st.get_key(info.key_id)).last_used_at == NOW + timedelta(minutes=5)
        await st.authenticate(key, now=NOW + timedelta(minutes=7))
        assert (await st.get_key(info.key_id)).last_used_at == NOW + timedelta(minutes=7)
        parsed = parse_key(key)
        assert parsed is not None
        wrong = await st.authenticate(f"ethen_{parsed.key_id}_{'A' * 43}")
        malformed = await st.authenticate("ethen_nope")
        async with st.engine.connect() as conn:
            stored = list(await conn.execute(select(s.api_keys)))
        revoked = await st.revoke_key(info.key_id, now=NOW + timedelta(hours=1))
        after_revoke = await st.authenticate(key)
        with pytest.raises(StoreNotFoundError):
            await st.create_key("ghost")
        return key, info, before, principal, after, wrong, malformed, stored, revoked, after_revoke

    key, info, before, principal, after, wrong, malformed, stored, revoked, after_revoke = run(store_url, fn)
    assert key.startswith("ethen_") and len(key) == len("ethen_") + 12 + 1 + 43
    assert before.last_used_at is None
    assert principal is not None and principal.project.name == "p" and principal.key_id == info.key_id
    assert after.last_used_at == NOW + timedelta(minutes=5)
    assert wrong is None and malformed is None
    parsed = parse_key(key)
    assert parsed is not None and len(parsed.secret) == 43
    secret = parsed.secret
    (row,) = stored
    # Only the key id, salt and digest are stored: the secret is in no column.
    assert all(secret.encode() not in (v if isinstance(v, bytes) else str(v).encode()) for v in row)
    assert revoked.revoked_at == NOW + timedelta(hours=1)
    assert after_revoke is None


def test_reserve_settle_window_and_release(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        p = await st.create_project("p", budget_usd=0.010, budget_window="day")
        other = await st.create_project("q", budget_usd=0.010, budget_window="day")
        # Yesterday's spend does not count in today's calendar window.
        await st.settle(
            p,
            reservation_id=None,
            request_id="old",
            key_id=None,
            provider="a",
            model="m",
            prompt_tokens=1,
            completion_tokens=1,
            cost_usd=0.009,
            now=NOW - timedelta(days=1),
        )
        r1 = await st.reserve(p, 0.006, request_id="r1", now=NOW)
        r2 = await st.reserve(p, 0.006, request_id="r2", now=NOW)  # 0.006 + 0.006 > 0.010
        r3 = await st.reserve(other, 0.006, request_id="r3", now=NOW)  # another project's budget
        assert r1 is not None
        mid = await st.spend(p, now=NOW)
        await st.settle(
            p,
            reservation_id=r1,
            request_id="r1",
            key_id=None,
            provider="a",
            model="m",
            prompt_tokens=10,
            completion_tokens=5,
            cost_usd=0.004,
            now=NOW,
        )
        end = await st.spend(p, now=NOW)
        r4 = await st.reserve(p, 0.006, request_id="r4", now=NOW)
        assert r4 is not None
        await st.release(r4)
        # An expired reservation no longer counts.
        r5 = await st.reserve(p, 0.006, request_id="r5", now=NOW, ttl=timedelta(seconds=1))
        later = await st.spend(p, now=NOW + timedelta(seconds=2))
        # Start-up releases only what no live process holds: r5 has expired, r3 (another process's
        # in-flight request, for all a starter knows) stays until it expires.
        n = await st.release_stale(now=NOW + timedelta(seconds=2))
        return r2, r3, mid, end, r5, later, n, await st.count_reservations()

    r2, r3, mid, end, r5, later, n, left = run(store_url, fn)
    assert r2 is None and r3 is not None
    assert mid.reserved_usd == pytest.approx(0.006) and mid.settled_usd == 0
    assert end.settled_usd == pytest.approx(0.004) and end.reserved_usd == 0
    assert end.remaining_usd == pytest.approx(0.006)
    assert r5 is not None and later.reserved_usd == 0
    assert n == 1 and left == 1  # r5 released, r3 kept


def test_concurrent_reservations_never_exceed_budget(store_url: str) -> None:
    async def main() -> tuple[int, int]:
        st = await Store.open(store_url)
        try:
            p = await st.create_project("race", budget_usd=0.05, budget_window="month")
            got = await asyncio.gather(
                *(st.reserve(p, 0.003, request_id=f"r{i}", now=NOW) for i in range(60))
            )
            spend = await st.spend(p, now=NOW)
            return sum(g is not None for g in got), to_nano(spend.reserved_usd)
        finally:
            await st.aclose()

    ok, reserved = asyncio.run(main())
    assert ok == 16  # floor(0.05 / 0.003)
    assert reserved == 16 * to_nano(0.003) <= to_nano(0.05)


def test_usage_report_groups_and_ranges(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        a = await st.create_project("a")
        b = await st.create_project("b")
        for i, (proj, key, model, at) in enumerate(
            [
                (a, "k1", "m1", NOW),
                (a, "k1", "m1", NOW + timedelta(hours=1)),
                (a, "k2", "m2", NOW),
                (b, "k3", "m1", NOW),
                (a, "k1", "m1", NOW + timedelta(days=2)),
            ]
        ):
            await st.settle(
                proj,
                reservation_id=None,
                request_id=f"r{i}",
                key_id=key,
                provider="pv",
                model=model,
                prompt_tokens=100,
                completion_tokens=10,
                cost_usd=0.001,
                now=at,
            )
        return (
            await st.usage(project="a", since=NOW, until=NOW + timedelta(days=1)),
            await st.usage(),
        )

    ranged, everything = run(store_url, fn)
    assert [(r.project, r.key_id, r.model, r.requests) for r in ranged] == [
        ("a", "k1", "m1", 2),
        ("a", "k2", "m2", 1),
    ]
    assert ranged[0].prompt_tokens == 200 and ranged[0].cost_usd == pytest.approx(0.002)
    assert sum(r.requests for r in everything) == 5


def test_certification_receipts_valid_at(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        await st.add_certification(
            "alpha", "m", certified_at=NOW, expires_at=NOW + timedelta(days=7), probe={"status": "ok"}
        )
        with pytest.raises(StoreInvalidError, match="expires_at"):
            await st.add_certification("alpha", "m", certified_at=NOW, expires_at=NOW, probe={})
        return (
            await st.certifications(valid_at=NOW + timedelta(days=1)),
            await st.certifications(valid_at=NOW + timedelta(days=8)),
            await st.certifications(valid_at=NOW - timedelta(seconds=1)),
        )

    now, expired, before = run(store_url, fn)
    assert [(c.provider, c.model) for c in now] == [("alpha", "m")] and now[0].receipt_id.startswith("cert_")
    assert expired == [] and before == []


def test_money_and_windows() -> None:
    assert to_nano(0.000_000_05) == 50
    assert to_nano(1e-10) == 1  # rounds up: never under-count spend
    with pytest.raises(ValueError, match="amount"):
        to_nano(float("nan"))
    # the BIGINT of nano-USD bounds every amount; beyond it (or beyond the float range) a ValueError, not an
    # OverflowError from float() or the database driver
    assert to_nano(9_223_372_036) == 9_223_372_036 * 10**9 <= 2**63 - 1
    for too_big in (9_223_372_037, 1e300, 10**400):
        with pytest.raises(ValueError, match="at most 9223372036 USD"):
            to_nano(too_big)
    assert window_start("day", NOW) == datetime(2026, 3, 15, tzinfo=UTC)
    assert window_start("month", NOW) == datetime(2026, 3, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match="timezone-aware"):
        window_start("day", datetime(2026, 1, 1))


def test_driver_errors_map_to_store_errors(tmp_path: Any) -> None:
    with pytest.raises(StoreInvalidError, match="unsupported backend 'mysql'"):
        asyncio.run(Store.open("mysql://u:p@localhost/db"))
    with pytest.raises(StoreUnavailableError) as ei:
        asyncio.run(Store.open("postgresql://u:hunter2@127.0.0.1:1/nodb"))
    assert "hunter2" not in str(ei.value)
    with pytest.raises(StoreInvalidError, match="missing-dir"):
        asyncio.run(Store.open(f"sqlite:///{tmp_path}/missing-dir/x.db"))
    (tmp_path / "not-a-db").write_bytes(b"garbage " * 512)
    with pytest.raises(StoreUnavailableError, match="database error"):
        asyncio.run(Store.open(f"sqlite:///{tmp_path}/not-a-db"))


def test_sqlite_write_transactions_take_the_write_lock_up_front(tmp_path: Any) -> None:
    import sqlite3

    from sqlalchemy import text

    path = tmp_path / "lock.db"

    def try_write() -> bool:
        raw = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            raw.close()

    async def main() -> tuple[bool, bool, str]:
        st = await Store.open(f"sqlite:///{path}")
        try:
            async with st.engine.connect() as conn:  # a read: deferred, does not block writers
                await conn.execute(select(s.projects))
                reader_blocks = not try_write()
            async with st.writer.begin() as conn:  # a write: the lock is held from BEGIN on
                await conn.execute(select(s.projects))
                writer_blocks = not try_write()
                mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
            return reader_blocks, writer_blocks, mode
        finally:
            await st.aclose()

    reader_blocks, writer_blocks, mode = asyncio.run(main())
    assert (reader_blocks, writer_blocks, mode) == (False, True, "wal")


def test_daily_spend_migration_backfills_from_the_ledger(store_url: str) -> None:
    async def fn(st: Store) -> Any:
        p = await st.create_project("p", budget_usd=1.0, budget_window="month")
        for i, at in enumerate([NOW, NOW, NOW - timedelta(days=1), NOW - timedelta(days=40)]):
            await st.settle(
                p,
                reservation_id=None,
                request_id=f"r{i}",
                key_id=None,
                provider="a",
                model="m",
                prompt_tokens=1,
                completion_tokens=1,
                cost_usd=0.01,
                now=at,
            )
        before = await st.spend(p, now=NOW)
        # roll back to the state before 0002 (table gone, record gone), then migrate again
        async with st.writer.begin() as conn:
            await conn.run_sync(lambda c: s.daily_spend.drop(c))
            await conn.execute(s.migrations.delete().where(s.migrations.c.name == "0002_daily_spend"))
        ran = await st.migrate()
        return before, ran, await st.spend(p, now=NOW)

    before, ran, after = run(store_url, fn)
    assert ran == ["0002_daily_spend"]
    assert before.settled_usd == pytest.approx(0.03) == after.settled_usd  # 40 days ago is last month
