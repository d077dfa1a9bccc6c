"""Budget admission at gateway speed: key cache, per-instance budget escrow with leases, group commit.

One :class:`Admission` per gateway process (an *instance*, id ``instance_id``, random unless configured). Per
request it does no database round trip except the settlement's share of one group commit:

- **Keys** (:class:`~ethen.store.keycache.KeyCache`): an authenticated principal is cached in memory by the
  SHA-256 of the presented key (not the key). Every key revocation and project policy change bumps the
  ``store_changes`` counter in the same transaction; each instance polls it every ``poll_s`` (0.5 s) and drops
  its cache on a change, and a change made through this process's own store (the admin API) drops it at once.
  So every instance refuses a revoked key, and sees a new policy/budget, within about ``poll_s`` plus one
  query. ``last_used_at`` is still written at most once a minute per key, off the request path.
- **Budget** (:class:`~ethen.store.escrow.BudgetEscrow`): an instance takes budget from a project's window
  in *grants* and admits requests against its grant in memory; its lease, renewed every heartbeat, bounds
  how long a dead instance's grants count, and idle grants are given back.
- **Group commit**: settlements queue to one writer task, which commits everything queued in one transaction
  (ledger rows, the day totals and the grant decrements: one fsync for many requests); each request awaits its
  batch's commit, so a settled entry is durable before the answer leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from sqlalchemy import Connection
from typing_extensions import Unpack

from .errors import StoreError
from .escrow import DEFAULT_LEASE, BudgetEscrow, Ticket
from .groupcommit import Entry, GroupCommit
from .keycache import KeyCache
from .models import Principal, Project
from .spending import LedgerEntry, ledger_row
from .store import Store

T = TypeVar("T")

__all__ = ["Admission"]

log = logging.getLogger("ethen.store.admission")


class Admission:
    """The request path's view of the store (see the module docstring). ``start`` before use, ``aclose``
    at shutdown (returns this instance's grants)."""

    def __init__(
        self,
        store: Store,
        *,
        instance_id: str | None = None,
        lease: timedelta = DEFAULT_LEASE,
        poll_s: float = 0.5,
    ) -> None:
        self.store = store
        self.instance_id = instance_id or uuid.uuid4().hex
        self.poll_s = poll_s
        self._counter: int | None = None
        self._writer = GroupCommit(store, self.instance_id, self._applied, self._failed)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._keys = KeyCache(store, self._spawn)
        self._escrow = BudgetEscrow(store, self.instance_id, lease, self._writer, self._spawn)
        self.heartbeat_s = self._escrow.heartbeat_s

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self) -> int:
        """Release stale rows (own id, expired leases), register the lease, start the background tasks.
        Returns how many stale grants/reservations were released."""
        released = await self.store.release_stale(self.instance_id)
        self._writer.start()
        try:
            await self._escrow.heartbeat()
            self._counter = await self.store.changes()
        except BaseException:
            await self._writer.aclose()
            raise
        self.store.on_change.append(self.invalidate)
        self._tasks = [
            asyncio.create_task(self._every(self.heartbeat_s, self._escrow.heartbeat)),
            asyncio.create_task(self._every(self.poll_s, self._poll)),
        ]
        return released

    async def aclose(self) -> None:
        """Commit what is queued, stop, and give this instance's grants and lease back."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await t
        await self._writer.stop()
        if self.invalidate in self.store.on_change:
            self.store.on_change.remove(self.invalidate)
        await self._escrow.give_back()
        self._writer.dispose()

    async def _every(self, period: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await fn()
            except StoreError as exc:
                log.warning("instance %s: %s", self.instance_id, exc.message)

    # -- keys ------------------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Drop cached principals and budget snapshots (a key was revoked or a policy changed)."""
        self._keys.clear()
        self._escrow.forget_all()

    async def _poll(self) -> None:
        counter = await self.store.changes()
        if counter != self._counter:
            self._counter = counter
            self.invalidate()

    async def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked store key (cached), else ``None``."""
        return await self._keys.authenticate(key)

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except StoreError as exc:
                log.warning("instance %s: %s", self.instance_id, exc.message)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- budget ----------------------------------------------------------------------------------------
    async def write(self, fn: Callable[[Connection], T], what: str) -> T:
        """Run ``fn`` in one write transaction on the ledger writer's connection (on SQLite its one thread:
        other writes of this process, e.g. the request log, never contend with settlements for the lock)."""
        return await self._writer.transaction(fn, what)

    def held_nano(self, project_id: int) -> tuple[int, int]:
        """``(grant, reserved)`` of this instance for a project, in nano-USD (for tests and reports)."""
        return self._escrow.held_nano(project_id)

    async def remaining_usd(self, project: Project) -> float | None:
        """The window budget this instance could still admit for ``project`` (``None``: no budget), from
        memory (:meth:`ethen.store.escrow.BudgetEscrow.remaining_usd`)."""
        return await self._escrow.remaining_usd(project)

    async def reserve(self, project: Project, amount_usd: float) -> Ticket | None:
        """Admit ``amount_usd`` against the project's window budget: a ticket, or ``None`` (not enough
        budget). Memory only while the grant covers it; otherwise one claim transaction."""
        return await self._escrow.reserve(project, amount_usd)

    def extend(self, ticket: Ticket, total_usd: float) -> Ticket | None:
        """Grow an admitted hold to ``total_usd``, in memory: the larger ticket, or ``None`` when the grant
        cannot cover the difference now (:meth:`ethen.store.escrow.BudgetEscrow.extend`)."""
        return self._escrow.extend(ticket, total_usd)

    async def release(self, ticket: Ticket | None) -> None:
        """Drop a hold without spending (nothing was served). In memory only."""
        await self._escrow.release(ticket)

    # -- settlement (group commit) ---------------------------------------------------------------------
    async def settle(self, project: Project, *, reservation_id: Ticket | None,
                     **entry: Unpack[LedgerEntry]) -> None:
        """Append the actual cost to the ledger and move it out of the grant; returns once committed (the
        arguments of :meth:`settle_soon`)."""
        await self.settle_soon(project, reservation_id=reservation_id, **entry)

    def settle_soon(
        self,
        project: Project,
        *,
        reservation_id: Ticket | None,
        **entry: Unpack[LedgerEntry],
    ) -> asyncio.Future[None]:
        """Queue the settlement now (the ledger row, and the cost moved out of the grant); the future is done
        once it is committed, so the caller can build its answer meanwhile and await it before sending."""
        row = ledger_row(project, entry)
        ticket = reservation_id
        if ticket is None:
            return self._writer.enqueue(row, None, 0)
        return self._writer.enqueue(row, ticket.project_id, ticket.amount_nano)

    def _applied(self, batch: list[Entry]) -> None:
        self._escrow.applied(batch)

    def _failed(self, batch: list[Entry]) -> None:
        self._escrow.failed(batch)
