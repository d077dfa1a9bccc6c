"""Store test fixtures: every store test runs on SQLite (a temp file) and on PostgreSQL when
``ETHEN_TEST_PG_URL`` is set (``.ci/run`` starts one with ``.ci/postgres.sh``); otherwise the Postgres
variant skips with the reason. Each Postgres test gets its own fresh database (created and dropped here), so
concurrent test runs against the same server never share state."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ethen.db'}"
        return
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is not set (bash .ci/postgres.sh starts a local server and prints the URL)")
    with fresh_pg_database(url) as fresh:
        yield fresh


__all__ = ["PG_ENV", "fresh_pg_database"]
