"""Who may use the admin API and the ``/ui`` dashboard: the admin key, or a dashboard session (issue 14).

Either ``Authorization: Bearer <admin key>`` (compared as SHA-256 digests with :func:`hmac.compare_digest`),
or the session cookie the dashboard's ``POST /ui/login`` sets after checking the admin key. The cookie is
``HttpOnly``, ``SameSite=Strict``, ``Path=/``, 8 h (``Max-Age``) and ``Secure`` unless the request came over
loopback. A cookie-authenticated write (any method but GET/HEAD) must also send the session's CSRF token in
``x-csrf-token`` (the page reads it from its own ``<meta>``), so a cross-site form cannot write.

**Stateless sessions, valid on every instance.** The cookie is ``<expiry>.<session id>.<signature>``: the
expiry (Unix seconds), a random id (``secrets.token_urlsafe(16)``) and HMAC-SHA256 over both under the
*session key*. The CSRF token is another HMAC of the same two under that key, so it is derived from the
cookie and needs no storage. No gateway process holds a session: any process that has the key accepts the
cookie until its expiry, so ``ethen gateway --workers N`` and several instances behind a load balancer no
longer sign users out at random (issue 14: sessions used to live in each process's memory).

The session key is ``HMAC-SHA256(secret, "ethen dashboard session v1" || SHA-256(admin key))``:

- ``secret`` is 32 random bytes kept **in the store** (``store_secrets``, made once per database by migration
  ``0006``; :mod:`ethen.store.sessions`), so every instance on the database shares it and it never appears
  in a config file; a gateway **without a store** (``[log] admin_key_sha256``) keeps it in the data
  directory (``$ETHEN_DATA_DIR/dashboard_secret``, mode 600, made atomically by the first process), shared
  by the processes of one host (``--workers N``), not across hosts.
- the admin key's digest is in the derivation, so **rotating the admin key signs everyone out** (the old
  cookies' signatures no longer verify), on every instance that runs with the new key.

A forged, altered or expired cookie, or one signed under another key, is refused like no cookie at all
(:func:`hmac.compare_digest`; the expiry is inside the signature). **Sign-out**: ``POST /ui/logout`` drops
the cookie in the browser and records the session id until its expiry (``ended_sessions``), which every
instance polls every :data:`POLL_S` (0.5 s): the same cookie, replayed, is refused at once by the process
that signed it out and within a second by the others. Without a store, a sign-out is known to the
process that handled it only. Until :meth:`AdminAuth.start` has run (a unit test; the app calls it at
start-up) the key comes from a per-process random secret.

**Sign-in throttle** (issue 23: ``POST /ui/login`` answered 300 wrong keys in 0.2 s): :class:`LoginThrottle`
counts failed sign-ins per client address. After :data:`FREE_FAILURES` (5) failures in a row the address is
locked for 1 s, and each further failure doubles the lock (2, 4, ... at most 60 s). While locked, every
sign-in from the address, right key or wrong, is answered 429 with ``Retry-After`` without the key being
checked (so the lock cannot be used to test keys). A success resets the address; failures are forgotten 15
minutes after the last one. The table holds at most 4,096 addresses (the least recently failed one is dropped
first). It lives in each process: ``--workers N`` children each throttle on their own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request

from ethen.paths import data_dir as default_data_dir
from ethen.store import StoreError

if TYPE_CHECKING:
    from ethen.store import Store

__all__ = ["COOKIE", "FREE_FAILURES", "POLL_S", "SECRET_FILE", "AdminAuth", "LoginThrottle", "Session",
           "file_secret", "secure_cookie"]

log = logging.getLogger("ethen.admin.sessions")

COOKIE = "ethen_session"
POLL_S = 0.5  # how often an instance reads the sign-outs recorded by the others
SECRET_FILE = "dashboard_secret"
_SAFE = frozenset({"GET", "HEAD"})
_LOOPBACK = ("127.", "::1", "localhost")
_CONTEXT = b"ethen dashboard session v1\x00"
FREE_FAILURES = 5  # failed sign-ins in a row before an address is locked


@dataclass(frozen=True)
class Session:
    expires_at: float  # Unix seconds
    csrf: str
    session_id: str = ""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def file_secret(directory: Path) -> bytes:
    """The 32-byte secret in ``directory/dashboard_secret`` (hex), made atomically if missing (written to a
    temporary file, then hard-linked into place: concurrent processes end up reading one file)."""
    path = directory / SECRET_FILE
    for _ in range(50):  # bounded: a file being made by another process is complete once linked
        try:
            raw = bytes.fromhex(path.read_text().strip())
            if len(raw) == 32:
                return raw
            raise ValueError(f"{path}: expected 64 hex characters")
        except FileNotFoundError:
            pass
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process linked first: then read theirs
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    raise OSError(f"{path}: could not read or make the dashboard secret")


class AdminAuth:
    """The admin key's digest and the dashboard sessions' signing key (module docstring)."""

    def __init__(self, admin_key_sha256: str, ttl_s: float = 8 * 3600,
                 clock: Callable[[], float] = time.time, secret: bytes | None = None) -> None:
        self.expected = bytes.fromhex(admin_key_sha256)
        self.ttl_s = ttl_s
        self.clock = clock
        self._key = self._derive(secret if secret is not None else secrets.token_bytes(32))
        self._ended: dict[str, float] = {}  # session id -> expiry: signed out before it
        self._store: Store | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._poll_failed = False

    def _derive(self, secret: bytes) -> bytes:
        return hmac.new(secret, _CONTEXT + self.expected, hashlib.sha256).digest()

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self, store: Store | None, data_dir: Path | None = None) -> None:
        """Take the shared secret: the store's, else the data directory's (``ethen.paths.data_dir()`` unless
        given); with a store, also follow the sign-outs other instances record."""
        if store is not None:
            try:
                self._key = self._derive(await store.session_secret())
            except StoreError as exc:  # the dashboard must not keep the gateway from serving
                log.warning("dashboard sessions: %s; sessions hold in this process only", exc.message)
                return
            self._store = store
            await self._read_ended()
            self._poller = asyncio.create_task(self._poll())
            return
        if data_dir is None:
            data_dir = default_data_dir()
        try:
            self._key = self._derive(await asyncio.to_thread(file_secret, data_dir))
        except (OSError, ValueError) as exc:
            log.warning("dashboard sessions: %s; sessions hold in this process only", exc)

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        self._store = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self._read_ended()

    async def _read_ended(self) -> None:
        assert self._store is not None
        now = self.clock()
        try:
            ended = await self._store.ended_sessions(int(now * 1000))
        except StoreError as exc:
            if not self._poll_failed:
                log.warning("dashboard sessions: reading sign-outs failed: %s", exc.message)
            self._poll_failed = True
            return
        self._poll_failed = False
        for sid in [sid for sid, exp in self._ended.items() if exp <= now]:
            del self._ended[sid]
        self._ended.update({sid: ms / 1000 for sid, ms in ended.items()})

    # -- the admin key ---------------------------------------------------------------------------------
    def key_ok(self, key: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(key.strip().encode()).digest(), self.expected)

    def bearer_ok(self, request: Request) -> bool:
        scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and self.key_ok(key)

    # -- sessions --------------------------------------------------------------------------------------
    def _mac(self, purpose: str, expires: int, sid: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}|{expires}|{sid}".encode(), hashlib.sha256).digest())

    def login(self) -> tuple[str, Session]:
        """A new session: ``(cookie value, session)``."""
        expires, sid = int(self.clock() + self.ttl_s), secrets.token_urlsafe(16)
        cookie = f"{expires}.{sid}.{self._mac('session', expires, sid)}"
        return cookie, Session(float(expires), self._mac("csrf", expires, sid), sid)

    def session(self, request: Request) -> Session | None:
        """The request's session: a cookie signed under this key, not expired, not signed out."""
        raw = request.cookies.get(COOKIE) or ""
        parts = raw.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 12:
            return None
        expires, sid, mac = int(parts[0]), parts[1], parts[2]
        if not hmac.compare_digest(mac.encode(), self._mac("session", expires, sid).encode()):
            return None
        now = self.clock()
        if expires <= now or expires > now + self.ttl_s + 60 or sid in self._ended:
            return None
        return Session(float(expires), self._mac("csrf", expires, sid), sid)

    def logout(self, request: Request) -> None:
        """End the request's session: at once here, and (with a store) on every instance within
        :data:`POLL_S`."""
        s = self.session(request)
        if s is None:
            return
        self._ended[s.session_id] = s.expires_at
        if self._store is not None:
            store, now_ms = self._store, int(self.clock() * 1000)

            async def record() -> None:
                try:
                    await store.end_session(s.session_id, int(s.expires_at * 1000), now_ms)
                except StoreError as exc:
                    log.warning("dashboard sessions: recording a sign-out failed: %s", exc.message)

            task = asyncio.get_running_loop().create_task(record())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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


class LoginThrottle:
    """Failed sign-ins per client address (module docstring). Pure bookkeeping on an injected clock: the
    caller asks :meth:`retry_after` first and reports :meth:`failed` / :meth:`succeeded`."""

    def __init__(self, free_failures: int = FREE_FAILURES, base_lock_s: float = 1.0, max_lock_s: float = 60.0,
                 forget_after_s: float = 900.0, max_addresses: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.free_failures = free_failures
        self.base_lock_s = base_lock_s
        self.max_lock_s = max_lock_s
        self.forget_after_s = forget_after_s
        self.max_addresses = max_addresses
        self.clock = clock
        # address -> (failures in a row, last failure, locked until)
        self._failures: dict[str, tuple[int, float, float]] = {}

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        entry = self._failures.get(address)
        return 0.0 if entry is None else max(0.0, entry[2] - self.clock())

    def failed(self, address: str) -> float:
        """Record a failed sign-in; returns the lock it starts (0: none yet)."""
        now = self.clock()
        count, last, _ = self._failures.pop(address, (0, now, 0.0))
        if now - last > self.forget_after_s:
            count = 0
        count += 1
        lock = 0.0
        if count >= self.free_failures:
            lock = min(self.max_lock_s, self.base_lock_s * 2.0 ** min(count - self.free_failures, 62))
        self._failures[address] = (count, now, now + lock)  # re-inserted: the table stays in failure order
        while len(self._failures) > self.max_addresses:
            del self._failures[next(iter(self._failures))]
        return lock

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)
