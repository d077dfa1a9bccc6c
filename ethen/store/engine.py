"""Engine set-up and the one error boundary from SQLAlchemy/driver errors to :mod:`ethen.store.errors`.

URLs: ``sqlite:///path.db`` (or ``sqlite+aiosqlite://``) and ``postgresql://...`` (or
``postgresql+asyncpg://``); the async driver is filled in when the URL names none.

SQLite choices:
- ``journal_mode=WAL`` (readers never block the writer) and ``synchronous=FULL``: in WAL mode ``NORMAL``
  survives a process crash (kill -9) but may lose the last commits on power loss/OS crash. The ledger is
  money, and a settled entry must survive whatever happened after the client got its answer, so we pay one
  fsync per commit. ``busy_timeout=10000`` ms, ``foreign_keys=ON``.
- Write transactions (the store runs them on ``engine.execution_options(ethen_write=True)``) start with
  ``BEGIN IMMEDIATE`` (pysqlite's implicit BEGIN is disabled): they take SQLite's write lock up front, so
  "read the window's spend, then insert a reservation" is atomic across connections *and processes*, with no
  lock-upgrade deadlock. Read-only work starts with a plain (deferred) ``BEGIN`` and, in WAL mode, runs
  concurrently with the writer.

Postgres: read-committed transactions; budget admission locks the project row (``SELECT ... FOR UPDATE``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .errors import StoreConflictError, StoreError, StoreInvalidError, StoreUnavailableError

__all__ = ["WRITE_OPTION", "boundary", "make_engine", "normalize_url", "redact_url", "sqlite_thread_engine"]

WRITE_OPTION = "ethen_write"


def normalize_url(url: str) -> str:
    try:
        u = make_url(url)
    except exc.ArgumentError:
        raise StoreInvalidError(f"store url {redact_url(url)!r}: not a database URL") from None
    backend = u.get_backend_name()
    if backend == "sqlite":
        u = u.set(drivername="sqlite+aiosqlite")
    elif backend == "postgresql":
        u = u.set(drivername="postgresql+asyncpg")
    else:
        raise StoreInvalidError(
            f"store url {redact_url(url)!r}: unsupported backend {backend!r} (use sqlite or postgresql)"
        )
    return u.render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except exc.ArgumentError:
        return "<unparseable url>"


def _set_wal(db: str) -> None:
    """Switch the file to WAL once, before any pooled connection exists.

    WAL is persistent in the file. Doing the switch in every pooled connection's connect hook let concurrent
    starters deadlock on a brand-new file (seen as "database is locked" after the busy timeout), so it is done
    here, synchronously, with the same busy timeout.
    """
    uri = db.startswith("file:")
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=10.0, uri=uri)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as e:
        raise StoreUnavailableError(f"sqlite {db!r}: database error ({e}) while enabling WAL") from None


def _sqlite_hooks(sync_engine: Engine, synchronous: str) -> None:
    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=10000")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION) else "BEGIN")


def make_engine(url: str, *, pool_size: int = 5, sqlite_synchronous: str = "FULL") -> AsyncEngine:
    """An async engine for ``url``. ``sqlite_synchronous`` exists for the benchmark's baseline."""
    if sqlite_synchronous not in ("FULL", "NORMAL", "EXTRA"):
        raise StoreInvalidError(f"sqlite_synchronous = {sqlite_synchronous!r}: use FULL, NORMAL or EXTRA")
    full = normalize_url(url)
    kwargs: dict[str, Any] = {}
    if full.startswith("postgresql"):
        kwargs = {"pool_size": pool_size, "max_overflow": pool_size, "pool_pre_ping": True}
    try:
        engine = create_async_engine(full, **kwargs)
    except (exc.ArgumentError, ImportError) as e:
        raise StoreInvalidError(f"store url {redact_url(url)!r}: {type(e).__name__}") from None
    if engine.dialect.name == "sqlite":
        db = engine.url.database
        if db and db != ":memory:" and not db.startswith("file:") and not Path(db).parent.is_dir():
            raise StoreInvalidError(
                f"store url {redact_url(url)!r}: directory {str(Path(db).parent)!r} does not exist"
            )
        if db and db != ":memory:":
            _set_wal(db)
        _sqlite_hooks(engine.sync_engine, sqlite_synchronous)
        engine.sync_engine.info_synchronous = sqlite_synchronous  # type: ignore[attr-defined]
    return engine


def sqlite_thread_engine(engine: AsyncEngine) -> Engine:
    """A synchronous engine on ``engine``'s SQLite file with the same settings, for a dedicated writer thread:
    a whole transaction then costs one thread hop instead of one per statement (aiosqlite)."""
    synchronous = getattr(engine.sync_engine, "info_synchronous", "FULL")
    sync = create_engine(engine.url.set(drivername="sqlite+pysqlite"), pool_size=1, max_overflow=0)
    _sqlite_hooks(sync, synchronous)
    return sync


@contextlib.contextmanager
def boundary(what: str) -> Iterator[None]:
    """Map SQLAlchemy and driver errors raised inside to the store's exception tree."""
    try:
        yield
    except StoreError:
        raise
    except exc.IntegrityError as e:
        raise StoreConflictError(f"{what}: conflicts with existing data ({type(e.orig).__name__})") from None
    except sqlite3.IntegrityError as e:  # the ledger writer's raw DBAPI batches (ethen.store.groupcommit)
        raise StoreConflictError(f"{what}: conflicts with existing data ({type(e).__name__})") from None
    except sqlite3.Error as e:
        raise StoreUnavailableError(f"{what}: database error ({type(e).__name__})") from None
    except (exc.DBAPIError, exc.SQLAlchemyError, OSError, ConnectionError) as e:
        orig = getattr(e, "orig", None)
        detail = type(orig).__name__ if orig is not None else type(e).__name__
        raise StoreUnavailableError(f"{what}: database error ({detail})") from None
    except Exception as e:  # asyncpg's own errors (the ledger writer's one-statement batches)
        if not type(e).__module__.startswith("asyncpg"):
            raise
        if any(c.__name__ == "IntegrityConstraintViolationError" for c in type(e).__mro__):
            raise StoreConflictError(f"{what}: conflicts with existing data ({type(e).__name__})") from None
        raise StoreUnavailableError(f"{what}: database error ({type(e).__name__})") from None
