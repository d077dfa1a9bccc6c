"""Per-instance budget escrow with leases, the budget half of :mod:`ethen.store.admission`: an instance
admits requests against its grant of a project's window budget in memory, claims more in one locked
transaction, renews its lease every heartbeat and gives idle grants back.

- **Budget escrow**: an instance takes budget from a project's window in *grants* (``budget_grants``, one row
  per instance and project) and admits requests against its grant in memory (``reserved + amount <= grant``).
  The database invariant, at every commit, is ``settled(window) + sum(grants of live instances) + active
  reservations <= budget``: a claim (one write transaction holding the project's lock: SQLite ``BEGIN
  IMMEDIATE``, Postgres ``SELECT ... FOR UPDATE``) takes at most ``budget - settled - held``, and settlement
  moves the cost from the grant into the ledger in one transaction. A claim takes what the request needs plus
  a little more (a quarter of what is free, at most 128 such requests), so one claim serves many requests,
  and a background claim tops the grant up when a quarter of that is left (requests rarely wait for one).
- **Leases**: each instance renews ``gateway_instances.lease_until_ms`` every ``lease_s / 5`` (one small
  write); a grant counts only while its instance's lease is live, so a dead instance's unsettled holds and
  unused grant stop counting when its lease expires (:data:`DEFAULT_LEASE`, 2.5 s: within 2.5 s of a
  ``kill -9``, issue 23; it was 15 s), and its settled entries are in the ledger already. Others see that
  share at once: a read of ``free`` (or a claim) also notes the soonest lease end among the other instances
  holding a grant of the project, and ``remaining`` is refreshed from then on, not a heartbeat later. Safety:
  an instance admits from memory only while its own last renewal (timed from *before* the renewal's
  transaction, on the monotonic clock) is less than ``lease_s - 2 heartbeats`` old (1.5 s by default);
  otherwise it claims (renewing the lease, and finding out in the same transaction if it was lost) or
  refuses. So a frozen process (SIGSTOP, a swapped-out host) that resumes never admits against a grant
  others may have taken: it stopped admitting 2 heartbeats before its lease could end. What it had already
  admitted before it froze still settles (the ledger tells the truth): a process frozen longer than its
  lease *with requests in flight* is the one way to overspend, by those requests' holds; it then notices the
  lost lease and starts from a zero grant. Start-up deletes only rows of this instance id and of instances
  whose lease expired. Lease times are wall-clock epoch ms: instances on several hosts need clocks within a
  heartbeat or so of each other (NTP), the 2 heartbeats of margin being what a skew eats into.
- **Idle grants**: a grant without a claim for ``idle_s`` (3 s, or a heartbeat if longer: independent of the
  lease, so a short lease does not make busy instances claim more often) gives its unused part back at the
  next heartbeat, so other live instances can use it.
- ``remaining`` for ``decide`` comes from memory: ``free + grant - reserved``, ``free`` being what was left to
  claim at the last claim or read; admission itself is the exact gate. After a heartbeat the snapshot is
  still served while one background read refreshes it; only after a change (or at first use) do requests
  wait, and then all of them share one read (before, every request arriving after a heartbeat read it: a
  burst of reads on the request path every heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from . import schema as s
from ._common import budget_nano, epoch_ms
from .engine import boundary
from .errors import StoreError, StoreNotFoundError
from .groupcommit import Entry, GroupCommit
from .models import Project
from .store import Store
from .values import from_nano, window_start

__all__ = ["DEFAULT_LEASE", "BudgetEscrow", "Ticket"]

log = logging.getLogger("ethen.store.admission")  # the budget half of admission: its log lines as before

_CLAIM_AHEAD = 128  # a claim takes up to this many more requests of the same amount ahead of need
_IDLE_GRANT_S = 3.0  # a grant without a claim for this long (at least a heartbeat) gives its unused part back
#: An instance's lease (``[store] lease_s``): a dead instance's grants stop counting this long after its last
#: renewal (heartbeat every fifth of it).
DEFAULT_LEASE = timedelta(seconds=2.5)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One admitted request's hold against its instance's grant of ``project_id`` (nano-USD)."""

    project_id: int
    amount_nano: int


@dataclass(slots=True)
class _Grant:
    granted: int = 0  # this instance's grant as committed in the database (never above the database's value)
    reserved: int = 0  # in-flight holds admitted against it
    free: int | None = None  # what could still be claimed, as last read (None: unknown)
    fresh: bool = False  # free was read (or claimed) since the last heartbeat
    epoch: int = 0  # bumped when free is set or dropped: a read started before then is discarded
    reading: asyncio.Task[None] | None = None  # the one read of free in flight
    last_claim: float = 0.0  # monotonic time of the last claim
    stale_at_ms: int | None = None  # epoch ms: another instance's grant stops counting then (free grows)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class BudgetEscrow:
    """This instance's grants and lease (see the module docstring). The process's
    :class:`~ethen.store.admission.Admission` owns it: settlements go through the same ``writer``
    (:meth:`applied` / :meth:`failed` are its callbacks), ``spawn`` runs background claims, and
    :meth:`heartbeat` runs every ``heartbeat_s``."""

    def __init__(self, store: Store, instance_id: str, lease: timedelta, writer: GroupCommit,
                 spawn: Callable[[Awaitable[None]], None]) -> None:
        self.store = store
        self.instance_id = instance_id
        self.lease_ms = int(lease.total_seconds() * 1000)
        self.heartbeat_s = lease.total_seconds() / 5
        self.idle_s = max(self.heartbeat_s, _IDLE_GRANT_S)
        self._grants: dict[int, _Grant] = {}
        self._lease_ok_until = 0.0  # monotonic: admit from memory only before this
        self._registered = False
        self._writer = writer
        self._spawn = spawn

    def _grant(self, project_id: int) -> _Grant:
        g = self._grants.get(project_id)
        if g is None:
            g = self._grants[project_id] = _Grant()
        return g

    def held_nano(self, project_id: int) -> tuple[int, int]:
        """``(grant, reserved)`` of this instance for a project, in nano-USD (for tests and reports)."""
        g = self._grants.get(project_id)
        return (g.granted, g.reserved) if g is not None else (0, 0)

    async def remaining_usd(self, project: Project) -> float | None:
        """The window budget this instance could still admit for ``project`` (``None``: no budget), from
        memory. Requests wait for a database read only when no snapshot is known (first use, after a
        change), and then all share one read; a snapshot older than a heartbeat is served while one read
        refreshes it in the background (others' spend shows up within a heartbeat and a read)."""
        if project.budget_usd is None:
            return None
        g = self._grant(project.id)
        for _ in range(2):  # a read overtaken by a change is discarded: wait for the next one
            if g.free is not None:
                break
            await asyncio.shield(self._refresh(project, g))
        if g.fresh and g.stale_at_ms is not None and time.time() * 1000 >= g.stale_at_ms:
            g.fresh = False  # another instance's lease ended since the read: its grant is free now
        if not g.fresh:
            self._refresh(project, g)
        return from_nano(max(0, (g.free or 0) + g.granted - g.reserved))

    def _refresh(self, project: Project, g: _Grant) -> asyncio.Task[None]:
        """The read of ``free`` in flight for ``g`` (started when there is none)."""
        task = g.reading
        if task is None:
            task = g.reading = asyncio.create_task(self._read_free(project, g))

            def done(t: asyncio.Task[None]) -> None:
                if g.reading is t:
                    g.reading = None
                if not t.cancelled() and isinstance(t.exception(), StoreError):
                    log.warning("instance %s: %s", self.instance_id, t.exception())

            task.add_done_callback(done)
        return task

    @staticmethod
    def _forget(g: _Grant) -> None:
        """Drop ``g``'s snapshot of ``free`` (and any read in flight): the next request reads it again."""
        g.free, g.fresh, g.reading, g.stale_at_ms = None, False, None, None
        g.epoch += 1

    async def _read_free(self, project: Project, g: _Grant) -> None:
        now = datetime.now(UTC)
        epoch = g.epoch

        def read(conn: Connection) -> tuple[int, int | None]:
            budget, window = self._budget_row(conn, project, lock=False)
            if budget is None:
                return 0, None
            settled, reserved, granted, ends = self.store.sums_and_lease_end_sync(
                conn, project.id, window_start(window, now), now, self.instance_id
            )
            return max(0, int(budget) - settled - reserved - granted), ends

        with boundary("read spend"):
            async with self.store.engine.connect() as conn:  # a reader: never waits for the write lock
                free, ends = await conn.run_sync(read)
        if g.epoch == epoch:
            g.free, g.fresh, g.stale_at_ms = free, True, ends

    @staticmethod
    def _budget_row(conn: Connection, project: Project, *, lock: bool) -> Any:
        q = select(s.projects.c.budget_nano, s.projects.c.budget_window).where(s.projects.c.id == project.id)
        # FOR NO KEY UPDATE: serializes claims without blocking the foreign-key checks (KEY SHARE) of ledger
        # batches; FOR UPDATE made claim -> batch -> batch -> claim lock cycles (deadlocks) possible.
        row = conn.execute(q.with_for_update(key_share=True) if lock else q).first()
        if row is None:
            raise StoreNotFoundError(f"project = {project.name!r}: no such project")
        return row

    async def reserve(self, project: Project, amount_usd: float) -> Ticket | None:
        """Admit ``amount_usd`` against the project's window budget: a ticket, or ``None`` (not enough
        budget). Memory only while the grant covers it; otherwise one claim transaction."""
        amount = budget_nano(amount_usd) or 0
        g = self._grant(project.id)
        if self._fits(g, amount):
            g.reserved += amount
            if g.granted - g.reserved < _CLAIM_AHEAD * amount // 4 and not g.lock.locked():
                self._spawn(self._top_up(project, g, amount))  # claim ahead before requests wait for it
            return Ticket(project.id, amount)
        async with g.lock:
            for _ in range(3):
                if self._fits(g, amount):
                    g.reserved += amount
                    return Ticket(project.id, amount)
                if not await self._claim(project, g, amount):
                    return None
        return None

    def extend(self, ticket: Ticket, total_usd: float) -> Ticket | None:
        """Grow an admitted hold to ``total_usd`` from this instance's grant, in memory (no await: the
        settlement that needs it is queued right after): the larger ticket, or ``None`` when the grant cannot
        cover the difference now (the hold stays as it was)."""
        extra = (budget_nano(total_usd) or 0) - ticket.amount_nano
        if extra <= 0:
            return ticket
        g = self._grant(ticket.project_id)
        if not self._fits(g, extra):
            return None
        g.reserved += extra
        return Ticket(ticket.project_id, ticket.amount_nano + extra)

    async def _top_up(self, project: Project, g: _Grant, amount: int) -> None:
        async with g.lock:
            if g.granted - g.reserved < _CLAIM_AHEAD * amount // 4:
                await self._claim(project, g, 0, ahead=amount)

    def _fits(self, g: _Grant, amount: int) -> bool:
        return g.reserved + amount <= g.granted and time.monotonic() < self._lease_ok_until

    async def _claim(self, project: Project, g: _Grant, amount: int, *, ahead: int | None = None) -> bool:
        """Take more of the project's budget into this instance's grant (one locked transaction): what
        ``amount`` needs plus up to :data:`_CLAIM_AHEAD` requests of ``ahead`` (default ``amount``) more."""
        per = amount if ahead is None else ahead
        started = time.monotonic()
        reserved_now, granted_now = g.reserved, g.granted

        def tx(conn: Connection) -> tuple[int | None, int | None, bool, int | None]:
            """(taken or None when refused, what is left free, lease lost, soonest other lease end)."""
            now = datetime.now(UTC)
            budget, window = self._budget_row(conn, project, lock=True)
            lost = self._ensure_lease(conn, epoch_ms(now))
            needed = max(0, reserved_now + amount - (0 if lost else granted_now))
            if budget is None:
                if needed:
                    self._add_grant(conn, project.id, needed)
                return needed, None, lost, None
            settled, reserved, granted, ends = self.store.sums_and_lease_end_sync(
                conn, project.id, window_start(window, now), now, self.instance_id
            )
            free = budget - settled - reserved - granted
            if needed > free:
                return None, max(0, free), lost, ends
            take = needed + min((free - needed) // 4, _CLAIM_AHEAD * per)
            if take:
                self._add_grant(conn, project.id, take)
            return take, free - take, lost, ends

        take, free, lost, ends = await self._writer.transaction(tx, "reserve budget")
        if lost:
            self._lost()
        g.free, g.fresh, g.stale_at_ms = free, True, ends
        g.epoch += 1
        if take is None:
            return False
        self._lease_ok_until = started + self._lease_window()
        g.granted += take
        g.last_claim = time.monotonic()
        return True

    def _add_grant(self, conn: Connection, project_id: int, take: int) -> None:
        ins = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        stmt = ins(s.budget_grants).values(
            instance_id=self.instance_id, project_id=project_id, amount_nano=take
        )
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["instance_id", "project_id"],
                set_={"amount_nano": s.budget_grants.c.amount_nano + take},
            )
        )

    def _lease_window(self) -> float:
        return self.lease_ms / 1000 - 2 * self.heartbeat_s

    def _ensure_lease(self, conn: Connection, now_ms: int) -> bool:
        """Renew this instance's lease inside ``conn``'s transaction; ``True`` when the lease was lost (found
        expired or gone while registered): others may have claimed this instance's grants, so they restart
        from zero (the caller applies :meth:`_lost` in memory)."""
        gi = s.gateway_instances.c
        me = self.instance_id
        lease = conn.scalar(select(gi.lease_until_ms).where(gi.instance_id == me))
        until = now_ms + self.lease_ms
        if lease is not None and lease > now_ms:
            conn.execute(update(s.gateway_instances).where(gi.instance_id == me).values(lease_until_ms=until))
            return False
        lost = self._registered
        conn.execute(delete(s.budget_grants).where(s.budget_grants.c.instance_id == me))
        conn.execute(delete(s.gateway_instances).where(gi.instance_id == me))
        conn.execute(
            s.gateway_instances.insert().values(instance_id=me, started_at_ms=now_ms, lease_until_ms=until)
        )
        self._registered = True
        return lost

    def _lost(self) -> None:
        log.error(
            "instance %s: lease lost (stalled longer than the lease); grants restart from zero",
            self.instance_id,
        )
        for g in self._grants.values():
            g.granted = 0
            self._forget(g)

    async def heartbeat(self) -> None:
        """Renew the lease and give back the unused part of grants that saw no claim for a heartbeat."""
        started = time.monotonic()
        trims: dict[int, int] = {}
        for pid, g in self._grants.items():
            excess = g.granted - max(g.reserved, 0)
            if excess > 0 and not g.lock.locked() and started - g.last_claim >= self.idle_s:
                g.granted -= excess  # lowered in memory first: the database value never drops below it
                trims[pid] = excess
                if g.free is not None:  # what this instance gives back is free again: remaining is unchanged
                    g.free += excess
                g.epoch += 1  # a read in flight may have counted the grant before the trim: discard it
            g.fresh = False  # served until a request's background read refreshes it
        bg = s.budget_grants.c

        def tx(conn: Connection) -> bool:
            lost = self._ensure_lease(conn, epoch_ms(datetime.now(UTC)))
            for pid, excess in trims.items():
                conn.execute(
                    update(s.budget_grants)
                    .where(bg.instance_id == self.instance_id, bg.project_id == pid)
                    .values(amount_nano=bg.amount_nano - excess)
                )
            return lost

        if await self._writer.transaction(tx, "renew lease"):
            self._lost()
        self._lease_ok_until = started + self._lease_window()

    async def release(self, ticket: Ticket | None) -> None:
        """Drop a hold without spending (nothing was served). In memory only."""
        if ticket is not None and ticket.amount_nano:
            self._grant(ticket.project_id).reserved -= ticket.amount_nano

    def forget_all(self) -> None:
        """Drop every project's snapshot of ``free`` (a policy or budget changed): the next request reads
        it again."""
        for g in self._grants.values():
            self._forget(g)

    async def give_back(self) -> None:
        """Give this instance's grants and lease back (at shutdown, after the last settlement)."""
        me = self.instance_id

        def give_back(conn: Connection) -> None:
            conn.execute(delete(s.budget_grants).where(s.budget_grants.c.instance_id == me))
            conn.execute(delete(s.gateway_instances).where(s.gateway_instances.c.instance_id == me))

        if self._registered:
            try:
                await self._writer.transaction(give_back, "return grants")
            except StoreError as exc:  # the lease expires on its own
                log.warning("instance %s: returning grants failed: %s", me, exc.message)
            self._registered = False

    def applied(self, batch: list[Entry]) -> None:
        for e in batch:
            if e.grant_project is not None:
                g = self._grant(e.grant_project)
                g.granted -= e.row["cost_nano"]
                g.reserved -= e.held_nano

    def failed(self, batch: list[Entry]) -> None:
        for e in batch:  # the hold ends; the grant stays in the database (conservative)
            if e.grant_project is not None:
                self._grant(e.grant_project).reserved -= e.held_nano
