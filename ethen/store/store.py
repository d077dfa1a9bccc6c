"""The durable store: projects, API keys, spend ledger, budget reservations, certification receipts.

Every public method is one transaction and goes through :func:`~ethen.store.engine.boundary`, so callers only
ever see :mod:`ethen.store.errors`.

Budget admission on the gateway's request path is :class:`ethen.store.admission.Admission` (issue 11): keys
cached in memory and dropped on a change counter, per-instance budget *grants* admitted against in memory,
instance leases, and a group-committed ledger; see that module for the protocol and
:mod:`ethen.store.groupcommit` for the writer. The invariant at every commit, across all gateway processes on
one database, is ``settled(window) + grants of live instances + active reservations <= budget``.

:meth:`Store.reserve` / :meth:`Store.settle` / :meth:`Store.release` remain as the per-request protocol (one
transaction each, used by ``bench/store_admission.py`` as the baseline and counted in the same invariant): in
one write transaction (SQLite ``BEGIN IMMEDIATE``; Postgres ``SELECT ... FOR UPDATE`` on the project row)
read settled spend in the current window plus what is held, and insert a reservation only if it fits.
Settlement inserts the ledger row and deletes the reservation in one transaction. Reservations carry
``expires_at`` (default 15 minutes): an expired one no longer counts.

Start-up (:meth:`Store.release_stale`) deletes only what no live process holds: expired reservations, and
the rows and grants of instances whose lease has passed (or of the starter's own instance id). It never
touches a live instance's grants, so a second gateway, or a rolling restart, during load cannot make the
budget overspend (before issue 11 start-up deleted every reservation, live ones included).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Row, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ethen.aliases import ALIAS_NAMES

from . import schema as s
from ._common import budget_nano, now_utc, utc
from .engine import WRITE_OPTION, boundary, make_engine
from .errors import StoreInvalidError, StoreNotFoundError
from .keys import generate_key, parse_key, verify
from .migrations import applied, migrate_sync
from .models import KeyInfo, Principal, Project
from .receipts import Receipts
from .sessions import DashboardSessions
from .spending import SpendLedger
from .values import WINDOWS, Window, from_nano

__all__ = ["LAST_USED_GRANULARITY", "MAX_RATE", "UNSET", "Store", "rate_limit"]

#: ``last_used_at`` is refreshed when it is at least this old.
LAST_USED_GRANULARITY = timedelta(seconds=60)
#: The largest ``rpm`` / ``tpm`` a project or key may carry (far above any real limit; exact in Redis' Lua).
MAX_RATE = 10**12
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def _names(field: str, values: Sequence[str] | None) -> list[str] | None:
    if values is None:
        return None
    out: list[str] = []
    for i, v in enumerate(values):
        if not isinstance(v, str) or not v or len(v) > 200:
            raise StoreInvalidError(f"{field}[{i}] = {v!r}: must be a non-empty string (<= 200 chars)")
        out.append(v)
    return sorted(set(out))


def _window(value: str) -> Window:
    if value not in WINDOWS:
        raise StoreInvalidError(f"budget_window = {value!r}: must be one of {', '.join(WINDOWS)}")
    return value  # type: ignore[return-value]


def _alias(value: str | None) -> str | None:
    if value is not None and value not in ALIAS_NAMES:
        raise StoreInvalidError(f"default_alias = {value!r}: unknown alias (known: {sorted(ALIAS_NAMES)})")
    return value


def rate_limit(field: str, value: Any) -> int | None:
    """A project's or key's ``rpm`` / ``tpm``: ``None`` (no limit) or a whole number 1..:data:`MAX_RATE`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RATE:
        raise StoreInvalidError(f"{field} = {value!r}: must be a whole number from 1 to {MAX_RATE}, or null")
    return value


def _project(r: Row[Any]) -> Project:
    m = r._mapping
    return Project(
        id=m["id"],
        name=m["name"],
        allowed_providers=tuple(m["allowed_providers"]) if m["allowed_providers"] is not None else None,
        allowed_models=tuple(m["allowed_models"]) if m["allowed_models"] is not None else None,
        budget_usd=from_nano(m["budget_nano"]) if m["budget_nano"] is not None else None,
        budget_window=m["budget_window"],
        default_alias=m["default_alias"],
        created_at=utc(m["created_at"]) or datetime.now(UTC),
        rpm=m["rpm"],
        tpm=m["tpm"],
    )


class Store(SpendLedger, Receipts, DashboardSessions):
    """Async access to the gateway's durable state. Create with :meth:`open` (migrates), close with
    :meth:`aclose`."""

    def __init__(self, engine: AsyncEngine, *, postgres_synchronous_commit: str = "on") -> None:
        if postgres_synchronous_commit not in ("on", "off"):
            raise StoreInvalidError(
                f"postgres_synchronous_commit = {postgres_synchronous_commit!r}: use on or off")
        self.engine = engine
        #: Postgres only: ``synchronous_commit`` of the ledger writer's connection (its settlements), see
        #: :mod:`ethen.store.groupcommit`. Every other write of the store keeps the server's setting.
        self.postgres_synchronous_commit = postgres_synchronous_commit
        self.writer = engine.execution_options(**{WRITE_OPTION: True})  # same pool; see engine.py
        #: Called (no arguments) after this process revoked a key or changed a project's policy: the
        #: in-process caches of :class:`ethen.store.admission.Admission` drop at once.
        self.on_change: list[Callable[[], None]] = []

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, sqlite_synchronous: str = "FULL",
                   postgres_synchronous_commit: str = "on") -> Store:
        engine = make_engine(url, sqlite_synchronous=sqlite_synchronous)
        try:
            store = cls(engine, postgres_synchronous_commit=postgres_synchronous_commit)
        except BaseException:
            await engine.dispose()
            raise
        if migrate:
            try:
                await store.migrate()
            except BaseException:
                await store.aclose()
                raise
        return store

    async def aclose(self) -> None:
        await self.engine.dispose()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @staticmethod
    async def _bump_changes(conn: AsyncConnection) -> None:
        """Bump the change counter other processes poll (same transaction as the change)."""
        await conn.execute(
            update(s.store_changes)
            .where(s.store_changes.c.id == 1)
            .values(counter=s.store_changes.c.counter + 1)
        )

    def _changed(self) -> None:
        for fn in list(self.on_change):
            fn()

    async def changes(self) -> int:
        """The change counter (bumped by every key revocation and project policy change)."""
        with boundary("read change counter"):
            async with self.engine.connect() as conn:
                return int(
                    await conn.scalar(select(s.store_changes.c.counter).where(s.store_changes.c.id == 1)) or 0
                )

    # -- migrations ------------------------------------------------------------------------------------
    async def migrate(self) -> list[str]:
        with boundary("migrate"):
            async with self.writer.begin() as conn:
                return await conn.run_sync(migrate_sync)

    async def applied_migrations(self) -> list[str]:
        with boundary("list migrations"):
            async with self.writer.begin() as conn:
                return await conn.run_sync(applied)

    # -- projects --------------------------------------------------------------------------------------
    async def create_project(
        self,
        name: str,
        *,
        allowed_providers: Sequence[str] | None = None,
        allowed_models: Sequence[str] | None = None,
        budget_usd: float | None = None,
        budget_window: str = "month",
        default_alias: str | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        now: datetime | None = None,
    ) -> Project:
        if not isinstance(name, str) or not _NAME.match(name):
            raise StoreInvalidError(f"project = {name!r}: use 1-100 characters of [A-Za-z0-9._-]")
        values = {
            "name": name,
            "allowed_providers": _names("allowed_providers", allowed_providers),
            "allowed_models": _names("allowed_models", allowed_models),
            "budget_nano": budget_nano(budget_usd),
            "budget_window": _window(budget_window),
            "default_alias": _alias(default_alias),
            "rpm": rate_limit("rpm", rpm),
            "tpm": rate_limit("tpm", tpm),
            "created_at": now_utc(now),
        }
        with boundary(f"create project {name!r}"):
            async with self.writer.begin() as conn:
                await conn.execute(s.projects.insert().values(**values))
                return await self._project(conn, name)

    async def _project(self, conn: AsyncConnection, name: str) -> Project:
        r = (await conn.execute(select(s.projects).where(s.projects.c.name == name))).first()
        if r is None:
            raise StoreNotFoundError(f"project = {name!r}: no such project")
        return _project(r)

    async def get_project(self, name: str) -> Project:
        with boundary(f"read project {name!r}"):
            async with self.engine.connect() as conn:
                return await self._project(conn, name)

    async def list_projects(self) -> list[Project]:
        with boundary("list projects"):
            async with self.engine.connect() as conn:
                rows = await conn.execute(select(s.projects).order_by(s.projects.c.name))
                return [_project(r) for r in rows]

    async def update_project(
        self,
        name: str,
        *,
        allowed_providers: Sequence[str] | None = UNSET,
        allowed_models: Sequence[str] | None = UNSET,
        budget_usd: float | None = UNSET,
        budget_window: str = UNSET,
        default_alias: str | None = UNSET,
        rpm: int | None = UNSET,
        tpm: int | None = UNSET,
    ) -> Project:
        """Change some policy fields (``UNSET`` keeps a field; ``None`` clears a restriction/budget/limit).
        Every instance applies it within about a second (the change counter, ``ethen.store.admission``).
        """
        values: dict[str, Any] = {}
        if allowed_providers is not UNSET:
            values["allowed_providers"] = _names("allowed_providers", allowed_providers)
        if allowed_models is not UNSET:
            values["allowed_models"] = _names("allowed_models", allowed_models)
        if budget_usd is not UNSET:
            values["budget_nano"] = budget_nano(budget_usd)
        if budget_window is not UNSET:
            values["budget_window"] = _window(budget_window)
        if default_alias is not UNSET:
            values["default_alias"] = _alias(default_alias)
        for field, value in (("rpm", rpm), ("tpm", tpm)):
            if value is not UNSET:
                values[field] = rate_limit(field, value)
        with boundary(f"update project {name!r}"):
            async with self.writer.begin() as conn:
                if values:
                    res = await conn.execute(
                        update(s.projects).where(s.projects.c.name == name).values(**values)
                    )
                    if res.rowcount == 0:
                        raise StoreNotFoundError(f"project = {name!r}: no such project")
                    await self._bump_changes(conn)
                project = await self._project(conn, name)
        if values:
            self._changed()
        return project

    # -- keys ------------------------------------------------------------------------------------------
    async def create_key(
        self,
        project: str,
        *,
        name: str | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        now: datetime | None = None,
    ) -> tuple[str, KeyInfo]:
        """A new key for ``project`` (with its own rate limits, if any): ``(full key, shown once; public
        info)``."""
        rpm, tpm = rate_limit("rpm", rpm), rate_limit("tpm", tpm)
        new = generate_key()
        at = now_utc(now)
        with boundary(f"create key for project {project!r}"):
            async with self.writer.begin() as conn:
                p = await self._project(conn, project)
                await conn.execute(
                    s.api_keys.insert().values(
                        key_id=new.key_id,
                        project_id=p.id,
                        name=name,
                        salt=new.salt,
                        digest=new.digest,
                        created_at=at,
                        rpm=rpm,
                        tpm=tpm,
                    )
                )
        return new.key, KeyInfo(new.key_id, project, name, at, None, None, rpm, tpm)

    def _keys_query(self) -> Any:
        k = s.api_keys.c
        return select(
            k.key_id, s.projects.c.name, k.name, k.created_at, k.revoked_at, k.last_used_at, k.rpm, k.tpm
        ).join(s.projects, s.projects.c.id == k.project_id)

    @staticmethod
    def _keyinfo(r: Any) -> KeyInfo:
        return KeyInfo(r[0], r[1], r[2], utc(r[3]) or datetime.now(UTC), utc(r[4]), utc(r[5]), r[6], r[7])

    async def list_keys(self, project: str | None = None) -> list[KeyInfo]:
        q = self._keys_query().order_by(s.api_keys.c.created_at, s.api_keys.c.key_id)
        if project is not None:
            q = q.where(s.projects.c.name == project)
        with boundary("list keys"):
            async with self.engine.connect() as conn:
                return [self._keyinfo(r) for r in await conn.execute(q)]

    async def get_key(self, key_id: str) -> KeyInfo:
        with boundary("read key"):
            async with self.engine.connect() as conn:
                r = (await conn.execute(self._keys_query().where(s.api_keys.c.key_id == key_id))).first()
        if r is None:
            raise StoreNotFoundError(f"key_id = {key_id!r}: no such key")
        return self._keyinfo(r)

    async def update_key(self, key_id: str, *, rpm: int | None = UNSET, tpm: int | None = UNSET) -> KeyInfo:
        """Change a key's own rate limits (``UNSET`` keeps one, ``None`` clears it); seen by every instance
        within about a second, like a revocation."""
        values = {f: rate_limit(f, v) for f, v in (("rpm", rpm), ("tpm", tpm)) if v is not UNSET}
        with boundary("update key"):
            async with self.writer.begin() as conn:
                if values:
                    res = await conn.execute(
                        update(s.api_keys).where(s.api_keys.c.key_id == key_id).values(**values)
                    )
                    if res.rowcount == 0:
                        raise StoreNotFoundError(f"key_id = {key_id!r}: no such key")
                    await self._bump_changes(conn)
        if values:
            self._changed()
        return await self.get_key(key_id)

    async def revoke_key(self, key_id: str, *, now: datetime | None = None) -> KeyInfo:
        with boundary("revoke key"):
            async with self.writer.begin() as conn:
                await conn.execute(
                    update(s.api_keys)
                    .where(s.api_keys.c.key_id == key_id, s.api_keys.c.revoked_at.is_(None))
                    .values(revoked_at=now_utc(now))
                )
                await self._bump_changes(conn)
        self._changed()
        return await self.get_key(key_id)

    async def touch_key(self, key_id: str, *, now: datetime | None = None) -> None:
        """Record ``last_used_at`` (the admission cache calls this at most once per key per
        :data:`LAST_USED_GRANULARITY`)."""
        with boundary("record key use"):
            async with self.writer.begin() as conn:
                await conn.execute(
                    update(s.api_keys).where(s.api_keys.c.key_id == key_id).values(last_used_at=now_utc(now))
                )

    async def authenticate(self, key: str, *, now: datetime | None = None) -> Principal | None:
        """The principal of a valid, unrevoked store key, else ``None``. Records ``last_used_at`` with
        :data:`LAST_USED_GRANULARITY` (one write per key per minute at most, not one per request)."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        k = s.api_keys.c
        with boundary("authenticate"):
            async with self.engine.connect() as conn:
                r = (
                    await conn.execute(
                        select(
                            k.salt, k.digest, k.revoked_at, k.last_used_at, k.rpm.label("key_rpm"),
                            k.tpm.label("key_tpm"), s.projects,
                        )
                        .join(s.projects, s.projects.c.id == k.project_id)
                        .where(k.key_id == parsed.key_id)
                    )
                ).first()
            if r is None or not verify(parsed.secret, bytes(r[0]), bytes(r[1])) or r[2] is not None:
                return None
            at = now_utc(now)
            last = utc(r[3])
            if last is None or at - last >= LAST_USED_GRANULARITY:
                async with self.writer.begin() as conn:
                    await conn.execute(
                        update(s.api_keys).where(k.key_id == parsed.key_id).values(last_used_at=at)
                    )
        return Principal(parsed.key_id, _project(r), r[4], r[5])
