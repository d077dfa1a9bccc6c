"""Table definitions (SQLAlchemy Core). Money columns are integer nano-USD (see :mod:`ethen.store.values`);
datetimes are stored timezone-aware (``DateTime(timezone=True)``; SQLite keeps ISO text, read back as UTC by
the store). Policy lists are JSON arrays (``NULL`` = unrestricted)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)

__all__ = [
    "api_keys",
    "budget_grants",
    "certifications",
    "daily_spend",
    "ended_sessions",
    "gateway_instances",
    "ledger",
    "metadata",
    "migrations",
    "projects",
    "reservations",
    "store_changes",
    "store_secrets",
]

metadata = MetaData()

migrations = Table(
    "ethen_migrations",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("applied_at", DateTime(timezone=True), nullable=False),
)

projects = Table(
    "projects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("allowed_providers", JSON, nullable=True),
    Column("allowed_models", JSON, nullable=True),
    Column("budget_nano", BigInteger, nullable=True),
    Column("budget_window", String(10), nullable=False, default="month"),
    Column("default_alias", String(100), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("rpm", BigInteger, nullable=True),  # 0005: requests / tokens per rate-limit window (NULL: none)
    Column("tpm", BigInteger, nullable=True),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key_id", String(12), nullable=False, unique=True),
    Column("project_id", Integer, ForeignKey("projects.id"), nullable=False),
    Column("name", String(100), nullable=True),
    Column("salt", LargeBinary(16), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
    Column("last_used_at", DateTime(timezone=True), nullable=True),
    Column("rpm", BigInteger, nullable=True),  # 0005
    Column("tpm", BigInteger, nullable=True),
)

ledger = Table(
    "ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("project_id", Integer, ForeignKey("projects.id"), nullable=False),
    Column("key_id", String(12), nullable=True),
    Column("provider", String(100), nullable=False),
    Column("model", String(200), nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_nano", BigInteger, nullable=False),
    Column("estimated", Integer, nullable=False, default=0),
    Column("at", DateTime(timezone=True), nullable=False),
    # 0010 (issue 45): of prompt_tokens, read from / written to the provider's prompt cache, and what the
    # reads saved against the input price (nano-USD); NULL on rows settled before
    Column("cache_read_tokens", BigInteger, nullable=True),
    Column("cache_write_tokens", BigInteger, nullable=True),
    Column("saved_nano", BigInteger, nullable=True),
    Index("ix_ledger_project_at", "project_id", "at"),
)

reservations = Table(
    "reservations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("project_id", Integer, ForeignKey("projects.id"), nullable=False),
    Column("key_id", String(12), nullable=True),
    Column("amount_nano", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_reservations_project", "project_id"),
)

certifications = Table(
    "certifications",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("receipt_id", String(40), nullable=False, unique=True),
    Column("provider", String(100), nullable=False),
    Column("model", String(200), nullable=False),
    Column("certified_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("probe", JSON, nullable=False),
    Index("ix_cert_target", "provider", "model", "expires_at"),
)

#: Settled spend per project and UTC day (``YYYY-MM-DD``), maintained in the same transaction as each ledger
#: insert, so a window's settled spend is a sum over at most 31 rows instead of a scan of the ledger.
daily_spend = Table(
    "daily_spend",
    metadata,
    Column("project_id", Integer, ForeignKey("projects.id"), primary_key=True),
    Column("day", String(10), primary_key=True),
    Column("settled_nano", BigInteger, nullable=False),
)

#: Live gateway processes (see :mod:`ethen.store.escrow`): each renews its lease while it runs; a row whose
#: ``lease_until_ms`` (Unix epoch milliseconds) has passed belongs to a dead (or stalled) process.
gateway_instances = Table(
    "gateway_instances",
    metadata,
    Column("instance_id", String(64), primary_key=True),
    Column("started_at_ms", BigInteger, nullable=False),
    Column("lease_until_ms", BigInteger, nullable=False),
)

#: Budget an instance has taken from a project's window budget and not yet settled (its escrow). Counts
#: against the budget while the instance's lease is live; settlement moves cost from here into the ledger.
budget_grants = Table(
    "budget_grants",
    metadata,
    Column("instance_id", String(64), primary_key=True),
    Column("project_id", Integer, ForeignKey("projects.id"), primary_key=True),
    Column("amount_nano", BigInteger, nullable=False),
)

#: One row (``id = 1``): a counter bumped by every key revocation and project policy change, polled by the
#: gateways to drop their key/policy caches.
store_changes = Table(
    "store_changes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("counter", BigInteger, nullable=False),
)

#: Random secrets made once per database (0006): ``dashboard_session`` keys the dashboard's signed session
#: cookies (``ethen.admin.sessions``), so every gateway instance on the database accepts the others' cookies.
store_secrets = Table(
    "store_secrets",
    metadata,
    Column("name", String(50), primary_key=True),
    Column("value", LargeBinary(64), nullable=False),
)

#: Dashboard sessions signed out before their expiry (epoch ms), polled by all instances; pruned when expired.
ended_sessions = Table(
    "ended_sessions",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("expires_at_ms", BigInteger, nullable=False),
)
