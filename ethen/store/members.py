"""Joined mesh workers in the gateway's store (issue 12): the membership every gateway instance of one
database sees when the deployment has no ``[shared]`` Redis (:mod:`ethen.mesh.orchestrator.store_members`
drives it).

Table ``mesh_members`` (migration ``0008_mesh_members``), one row per (mesh provider id, node id): the
worker's address, its fragments (JSON ``[[first, last], ...]``), when it first announced this address
(``joined_ms``), its last announcement (``seen_ms``), when that announcement lapses (``expires_ms`` = seen +
the writing instance's ``member_expiry_s``) and the instance that wrote it (``instance``).

Choices:

- **One clock: the database's.** ``seen_ms`` and ``expires_ms`` come from the database server's clock in
  the write itself (Postgres ``statement_timestamp()``, SQLite ``julianday('now')``), and a read compares
  with that same clock, as Redis's own ``PX`` expiry does: gateway hosts whose clocks disagree do not shift
  expiry.
- **The read** (:meth:`MemberTable.live`) is one query over the primary key's prefix: the provider's rows
  whose ``expires_ms`` is still ahead. Every joined worker re-announces every <= 2 s, so a "changed since"
  read would return nearly every row anyway, and could not see a deleted row without tombstones.
- A ``Leave`` deletes the row only while it still names the leaving address (a late ``Leave`` of an old
  process never drops its successor). Lapsed rows are filtered out by the read and deleted by
  :meth:`MemberTable.sweep` (the writer calls it at most once per expiry period).
- Errors cross :func:`ethen.store.engine.boundary`: :class:`~ethen.store.errors.StoreUnavailableError` when
  the database does not answer or the table is missing (not migrated).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Connection,
    MetaData,
    String,
    Table,
    and_,
    case,
    event,
    literal_column,
    select,
)
from sqlalchemy import delete as sa_delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.base import Executable

from .engine import WRITE_OPTION, boundary, make_engine, sqlite_thread_engine
from .errors import StoreInvalidError

__all__ = [
    "MemberRow", "MemberTable", "SyncMemberTable", "create_mesh_members", "mesh_members", "open_member_table",
]

_metadata = MetaData()

mesh_members = Table(
    "mesh_members",
    _metadata,
    Column("provider", String(100), primary_key=True),
    Column("node_id", String(200), primary_key=True),
    Column("address", String(300), nullable=False),
    Column("fragments", String(2000), nullable=False),
    Column("joined_ms", BigInteger, nullable=False),
    Column("seen_ms", BigInteger, nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    Column("instance", String(64), nullable=False),
)


def create_mesh_members(conn: Connection) -> None:
    """The migration that creates the table (``ethen.store.migrations``)."""
    _metadata.create_all(conn, tables=[mesh_members])


@dataclass(frozen=True, slots=True)
class MemberRow:
    """One live announcement as stored."""

    node_id: str
    address: str
    fragments: tuple[tuple[int, int], ...]
    joined_ms: int
    seen_ms: int
    expires_ms: int
    instance: str


def _now_ms(dialect: str) -> ColumnElement[int]:
    """The database server's wall clock in Unix milliseconds, as a SQL expression."""
    if dialect == "postgresql":
        return literal_column("CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)", BigInteger)
    return literal_column("CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)", BigInteger)


def _fragments(raw: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple((int(f[0]), int(f[1])) for f in json.loads(raw))
    except (ValueError, TypeError, IndexError, KeyError):
        return ()


class _Statements:
    """The table's statements for one provider and dialect (shared by the async and the sync table)."""

    def __init__(self, dialect: str, provider: str) -> None:
        if not provider or len(provider) > 100:
            raise StoreInvalidError(f"mesh provider id = {provider!r}: must be 1-100 characters")
        self.dialect = dialect
        self.provider = provider
        self._now = _now_ms(dialect)

    def announce(self, node_id: str, address: str, fragments: Sequence[tuple[int, int]], ttl_ms: int,
                 instance: str) -> Executable:
        t = mesh_members
        values = {"provider": self.provider, "node_id": node_id, "address": address,
                  "fragments": json.dumps([list(f) for f in fragments], separators=(",", ":")),
                  "joined_ms": self._now, "seen_ms": self._now, "expires_ms": self._now + max(1, ttl_ms),
                  "instance": instance}
        insert = postgresql.insert(t) if self.dialect == "postgresql" else sqlite.insert(t)
        stmt = insert.values(**values)
        new = stmt.excluded
        return stmt.on_conflict_do_update(
            index_elements=[t.c.provider, t.c.node_id],
            set_={"address": new.address, "fragments": new.fragments, "seen_ms": new.seen_ms,
                  "expires_ms": new.expires_ms, "instance": new.instance,
                  "joined_ms": case((t.c.address == new.address, t.c.joined_ms), else_=new.joined_ms)})

    def forget(self, node_id: str, address: str) -> Executable:
        t = mesh_members
        return sa_delete(t).where(
            and_(t.c.provider == self.provider, t.c.node_id == node_id, t.c.address == address))

    def live(self) -> Executable:
        t = mesh_members
        return select(t.c.node_id, t.c.address, t.c.fragments, t.c.joined_ms, t.c.seen_ms, t.c.expires_ms,
                      t.c.instance).where(and_(t.c.provider == self.provider, t.c.expires_ms > self._now))

    def sweep(self) -> Executable:
        t = mesh_members
        return sa_delete(t).where(and_(t.c.provider == self.provider, t.c.expires_ms <= self._now))

    @staticmethod
    def rows(rows: Sequence[Sequence[Any]]) -> list[MemberRow]:
        return [MemberRow(str(r[0]), str(r[1]), _fragments(str(r[2])), int(r[3]), int(r[4]), int(r[5]),
                          str(r[6])) for r in rows]


class MemberTable:
    """The ``mesh_members`` rows of mesh provider ``provider`` on ``engine`` (any async engine of the store's
    database; writes run as write transactions, see :mod:`ethen.store.engine`)."""

    def __init__(self, engine: AsyncEngine, provider: str) -> None:
        self._sql = _Statements(engine.dialect.name, provider)
        self.provider = provider
        self.engine = engine
        self.writer = engine.execution_options(**{WRITE_OPTION: True})
        # Postgres: the read is one statement, so no transaction (BEGIN and ROLLBACK are two more round trips)
        self.reader = (engine.execution_options(isolation_level="AUTOCOMMIT")
                       if engine.dialect.name == "postgresql" else engine)

    async def announce(self, node_id: str, address: str, fragments: Sequence[tuple[int, int]], ttl_ms: int,
                       instance: str) -> None:
        """Record an announcement now (insert, or renew the row; ``joined_ms`` is kept while the address
        stays the same)."""
        with boundary("announce mesh member"):
            async with self.writer.begin() as conn:
                await conn.execute(self._sql.announce(node_id, address, fragments, ttl_ms, instance))

    async def forget(self, node_id: str, address: str) -> bool:
        """Delete ``node_id``'s row if it still names ``address``; True when it did."""
        with boundary("delete mesh member"):
            async with self.writer.begin() as conn:
                return bool((await conn.execute(self._sql.forget(node_id, address))).rowcount)

    async def live(self) -> list[MemberRow]:
        """The provider's rows whose announcement has not lapsed (database clock)."""
        with boundary("read mesh members"):
            async with self.reader.connect() as conn:
                return self._sql.rows((await conn.execute(self._sql.live())).all())

    async def sweep(self) -> int:
        """Delete the provider's lapsed rows; the number deleted."""
        with boundary("sweep mesh members"):
            async with self.writer.begin() as conn:
                return int((await conn.execute(self._sql.sweep())).rowcount or 0)


class SyncMemberTable:
    """:class:`MemberTable` on a synchronous engine (SQLite: :func:`ethen.store.engine.sqlite_thread_engine`,
    whose hooks give write transactions ``BEGIN IMMEDIATE``): the caller's thread runs the statement, no
    event loop and no driver thread in between (a read costs ~0.15 ms where aiosqlite's hops cost 1.5-5 ms
    on the loaded test VM). Not thread-safe on its own: callers serialize (one pooled connection)."""

    def __init__(self, engine: Engine, provider: str) -> None:
        self._sql = _Statements(engine.dialect.name, provider)
        self.provider = provider
        self.engine = engine
        self.writer = engine.execution_options(**{WRITE_OPTION: True})

    def announce(self, node_id: str, address: str, fragments: Sequence[tuple[int, int]], ttl_ms: int,
                 instance: str) -> None:
        with boundary("announce mesh member"), self.writer.begin() as conn:
            conn.execute(self._sql.announce(node_id, address, fragments, ttl_ms, instance))

    def forget(self, node_id: str, address: str) -> bool:
        with boundary("delete mesh member"), self.writer.begin() as conn:
            return bool(conn.execute(self._sql.forget(node_id, address)).rowcount)

    def live(self) -> list[MemberRow]:
        with boundary("read mesh members"), self.engine.connect() as conn:
            return self._sql.rows(conn.execute(self._sql.live()).all())

    def sweep(self) -> int:
        with boundary("sweep mesh members"), self.writer.begin() as conn:
            return int(conn.execute(self._sql.sweep()).rowcount or 0)


def _sqlite_engine(engine: AsyncEngine, timeout_s: float) -> Engine:
    """A synchronous engine on ``engine``'s SQLite file with the store's settings, ``synchronous=NORMAL``
    and a busy timeout of ``timeout_s``."""
    sync = sqlite_thread_engine(engine)
    busy_ms = max(1, int(timeout_s * 1000))

    @event.listens_for(sync, "connect")
    def _busy(dbapi_conn: Any, _record: Any) -> None:  # after the store's own hook: overrides its 10 s
        dbapi_conn.execute(f"PRAGMA busy_timeout={busy_ms}")

    return sync


def open_member_table(url: str, provider_id: str, *, timeout_s: float) -> MemberTable | SyncMemberTable:
    """The joined-members table of mesh provider ``provider_id`` in the store at ``url``: on SQLite a
    :class:`SyncMemberTable` (its own connection, ``synchronous=NORMAL``, a busy timeout of ``timeout_s``),
    else a :class:`MemberTable` on an async engine. Raises :class:`~ethen.store.errors.StoreError`."""
    engine = make_engine(url, pool_size=1, sqlite_synchronous="NORMAL")
    if engine.dialect.name == "sqlite":
        return SyncMemberTable(_sqlite_engine(engine, timeout_s), provider_id)
    return MemberTable(engine, provider_id)
