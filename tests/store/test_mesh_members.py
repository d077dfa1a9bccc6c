"""The ``mesh_members`` table (``ethen.store.members``, migration ``0008_mesh_members``) on SQLite and
PostgreSQL: announcements, renewals, the address-guarded delete, expiry by the database's clock, the sweep,
providers kept apart, and a database that was not migrated."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from ethen.store import MemberTable, Store, StoreUnavailableError

T = TypeVar("T")


def run(url: str, fn: Callable[[Store], Awaitable[T]], *, migrate: bool = True) -> T:
    async def main() -> T:
        st = await Store.open(url, migrate=migrate)
        try:
            return await fn(st)
        finally:
            await st.aclose()

    return asyncio.run(main())


def test_announce_renew_and_read(store_url: str) -> None:
    async def fn(st: Store) -> None:
        mesh, other = MemberTable(st.engine, "mesh"), MemberTable(st.engine, "other")
        assert await mesh.live() == []
        before_ms = int(time.time() * 1000)
        await mesh.announce("b", "10.0.0.2:50051", [(0, 9), (10, 19)], 5000, "inst-a")
        await other.announce("z", "10.0.0.9:50051", [(0, 29)], 5000, "inst-b")
        [row] = await mesh.live()
        assert (row.node_id, row.address, row.fragments, row.instance) == (
            "b", "10.0.0.2:50051", ((0, 9), (10, 19)), "inst-a")
        # the database's clock (same host here): within a few seconds of ours, expiry = seen + ttl
        assert abs(row.seen_ms - before_ms) < 5000 and row.expires_ms == row.seen_ms + 5000
        assert row.joined_ms == row.seen_ms
        await asyncio.sleep(0.05)
        await mesh.announce("b", "10.0.0.2:50051", [(0, 9), (10, 19)], 5000, "inst-b")  # a heartbeat
        [renewed] = await mesh.live()
        assert renewed.joined_ms == row.joined_ms and renewed.seen_ms > row.seen_ms
        assert renewed.instance == "inst-b"
        await asyncio.sleep(0.05)
        await mesh.announce("b", "10.0.0.3:50051", [(20, 29)], 5000, "inst-a")  # restarted elsewhere
        [moved] = await mesh.live()
        assert moved.address == "10.0.0.3:50051" and moved.fragments == ((20, 29),)
        assert moved.joined_ms == moved.seen_ms > row.joined_ms
        assert [r.node_id for r in await other.live()] == ["z"]

    run(store_url, fn)


def test_a_leave_deletes_only_the_leaving_address(store_url: str) -> None:
    async def fn(st: Store) -> None:
        mesh = MemberTable(st.engine, "mesh")
        await mesh.announce("b", "10.0.0.3:50051", [(0, 29)], 5000, "inst-a")
        assert await mesh.forget("b", "10.0.0.2:50051") is False  # a late Leave of b's old process
        assert [r.address for r in await mesh.live()] == ["10.0.0.3:50051"]
        assert await mesh.forget("b", "10.0.0.3:50051") is True
        assert await mesh.live() == []
        assert await mesh.forget("b", "10.0.0.3:50051") is False

    run(store_url, fn)


def test_rows_lapse_after_their_ttl_and_the_sweep_deletes_them(store_url: str) -> None:
    async def fn(st: Store) -> None:
        mesh, other = MemberTable(st.engine, "mesh"), MemberTable(st.engine, "other")
        await mesh.announce("short", "127.0.0.1:1", [(0, 29)], 300, "inst-a")
        await mesh.announce("long", "127.0.0.1:2", [(0, 29)], 60_000, "inst-a")
        await other.announce("short", "127.0.0.1:3", [(0, 29)], 300, "inst-a")
        assert sorted(r.node_id for r in await mesh.live()) == ["long", "short"]
        await asyncio.sleep(0.6)
        assert [r.node_id for r in await mesh.live()] == ["long"]  # lapsed: not read, still stored
        assert await mesh.sweep() == 1  # this provider's lapsed row only
        assert await mesh.sweep() == 0
        assert await other.sweep() == 1
        assert [r.node_id for r in await mesh.live()] == ["long"]

    run(store_url, fn)


def test_an_unmigrated_database_is_unavailable_not_a_crash(store_url: str) -> None:
    async def fn(st: Store) -> None:
        mesh = MemberTable(st.engine, "mesh")
        with pytest.raises(StoreUnavailableError):
            await mesh.live()
        with pytest.raises(StoreUnavailableError):
            await mesh.announce("b", "127.0.0.1:1", [], 1000, "inst-a")

    run(store_url, fn, migrate=False)
