"""Who may use the admin API and the ``/ui`` dashboard: the admin key, or a dashboard session (issue 14).

Either ``Authorization: Bearer <admin key>`` (compared as SHA-256 digests with :func:`hmac.compare_digest`),
or the session cookie the dashboard's ``POST /ui/login`` sets after checking the admin key. A session is a
random id (``secrets.token_urlsafe(32)``) mapped in memory to its expiry (8 h) and its CSRF token; the browser
holds only the id, in a cookie that is ``HttpOnly``, ``SameSite=Strict``, ``Path=/`` and ``Secure`` unless the
request came over loopback. A cookie-authenticated write (any method but GET/HEAD) must also send the
session's CSRF token in ``x-csrf-token`` (the page reads it from its own ``<meta>``), so a cross-site form
cannot write.

Choices where the issue is silent: sessions live in the gateway's memory (a restart signs everyone out;
several gateway instances each hold their own sessions); expired sessions are dropped when seen and on each
login, so the map stays bounded by the logins of the last 8 hours.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

__all__ = ["COOKIE", "AdminAuth", "Session", "secure_cookie"]

COOKIE = "ethen_session"
_SAFE = frozenset({"GET", "HEAD"})
_LOOPBACK = ("127.", "::1", "localhost")


@dataclass(frozen=True)
class Session:
    expires_at: float
    csrf: str


class AdminAuth:
    """The admin key's digest and the live dashboard sessions."""

    def __init__(self, admin_key_sha256: str, ttl_s: float = 8 * 3600,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.expected = bytes.fromhex(admin_key_sha256)
        self.ttl_s = ttl_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}

    def key_ok(self, key: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(key.strip().encode()).digest(), self.expected)

    def bearer_ok(self, request: Request) -> bool:
        scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and self.key_ok(key)

    def login(self) -> tuple[str, Session]:
        now = self.clock()
        for sid in [s for s, v in self.sessions.items() if v.expires_at <= now]:
            del self.sessions[sid]
        sid = secrets.token_urlsafe(32)
        session = Session(now + self.ttl_s, secrets.token_urlsafe(32))
        self.sessions[sid] = session
        return sid, session

    def logout(self, request: Request) -> None:
        self.sessions.pop(request.cookies.get(COOKIE) or "", None)

    def session(self, request: Request) -> Session | None:
        sid = request.cookies.get(COOKIE)
        s = self.sessions.get(sid) if sid else None
        if s is not None and s.expires_at <= self.clock():
            del self.sessions[sid or ""]
            return None
        return s

    def csrf_ok(self, request: Request, session: Session) -> bool:
        given = request.headers.get("x-csrf-token") or ""
        return hmac.compare_digest(given.encode(), session.csrf.encode())

    def allows(self, request: Request) -> bool:
        """The admin key as a bearer token, or a live session (plus its CSRF token for a write)."""
        if self.bearer_ok(request):
            return True
        s = self.session(request)
        return s is not None and (request.method in _SAFE or self.csrf_ok(request, s))


def secure_cookie(request: Request) -> bool:
    """``Secure`` unless the client is on loopback (plain-HTTP local use keeps working)."""
    host = request.client.host if request.client else ""
    return not host.startswith(_LOOPBACK)
