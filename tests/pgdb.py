"""Fresh PostgreSQL databases for the store-backed tests (tests/store and the gateway's budget tests).

Every such test runs on SQLite and, when ``ETHEN_TEST_PG_URL`` is set (``.ci/run`` starts a server with
``.ci/postgres.sh``), on its own new database on that server, created and dropped here, so concurrent runs
against the same server never share state."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
import warnings
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy.engine import make_url

PG_ENV = "ETHEN_TEST_PG_URL"


def _plain(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_pg_database(url: str) -> Iterator[str]:
    """A new, empty database on ``url``'s server (dropped afterwards)."""
    import asyncpg

    name = f"ethen_t_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(_plain(url))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop(admin, name)


def _drop(admin: Callable[[str], Coroutine[Any, Any, None]], name: str) -> None:
    """Drop a test database. FORCE cannot end a server process of another role (an autovacuum worker that
    just started on the new database): then wait and retry, bounded; if it still lingers, leave the database
    (named ``ethen_t_*``) rather than fail the test it served."""
    import asyncpg

    for attempt in range(20):
        try:
            asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except asyncpg.exceptions.InsufficientPrivilegeError:
            time.sleep(0.25 * (attempt + 1) if attempt < 4 else 1.0)
    warnings.warn(f"test database {name!r} left behind: a server process of another role kept it open",
                  stacklevel=2)


@contextmanager
def pg_or_skip() -> Iterator[str]:
    """A fresh database on the ``ETHEN_TEST_PG_URL`` server, or skip the test with the reason."""
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is not set (bash .ci/postgres.sh starts a local server and prints the URL)")
    with fresh_pg_database(url) as fresh:
        yield fresh


__all__ = ["PG_ENV", "fresh_pg_database", "pg_or_skip"]
