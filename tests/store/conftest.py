"""Store test fixtures: every store test runs on SQLite (a temp file) and on PostgreSQL when
``ETHEN_TEST_PG_URL`` is set (see :mod:`tests.pgdb`); otherwise the Postgres variant skips with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pgdb import PG_ENV, fresh_pg_database, pg_or_skip


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ethen.db'}"
        return
    with pg_or_skip() as fresh:
        yield fresh


__all__ = ["PG_ENV", "fresh_pg_database"]
