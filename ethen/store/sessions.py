"""What the dashboard's sessions need from the store (issue 14; mixed into :class:`ethen.store.Store`).

- :meth:`DashboardSessions.session_secret`: 32 random bytes made once per database (migration
  ``0006_dashboard_sessions``, or here on first use), from which :mod:`ethen.admin.sessions` derives the key
  that signs session cookies. Every gateway instance on the database reads the same bytes, so a cookie signed
  by one instance is accepted by all. The secret never leaves the store and the gateway's memory.
- :meth:`DashboardSessions.end_session` / :meth:`DashboardSessions.ended_sessions`: a sign-out before a
  session's expiry is recorded (session id and expiry) and polled by every instance, so a signed-out cookie
  stops working everywhere. Rows are pruned once their session has expired (the cookie is dead anyway).
"""

from __future__ import annotations

import secrets

from sqlalchemy import delete, select

from . import schema as s
from ._common import EngineBase
from .engine import boundary
from .errors import StoreConflictError

__all__ = ["SESSION_SECRET", "DashboardSessions"]

SESSION_SECRET = "dashboard_session"


class DashboardSessions(EngineBase):
    """The dashboard session secret and signed-out sessions (mixed into :class:`ethen.store.Store`)."""

    async def session_secret(self) -> bytes:
        """The database's session-signing secret (made now if missing; concurrent makers agree)."""
        q = select(s.store_secrets.c.value).where(s.store_secrets.c.name == SESSION_SECRET)
        with boundary("read session secret"):
            async with self.engine.connect() as conn:
                found = await conn.scalar(q)
        if found is not None:
            return bytes(found)
        try:
            with boundary("make session secret"):
                async with self.writer.begin() as conn:
                    await conn.execute(
                        s.store_secrets.insert().values(name=SESSION_SECRET, value=secrets.token_bytes(32))
                    )
        except StoreConflictError:
            pass  # another instance made it first: read theirs
        with boundary("read session secret"):
            async with self.engine.connect() as conn:
                made = await conn.scalar(q)
        assert made is not None
        return bytes(made)

    async def end_session(self, session_id: str, expires_at_ms: int, now_ms: int) -> None:
        """Record a sign-out (idempotent) and prune the records of sessions expired by ``now_ms``."""
        es = s.ended_sessions.c
        with boundary("record sign-out"):
            async with self.writer.begin() as conn:
                await conn.execute(delete(s.ended_sessions).where(es.expires_at_ms <= now_ms))
                await conn.execute(delete(s.ended_sessions).where(es.session_id == session_id))
                await conn.execute(
                    s.ended_sessions.insert().values(session_id=session_id, expires_at_ms=expires_at_ms)
                )

    async def ended_sessions(self, now_ms: int) -> dict[str, int]:
        """Signed-out sessions that have not expired yet: ``{session id: expiry (epoch ms)}``."""
        es = s.ended_sessions.c
        with boundary("read sign-outs"):
            async with self.engine.connect() as conn:
                q = select(es.session_id, es.expires_at_ms).where(es.expires_at_ms > now_ms)
                rows = await conn.execute(q)
                return {r[0]: int(r[1]) for r in rows}
