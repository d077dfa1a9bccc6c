"""Store test fixtures: every store test runs on SQLite (a temp file) and on PostgreSQL when
``ETHEN_TEST_PG_URL`` is set (``.ci/run`` starts one with ``.ci/postgres.sh``); otherwise the Postgres
variant skips with the reason."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

PG_ENV = "ETHEN_TEST_PG_URL"


def reset_postgres(url: str) -> None:
    """Drop every table of the test database (each test starts from an empty schema)."""

    async def _drop() -> None:
        from ethen.store.engine import make_engine

        e = make_engine(url)
        async with e.begin() as conn:
            await conn.execute(text("DROP SCHEMA public CASCADE"))
            await conn.execute(text("CREATE SCHEMA public"))
        await e.dispose()

    asyncio.run(_drop())


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ethen.db'}"
        return
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} is not set (bash .ci/postgres.sh starts a local server and prints the URL)")
    reset_postgres(url)
    yield url


__all__ = ["PG_ENV", "reset_postgres"]
