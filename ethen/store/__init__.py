"""Durable gateway state (issue 6): projects with window budgets, API keys, the spend ledger, budget
reservations and live-certification receipts, on SQLAlchemy 2 async (SQLite in WAL mode by default, or
Postgres). See :mod:`ethen.store.store` for the admission/settlement protocol, :mod:`ethen.store.migrations`
for the schema versioning and :mod:`ethen.store.values` for money and windows."""

from .admission import Admission
from .errors import (
    StoreConflictError,
    StoreError,
    StoreInvalidError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from .escrow import Ticket
from .keys import KEY_PREFIX, generate_key, parse_key
from .members import MemberRow, MemberTable, SyncMemberTable, open_member_table
from .migrations import MIGRATIONS
from .models import CertificationReceipt, KeyInfo, Principal, Project, Spend, UsageRow, usage_report
from .store import UNSET, Store
from .values import WINDOWS, window_start

__all__ = [
    "KEY_PREFIX",
    "MIGRATIONS",
    "UNSET",
    "WINDOWS",
    "Admission",
    "CertificationReceipt",
    "KeyInfo",
    "MemberRow",
    "MemberTable",
    "Principal",
    "Project",
    "Spend",
    "Store",
    "StoreConflictError",
    "StoreError",
    "StoreInvalidError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "SyncMemberTable",
    "Ticket",
    "UsageRow",
    "generate_key",
    "open_member_table",
    "parse_key",
    "usage_report",
    "window_start",
]
