"""The SQLite writer connection (ethen.store.sqlite_writer): batches on the event loop, a contended write lock
handed to the thread, checkpoints in NORMAL mode, and settlements queued before they are awaited. Real SQLite
files."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from ethen.store import Admission, Store
from ethen.store import schema as s
from ethen.store.sqlite_writer import CHECKPOINT_COMMITS
from tests.store.test_admission import LEASE


async def _setup(url: str, sync: str) -> tuple[Store, Admission, str]:
    st = await Store.open(url, sqlite_synchronous=sync)
    await st.create_project("p", budget_usd=100.0, budget_window="day")
    key, _ = await st.create_key("p")
    adm = Admission(st, lease=LEASE)
    await adm.start()
    return st, adm, key


async def _settle(adm: Admission, key: str, rid: str) -> None:
    principal = await adm.authenticate(key)
    assert principal is not None
    ticket = await adm.reserve(principal.project, 0.001)
    await adm.settle(principal.project, reservation_id=ticket, request_id=rid, key_id=principal.key_id,
                     provider="prov", model="mod", prompt_tokens=3, completion_tokens=2, cost_usd=0.0005)


async def _ledger_rows(st: Store) -> int:
    async with st.engine.connect() as conn:
        return int(await conn.scalar(select(func.count()).select_from(s.ledger)) or 0)


@pytest.mark.parametrize("sync", ["NORMAL", "FULL"])
def test_a_write_lock_held_elsewhere_hands_the_batch_to_the_thread_and_the_loop_keeps_running(
        tmp_path: Path, sync: str) -> None:
    """Another connection holds SQLite's write lock for 0.4 s: the settlement waits for it on the writer's
    thread (the inline ``BEGIN IMMEDIATE`` has a busy timeout of 0), commits once the lock is free, and the
    event loop keeps ticking meanwhile (no stall on the lock)."""
    db = tmp_path / "w.db"

    async def go() -> None:
        st, adm, key = await _setup(f"sqlite:///{db}", sync)
        try:
            await _settle(adm, key, "warm")  # the writer's connection exists
            other = sqlite3.connect(db, check_same_thread=False)
            other.isolation_level = None
            other.execute("BEGIN IMMEDIATE")
            released = threading.Event()

            def release_later() -> None:
                time.sleep(0.4)
                other.execute("COMMIT")
                other.close()
                released.set()

            threading.Thread(target=release_later, daemon=True).start()
            ticks: list[float] = []
            stop = False

            async def tick() -> None:
                while not stop:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.01)

            ticker = asyncio.create_task(tick())
            t0 = time.monotonic()
            await _settle(adm, key, "contended")
            waited = time.monotonic() - t0
            stop = True
            await ticker
            assert released.is_set() and waited >= 0.3, waited  # it did wait for the other writer
            sq = adm._writer._sqlite
            assert sq is not None and sq.contended == 1
            gaps = [b - a for a, b in itertools.pairwise(ticks)]
            assert max(gaps) < 0.2, max(gaps)  # the loop was never blocked on the lock
            assert await _ledger_rows(st) == 2
        finally:
            await adm.aclose()
            await st.aclose()

    asyncio.run(go())


def test_normal_mode_commits_inline_and_checkpoints_the_wal_off_the_loop(tmp_path: Path) -> None:
    """NORMAL: the writer turns SQLite's automatic checkpoint off on its connection (it would run inside a
    COMMIT on the loop) and a PASSIVE checkpoint runs on its own thread every CHECKPOINT_COMMITS commits, so
    the WAL file stays near what that many commits write (SQLite reuses it from the start after a complete
    checkpoint). Without that checkpoint it holds every frame of the run: 6x the size after the first half
    interval here."""
    db = tmp_path / "c.db"
    wal = tmp_path / "c.db-wal"

    async def go() -> tuple[int, int]:
        st, adm, key = await _setup(f"sqlite:///{db}", "NORMAL")
        try:
            sq = adm._writer._sqlite
            assert sq is not None and sq.inline_commit
            half = CHECKPOINT_COMMITS // 2
            for i in range(half):
                await _settle(adm, key, f"a{i}")  # one commit each (sequential), no checkpoint yet
            first = wal.stat().st_size
            for i in range(6 * half - half):
                await _settle(adm, key, f"b{i}")
                if i % 64 == 0:
                    await asyncio.sleep(0.02)  # let a checkpoint that started finish on its thread
            assert await _ledger_rows(st) == 6 * half
            return first, wal.stat().st_size  # before closing (the last close checkpoints and deletes it)
        finally:
            await adm.aclose()
            await st.aclose()

    first, last = asyncio.run(go())
    assert first > 0 and last < 4 * first, (first, last)


def test_full_mode_keeps_the_fsync_and_the_automatic_checkpoint(tmp_path: Path) -> None:
    """FULL: the writer's connection runs with synchronous=FULL (2) and SQLite's automatic checkpoint on (its
    COMMIT runs on the thread); NORMAL (1) with it off."""

    async def go(sync: str) -> tuple[int, int]:
        st, adm, key = await _setup(f"sqlite:///{tmp_path / (sync + '.db')}", sync)
        try:
            await _settle(adm, key, "one")
            return await adm.write(
                lambda conn: (int(conn.execute(text("PRAGMA synchronous")).scalar_one()),
                              int(conn.execute(text("PRAGMA wal_autocheckpoint")).scalar_one())),
                "read pragmas",
            )
        finally:
            await adm.aclose()
            await st.aclose()

    assert asyncio.run(go("FULL")) == (2, 1000)
    assert asyncio.run(go("NORMAL")) == (1, 0)


def test_a_settlement_is_queued_at_once_and_committed_when_awaited(tmp_path: Path) -> None:
    """``settle_soon`` queues the ledger entry and returns before the commit (the gateway builds its answer
    meanwhile); the row is in the database once the returned future is awaited."""

    async def go() -> None:
        st, adm, key = await _setup(f"sqlite:///{tmp_path / 's.db'}", "NORMAL")
        try:
            principal = await adm.authenticate(key)
            assert principal is not None
            ticket = await adm.reserve(principal.project, 0.001)
            before = adm._writer.entries
            fut = adm.settle_soon(principal.project, reservation_id=ticket, request_id="soon",
                                  key_id=principal.key_id, provider="prov", model="mod", prompt_tokens=1,
                                  completion_tokens=1, cost_usd=0.0004)
            assert not fut.done() and adm._writer.entries == before  # queued, not yet committed
            await fut
            assert adm._writer.entries == before + 1 and await _ledger_rows(st) == 1
        finally:
            await adm.aclose()
            await st.aclose()

    asyncio.run(go())


@pytest.mark.parametrize(("setting", "pragma"), [(None, 1), ("FULL", 2)])
def test_the_gateway_config_sets_the_writer_connection_s_synchronous(
        tmp_path: Path, setting: str | None, pragma: int) -> None:
    """``[store] sqlite_synchronous`` reaches the writer connection (default NORMAL)."""
    from ethen.gateway.accounting.accounts import accounts_for
    from ethen.gateway.accounting.auth import KeyRing
    from ethen.gateway.config import parse_config

    store: dict[str, str] = {"url": f"sqlite:///{tmp_path / 'g.db'}"}
    if setting is not None:
        store["sqlite_synchronous"] = setting
    cfg = parse_config({
        "providers": [{"id": "up", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/v1",
                       "api_key_env": "UP_KEY"}],
        "routes": [{"model": "m", "provider": "up", "info": {"context_window": 8192},
                    "prices": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}],
        "api_keys": [],
        "store": store,
    })

    async def go() -> int:
        acc = accounts_for(cfg, KeyRing(cfg.api_keys))
        await acc.start()
        try:
            assert acc.admission is not None
            return int(await acc.admission.write(
                lambda conn: conn.execute(text("PRAGMA synchronous")).scalar_one(), "read pragma"))
        finally:
            await acc.aclose()

    assert asyncio.run(go()) == pragma


def test_a_batch_failing_on_the_thread_leaves_the_loop_s_busy_timeout_at_zero(tmp_path: Path) -> None:
    """A contended batch goes to the thread (busy timeout 10 s there) and fails there (a foreign-key
    violation keeps the connection): the connection's busy timeout is back to 0, so the next inline batch on
    the event loop cannot sleep on a lock."""
    from ethen.store.sqlite_writer import SqliteWriter

    db = tmp_path / "b.db"

    async def go() -> int:
        st = await Store.open(f"sqlite:///{db}")
        writer = SqliteWriter(st.engine)
        try:
            other = sqlite3.connect(db, check_same_thread=False)
            other.isolation_level = None
            other.execute("BEGIN IMMEDIATE")
            threading.Timer(0.2, lambda: (other.execute("COMMIT"), other.close())).start()
            bad = ("INSERT INTO daily_spend (project_id, day, settled_nano) VALUES (?, ?, ?)",
                   [(999, "2026-01-01", 1)])
            with pytest.raises(sqlite3.IntegrityError):
                await writer.batch([bad])  # no project 999
            assert writer.contended == 1
            _conn, raw = writer._connection()
            return int(raw.execute("PRAGMA busy_timeout").fetchone()[0])
        finally:
            writer.close()
            await st.aclose()

    assert asyncio.run(go()) == 0
