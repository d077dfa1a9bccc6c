"""Spend: window totals, budget reservations, settlement into the ledger, usage reports (see
:mod:`ethen.store.store` for the admission/settlement protocol)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NotRequired, TypedDict

from sqlalchemy import Connection, and_, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection
from typing_extensions import Unpack

from . import schema as s
from ._common import EngineBase, budget_nano, epoch_ms, now_utc
from .engine import boundary
from .errors import StoreNotFoundError
from .models import Project, Spend, UsageRow
from .values import aware, from_nano, to_nano, window_start

__all__ = ["LedgerEntry", "SpendLedger", "ledger_row"]


class LedgerEntry(TypedDict):
    """The fields of one settlement (the keyword arguments of :meth:`SpendLedger.settle` and
    :meth:`~ethen.store.admission.Admission.settle_soon`)."""

    request_id: str
    key_id: str | None
    provider: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    estimated: NotRequired[bool]
    now: NotRequired[datetime | None]
    #: issue 45: of ``prompt_tokens``, read from / written to the provider's prompt cache; what reads saved
    cache_read_tokens: NotRequired[int]
    cache_write_tokens: NotRequired[int]
    saved_usd: NotRequired[float]


def ledger_row(project: Project, entry: LedgerEntry) -> dict[str, Any]:
    """The ledger row of one settlement: token counts floored at 0, the cost in nano-dollars, the time UTC."""
    return {
        "request_id": entry["request_id"],
        "project_id": project.id,
        "key_id": entry["key_id"],
        "provider": entry["provider"],
        "model": entry["model"],
        "prompt_tokens": max(0, int(entry["prompt_tokens"])),
        "completion_tokens": max(0, int(entry["completion_tokens"])),
        "cost_nano": to_nano(entry["cost_usd"]),
        "estimated": int(entry.get("estimated", False)),
        "at": now_utc(entry.get("now")),
        "cache_read_tokens": max(0, int(entry.get("cache_read_tokens", 0))),
        "cache_write_tokens": max(0, int(entry.get("cache_write_tokens", 0))),
        "saved_nano": max(0, to_nano(entry.get("saved_usd", 0.0))),
    }


class SpendLedger(EngineBase):
    """Window spend, reservations, settlement and usage (mixed into :class:`ethen.store.Store`)."""

    @staticmethod
    def _sum_query(project_id: int, start: datetime, now: datetime) -> Any:
        """One select of (settled in the window, active reservations, grants of live instances). One
        statement, so one snapshot: under Postgres READ COMMITTED, separate statements could see a ledger
        batch commit between them (settled before it, grants after it) and count its cost in neither."""
        settled = select(func.coalesce(func.sum(s.daily_spend.c.settled_nano), 0)).where(
            s.daily_spend.c.project_id == project_id, s.daily_spend.c.day >= start.date().isoformat()
        )
        reserved = select(func.coalesce(func.sum(s.reservations.c.amount_nano), 0)).where(
            s.reservations.c.project_id == project_id, s.reservations.c.expires_at > now
        )
        granted = (
            select(func.coalesce(func.sum(s.budget_grants.c.amount_nano), 0))
            .join(s.gateway_instances, s.gateway_instances.c.instance_id == s.budget_grants.c.instance_id)
            .where(
                s.budget_grants.c.project_id == project_id,
                s.gateway_instances.c.lease_until_ms > epoch_ms(now),
            )
        )
        return select(settled.scalar_subquery(), reserved.scalar_subquery(), granted.scalar_subquery())

    async def _sums(
        self, conn: AsyncConnection, project_id: int, start: datetime, now: datetime
    ) -> tuple[int, int, int]:
        """(settled in the window, active reservations, grants of live instances), nano-USD."""
        row = (await conn.execute(self._sum_query(project_id, start, now))).one()
        return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0)

    @classmethod
    def sums_sync(
        cls, conn: Connection, project_id: int, start: datetime, now: datetime
    ) -> tuple[int, int, int]:
        """:meth:`_sums` on a synchronous connection."""
        row = conn.execute(cls._sum_query(project_id, start, now)).one()
        return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0)

    @classmethod
    def sums_and_lease_end_sync(
        cls, conn: Connection, project_id: int, start: datetime, now: datetime, me: str
    ) -> tuple[int, int, int, int | None]:
        """:meth:`sums_sync` plus, in the same statement, the soonest lease end (epoch ms) among the other
        live instances holding a grant of the project: when it passes, that grant stops counting and the
        free budget grows (``None``: no other instance holds any)."""
        gi, bg = s.gateway_instances.c, s.budget_grants.c
        ms = epoch_ms(now)
        soonest = (
            select(func.min(gi.lease_until_ms))
            .select_from(s.budget_grants.join(s.gateway_instances, gi.instance_id == bg.instance_id))
            .where(bg.project_id == project_id, bg.amount_nano > 0, bg.instance_id != me)
            .where(gi.lease_until_ms > ms)
        )
        q = cls._sum_query(project_id, start, now).add_columns(soonest.scalar_subquery())
        row = conn.execute(q).one()
        return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0), None if row[3] is None else int(row[3])

    async def spend(self, project: Project, *, now: datetime | None = None) -> Spend:
        at = now_utc(now)
        start = window_start(project.budget_window, at)
        with boundary("read spend"):
            async with self.engine.connect() as conn:
                settled, reserved, granted = await self._sums(conn, project.id, start, at)
        return Spend(project.budget_usd, from_nano(settled), from_nano(reserved), start, from_nano(granted))

    async def reserve(
        self,
        project: Project,
        amount_usd: float,
        *,
        request_id: str,
        key_id: str | None = None,
        ttl: timedelta = timedelta(minutes=15),
        now: datetime | None = None,
    ) -> int | None:
        """Atomically reserve ``amount_usd`` of the project's window budget: the reservation id, or ``None``
        when the remaining budget is smaller (nothing is written then)."""
        amount = budget_nano(amount_usd) or 0
        at = now_utc(now)
        with boundary("reserve budget"):
            async with self.writer.begin() as conn:
                row = (
                    await conn.execute(
                        select(s.projects.c.budget_nano, s.projects.c.budget_window)
                        .where(s.projects.c.id == project.id)
                        .with_for_update()
                    )
                ).first()
                if row is None:
                    raise StoreNotFoundError(f"project = {project.name!r}: no such project")
                budget, window = row
                if budget is not None:
                    settled, reserved, granted = await self._sums(
                        conn, project.id, window_start(window, at), at
                    )
                    if settled + reserved + granted + amount > budget:
                        return None
                res = await conn.execute(
                    s.reservations.insert().values(
                        request_id=request_id,
                        project_id=project.id,
                        key_id=key_id,
                        amount_nano=amount,
                        created_at=at,
                        expires_at=at + ttl,
                    )
                )
                pk = res.inserted_primary_key
                return int(pk[0]) if pk is not None else None

    async def settle(
        self,
        project: Project,
        *,
        reservation_id: int | None,
        **entry: Unpack[LedgerEntry],
    ) -> None:
        """Append the actual cost to the ledger and release the reservation, in one transaction."""
        row = ledger_row(project, entry)
        cost, at = row["cost_nano"], row["at"]
        with boundary("settle spend"):
            async with self.writer.begin() as conn:
                ins = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
                day = ins(s.daily_spend).values(
                    project_id=project.id, day=at.date().isoformat(), settled_nano=cost
                )
                await conn.execute(
                    day.on_conflict_do_update(
                        index_elements=["project_id", "day"],
                        set_={"settled_nano": s.daily_spend.c.settled_nano + cost},
                    )
                )
                await conn.execute(s.ledger.insert().values(**row))
                if reservation_id is not None:
                    await conn.execute(delete(s.reservations).where(s.reservations.c.id == reservation_id))

    async def release(self, reservation_id: int) -> None:
        """Drop a reservation without spending (the request failed before any upstream usage)."""
        with boundary("release reservation"):
            async with self.writer.begin() as conn:
                await conn.execute(delete(s.reservations).where(s.reservations.c.id == reservation_id))

    async def release_stale(self, instance_id: str | None = None, *, now: datetime | None = None) -> int:
        """Drop what no live process holds: expired reservations, the instances whose lease has passed and
        their budget grants, and every row of ``instance_id`` (this process's own id, when it reuses one).
        A live instance's grants are never touched. Returns how many grants and reservations were dropped."""
        at = now_utc(now)
        ms = epoch_ms(at)
        gi, bg = s.gateway_instances.c, s.budget_grants.c
        with boundary("release stale reservations"):
            async with self.writer.begin() as conn:
                dead = [
                    r[0] for r in await conn.execute(select(gi.instance_id).where(gi.lease_until_ms <= ms))
                ]
                if instance_id is not None:
                    dead.append(instance_id)
                n = 0
                if dead:
                    res = await conn.execute(delete(s.budget_grants).where(bg.instance_id.in_(dead)))
                    n += int(res.rowcount or 0)
                    await conn.execute(delete(s.gateway_instances).where(gi.instance_id.in_(dead)))
                res = await conn.execute(delete(s.reservations).where(s.reservations.c.expires_at <= at))
                return n + int(res.rowcount or 0)

    async def count_reservations(self) -> int:
        with boundary("count reservations"):
            async with self.engine.connect() as conn:
                return int(await conn.scalar(select(func.count()).select_from(s.reservations)) or 0)

    async def usage(
        self,
        *,
        project: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[UsageRow]:
        """Settled usage on ``[since, until)`` grouped by project, key, model and provider, with the prompt
        cache's reads and writes and what the reads saved (issue 45; rows settled before count 0)."""
        lc = s.ledger.c
        conds = []
        if project is not None:
            conds.append(s.projects.c.name == project)
        if since is not None:
            conds.append(lc.at >= aware(since, "since"))
        if until is not None:
            conds.append(lc.at < aware(until, "until"))
        q = (
            select(
                s.projects.c.name,
                lc.key_id,
                lc.model,
                lc.provider,
                func.count(),
                func.sum(lc.prompt_tokens),
                func.sum(lc.completion_tokens),
                func.sum(lc.cost_nano),
                func.sum(lc.cache_read_tokens),
                func.sum(lc.cache_write_tokens),
                func.sum(lc.saved_nano),
            )
            .join(s.projects, s.projects.c.id == lc.project_id)
            .where(and_(True, *conds))
            .group_by(s.projects.c.name, lc.key_id, lc.model, lc.provider)
            .order_by(s.projects.c.name, lc.key_id, lc.model, lc.provider)
        )
        with boundary("usage report"):
            async with self.engine.connect() as conn:
                rows = list(await conn.execute(q))
        return [
            UsageRow(
                r[0], r[1], r[2], r[3], int(r[4]), int(r[5] or 0), int(r[6] or 0), from_nano(int(r[7] or 0)),
                int(r[8] or 0), int(r[9] or 0), from_nano(int(r[10] or 0)),
            )
            for r in rows
        ]
