"""``Hold.settle_rendering`` (ethen.gateway.accounting.hold): the answer's body is rendered while its ledger
entry
commits, and the answer waits for the commit. Real SQLite files (NORMAL and FULL) and real Postgres (with
ETHEN_TEST_PG_URL)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ethen.gateway.accounting.accounts import Access
from ethen.gateway.accounting.hold import Hold
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, ModelInfo, Prices
from ethen.store import Admission, Store
from ethen.store import schema as s
from tests.pgdb import pg_or_skip
from tests.store.test_admission import LEASE

CAND = Candidate("prov", "mod", ModelInfo(context_window=8192, max_output_tokens=1024), Prices(1.0, 4.0))


async def _run(url: str, sync: str) -> tuple[list[tuple[int, int]], int, int]:
    st = await Store.open(url, sqlite_synchronous=sync)
    try:
        await st.create_project("p", budget_usd=100.0, budget_window="day")
        key, _ = await st.create_key("p")
        adm = Admission(st, lease=LEASE)
        await adm.start()
        try:
            principal = await adm.authenticate(key)
            assert principal is not None
            ticket = await adm.reserve(principal.project, 0.01)
            hold = Hold(adm, Access("k", principal), None, "req-1", ticket, 0.01)
            writer = adm._writer
            seen: list[tuple[int, int]] = []

            def render() -> bytes:  # what the writer had done when the body was rendered
                seen.append((len(writer._pending), writer.entries))
                return b"{}"

            body = await hold.settle_rendering(CAND, Usage(100, 20), render)
            assert body == b"{}"
            async with st.engine.connect() as conn:
                rows = int(await conn.scalar(select(func.count()).select_from(s.ledger)) or 0)
            return seen, rows, writer.entries
        finally:
            await adm.aclose()
    finally:
        await st.aclose()


@pytest.mark.parametrize("backend", ["sqlite-NORMAL", "sqlite-FULL", "postgres"])
def test_the_writer_takes_the_entry_before_the_body_is_rendered_and_the_answer_waits_for_the_commit(
    backend: str, tmp_path: Path
) -> None:
    """When ``render`` runs, the writer has already taken the queued entry off its queue (its batch is on its
    way: Postgres's statement sent, SQLite FULL's COMMIT on its thread; NORMAL's inline batch done), and when
    ``settle_rendering`` returns the ledger row is committed. Without the loop turn before ``render``, the
    entry would still be queued while the body renders (the commit's round trip after the render)."""
    if backend == "postgres":
        with pg_or_skip() as url:
            seen, rows, entries = asyncio.run(_run(url, "FULL"))
    else:
        seen, rows, entries = asyncio.run(_run(f"sqlite:///{tmp_path / 'l.db'}", backend.split("-")[1]))
    assert seen and seen[0][0] == 0  # taken off the queue before the render
    assert rows == 1 and entries == 1  # committed before settle_rendering returned
