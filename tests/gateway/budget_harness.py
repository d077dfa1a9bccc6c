"""Set-up shared by the store-backed gateway tests: a live gateway with a ``[store]`` (SQLite file or the
Postgres of ``ETHEN_TEST_PG_URL``), an admin client, and a store opened from the test side."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from ethen.store import Store
from tests.gateway.service_harness import Live, live
from tests.gateway.upstream import Behavior
from tests.pgdb import pg_or_skip

T = TypeVar("T")
ADMIN_KEY = "admin-7d1e0c4b9a8f7e6d5c4b3a291807f6e5"
ADMIN_PREFIX = "/api/admin/v1"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database: a SQLite file, or a new database on the Postgres server of ``ETHEN_TEST_PG_URL``."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gw.db'}"
        return
    with pg_or_skip() as fresh:
        yield fresh


def store_cfg(url: str) -> dict[str, Any]:
    return {"url": url, "admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}


@contextmanager
def live_store(url: str, behaviors: dict[str, Behavior] | None = None, **overrides: Any) -> Iterator[Live]:
    with live(behaviors, store=store_cfg(url), **overrides) as lv:
        yield lv


def admin(lv: Live, key: str = ADMIN_KEY) -> httpx.Client:
    return httpx.Client(
        base_url=f"{lv.gateway.url}{ADMIN_PREFIX}", headers={"authorization": f"Bearer {key}"}, timeout=10
    )


def with_store(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        st = await Store.open(url)
        try:
            return await fn(st)
        finally:
            await st.aclose()

    return asyncio.run(main())


def new_project_key(lv: Live, name: str, **policy: Any) -> str:
    with admin(lv) as a:
        r = a.post("/projects", json={"name": name, **policy})
        assert r.status_code == 201, r.text
        r = a.post(f"/projects/{name}/keys", json={"name": f"{name}-key"})
        assert r.status_code == 201, r.text
        key: str = r.json()["key"]
        return key


def held_reserved(lv: Live, project: str) -> int:
    """The live gateway's in-flight budget holds for ``project`` (nano-USD): holds live in the admission
    layer's memory (``ethen.store.admission``), not in the reservations table."""
    admission = lv.gateway.server.config.app.state.gateway.accounts.admission
    project_id = with_store(lv.cfg.store.url, lambda st: st.get_project(project)).id  # type: ignore[union-attr]
    return int(admission.held_nano(project_id)[1])
