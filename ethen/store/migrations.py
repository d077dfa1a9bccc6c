"""Ordered, recorded schema migrations: simple named migrations in the ``ethen_migrations`` table.

Why not Alembic: the schema is small, the gateway must migrate itself at start on SQLite and Postgres alike,
and Alembic would add a second config system and a script directory. Each migration has a unique, ordered
name (``0001_initial``) and a function of a SQLAlchemy connection; applied names are recorded with their time.

Robustness: all pending migrations run in **one transaction** together with the bookkeeping rows, so a crash
leaves either the old or the new schema. Concurrent starters are serialized: Postgres takes a transaction-
scoped advisory lock, SQLite's ``BEGIN IMMEDIATE`` (see :mod:`ethen.store.engine`) takes the write lock; the
second starter then sees the recorded names and does nothing (idempotent). A database recording a migration
this code does not know (a newer version) is refused rather than silently run against.

Rule for future migrations: append, never edit an applied one. ``0001_initial`` creates the tables as they
are defined in :mod:`ethen.store.schema` at that version; later schema changes must come as new migrations
with explicit DDL. ``0001`` runs ``create_all`` over the *current* definitions, so a fresh database already
has a column a later migration adds: such a migration adds only the columns it finds missing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import Connection, inspect, select, text

from . import schema as s
from .errors import StoreError
from .members import create_mesh_members
from .requests import create_request_attempts, create_request_log
from .sessions import SESSION_SECRET
from .shadows import create_shadow_pairs

__all__ = ["MIGRATIONS", "applied", "migrate_sync"]

_INITIAL = [s.projects, s.api_keys, s.ledger, s.reservations, s.certifications]


def _initial(conn: Connection) -> None:
    s.metadata.create_all(conn, tables=_INITIAL)


def _daily_spend(conn: Connection) -> None:
    """Per-day settled totals, backfilled from the ledger (aggregated in Python: portable date handling)."""
    s.daily_spend.create(conn)
    totals: dict[tuple[int, str], int] = {}
    for pid, at, cost in conn.execute(select(s.ledger.c.project_id, s.ledger.c.at, s.ledger.c.cost_nano)):
        day = (at if at.tzinfo is None else at.astimezone(UTC)).date().isoformat()
        totals[(pid, day)] = totals.get((pid, day), 0) + int(cost)
    if totals:
        conn.execute(
            s.daily_spend.insert(),
            [{"project_id": p, "day": d, "settled_nano": n} for (p, d), n in totals.items()],
        )


def _instances(conn: Connection) -> None:
    """Instance leases, per-instance budget grants and the change counter (issue 11)."""
    for table in (s.gateway_instances, s.budget_grants, s.store_changes):
        table.create(conn)
    conn.execute(s.store_changes.insert().values(id=1, counter=0))


def _add_columns(conn: Connection, table: str, columns: dict[str, str]) -> None:
    """``ALTER TABLE ... ADD COLUMN`` for each of ``columns`` (name -> SQL type) the table lacks."""
    have = {c["name"] for c in inspect(conn).get_columns(table)}
    for name, sql_type in columns.items():
        if name not in have:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type}"))


def _rate_limits(conn: Connection) -> None:
    """Rate limits in the project policy and on each key (issue 11): ``rpm`` / ``tpm``, NULL = none."""
    for table in ("projects", "api_keys"):
        _add_columns(conn, table, {"rpm": "BIGINT", "tpm": "BIGINT"})


def _dashboard_sessions(conn: Connection) -> None:
    """The dashboard's session-signing secret (random, made here once per database) and signed-out sessions
    (issue 14: sessions valid on every gateway instance of the database; ``ethen.store.sessions``)."""
    s.store_secrets.create(conn)
    s.ended_sessions.create(conn)
    conn.execute(s.store_secrets.insert().values(name=SESSION_SECRET, value=secrets.token_bytes(32)))


def _prompt_cache(conn: Connection) -> None:
    """Issue 45: the prompt-cache reads and writes and what the reads saved, per ledger and request-log row
    (NULL on the rows before)."""
    cols = {"cache_read_tokens": "BIGINT", "cache_write_tokens": "BIGINT", "saved_nano": "BIGINT"}
    for table in ("ledger", "request_log"):
        _add_columns(conn, table, cols)


MIGRATIONS: tuple[tuple[str, Callable[[Connection], None]], ...] = (
    ("0001_initial", _initial),
    ("0002_daily_spend", _daily_spend),
    ("0003_instances_grants_changes", _instances),
    ("0004_request_log", create_request_log),  # issue 14: ethen.store.requests
    ("0005_rate_limits", _rate_limits),  # issue 11: rpm / tpm on projects and keys
    ("0006_dashboard_sessions", _dashboard_sessions),  # issue 14: ethen.store.sessions
    ("0007_request_attempts", create_request_attempts),  # issue 14: the log's attempts, one per row
    ("0008_mesh_members", create_mesh_members),  # issue 12: ethen.store.members
    ("0009_shadow_pairs", create_shadow_pairs),  # issue 27: ethen.store.shadows
    ("0010_prompt_cache", _prompt_cache),  # issue 45: cache reads/writes and savings, ledger and request log
)


def applied(conn: Connection) -> list[str]:
    s.migrations.create(conn, checkfirst=True)
    return [r[0] for r in conn.execute(select(s.migrations.c.name).order_by(s.migrations.c.name))]


def migrate_sync(conn: Connection) -> list[str]:
    """Apply the pending migrations inside the caller's transaction; return the names applied now."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(7319001)"))
    done = applied(conn)
    known = [name for name, _ in MIGRATIONS]
    unknown = [n for n in done if n not in known]
    if unknown:
        raise StoreError(f"database has migrations this version does not know: {unknown} (newer ethen?)")
    ran: list[str] = []
    for name, fn in MIGRATIONS:
        if name in done:
            continue
        fn(conn)
        conn.execute(s.migrations.insert().values(name=name, applied_at=datetime.now(UTC)))
        ran.append(name)
    return ran
