"""The store's one exception tree. Driver errors (sqlite3, aiosqlite, asyncpg, SQLAlchemy) are mapped to it at
one boundary (:func:`ethen.store.engine.boundary`); messages never contain key material or the database URL's
password."""

from __future__ import annotations

__all__ = [
    "StoreConflictError",
    "StoreError",
    "StoreInvalidError",
    "StoreNotFoundError",
    "StoreUnavailableError",
]


class StoreError(Exception):
    """Base of every store error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoreInvalidError(StoreError):
    """A bad value (names the field and the value)."""


class StoreNotFoundError(StoreError):
    """No such project / key / receipt."""


class StoreConflictError(StoreError):
    """A uniqueness or integrity conflict (e.g. a project name that already exists)."""


class StoreUnavailableError(StoreError):
    """The database could not be reached or failed (driver/operational error)."""
