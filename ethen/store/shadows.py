"""Shadow pairs (issue 27, shadow evaluation): one row per request also sent to a ``[[shadows]]`` candidate,
with both sides' outcome and how far the answers agree. Written by the gateway's shadow runner
(``ethen.gateway.api.shadow``) off the request path; read by ``GET /api/admin/v1/shadows``.

A row: request id, alias, the primary (the candidate that served the client: ``provider/model``), the shadow
candidate, the time it was recorded (UTC), per side latency and TTFT (ms), prompt and completion tokens,
cost (nano-USD: the primary at its settled usage price, the shadow at what its project was charged) and
status (``ok``, or the error code of a failed shadow call), whether the client streamed, and the agreement
fields (:mod:`ethen.gateway.observation.agreement`): ``exact``, ``similarity``, ``tool_calls_equal``,
``schema_valid``, ``primary_schema_valid`` (``NULL`` when the shadow failed, or when not applicable).

Listing: newest first by id (keyset cursor like the request log), filtered by alias and/or candidate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    select,
)

from ._common import EngineBase, utc
from .engine import boundary

__all__ = ["PAIR_COLUMNS", "ShadowQuery", "create_shadow_pairs", "insert_pair", "list_pairs", "shadow_pairs"]

_metadata = MetaData()
_ID = BigInteger().with_variant(Integer(), "sqlite")

shadow_pairs = Table(
    "shadow_pairs",
    _metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("alias", String(200), nullable=False),
    Column("primary_candidate", String(300), nullable=False),
    Column("candidate", String(300), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("primary_latency_ms", Float, nullable=True),
    Column("primary_ttft_ms", Float, nullable=True),
    Column("candidate_latency_ms", Float, nullable=True),
    Column("candidate_ttft_ms", Float, nullable=True),
    Column("primary_prompt_tokens", BigInteger, nullable=True),
    Column("primary_completion_tokens", BigInteger, nullable=True),
    Column("candidate_prompt_tokens", BigInteger, nullable=True),
    Column("candidate_completion_tokens", BigInteger, nullable=True),
    Column("primary_cost_nano", BigInteger, nullable=True),
    Column("candidate_cost_nano", BigInteger, nullable=True),
    Column("primary_status", String(40), nullable=False),
    Column("candidate_status", String(100), nullable=False),
    Column("exact", Boolean, nullable=True),
    Column("similarity", Float, nullable=True),
    Column("tool_calls_equal", Boolean, nullable=True),
    Column("schema_valid", Boolean, nullable=True),
    Column("primary_schema_valid", Boolean, nullable=True),
    Index("ix_shadow_pairs_alias_candidate", "alias", "candidate", "id"),
    Index("ix_shadow_pairs_candidate", "candidate", "id"),
)

#: the columns of a row, as inserted (``id`` is assigned by the database)
PAIR_COLUMNS = tuple(c.name for c in shadow_pairs.columns if c.name != "id")
Write = Callable[[Callable[[Connection], Any], str], Awaitable[Any]]


def create_shadow_pairs(conn: Connection) -> None:
    """Migration ``0009_shadow_pairs``."""
    _metadata.create_all(conn, tables=[shadow_pairs])


@dataclass(frozen=True, slots=True)
class ShadowQuery:
    alias: str | None = None
    candidate: str | None = None
    limit: int = 50
    before_id: int | None = None


def _row(m: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(m)
    at = utc(out["at"])
    out["at"] = at.isoformat() if at is not None else None
    return out


async def insert_pair(store: EngineBase, row: Mapping[str, Any], write: Write | None = None) -> int:
    """Insert one pair (every column of :data:`PAIR_COLUMNS`); returns its id. Through ``write`` (the
    gateway's ledger writer, :meth:`ethen.store.Admission.write`) when given."""
    values = {k: row[k] for k in PAIR_COLUMNS}

    def tx(conn: Connection) -> int:
        res = conn.execute(shadow_pairs.insert().values(**values))
        return int(res.inserted_primary_key[0]) if res.inserted_primary_key else 0

    if write is not None:
        return int(await write(tx, "write shadow pair"))
    with boundary("write shadow pair"):
        async with store.writer.begin() as conn:
            return await conn.run_sync(tx)


async def list_pairs(store: EngineBase, q: ShadowQuery) -> list[dict[str, Any]]:
    """Pairs passing ``q``, newest first, at most ``q.limit``; ``at`` as ISO-8601 UTC."""
    c = shadow_pairs.c
    conds: list[Any] = []
    if q.alias is not None:
        conds.append(c.alias == q.alias)
    if q.candidate is not None:
        conds.append(c.candidate == q.candidate)
    if q.before_id is not None:
        conds.append(c.id < q.before_id)
    stmt = select(shadow_pairs).where(and_(True, *conds)).order_by(c.id.desc()).limit(q.limit)
    with boundary("read shadow pairs"):
        async with store.engine.connect() as conn:
            return [_row(dict(r._mapping)) for r in await conn.execute(stmt)]

