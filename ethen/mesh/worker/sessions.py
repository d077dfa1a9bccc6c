"""Per-session KV caches on a worker: one cache per served fragment, an idle TTL and a memory cap.

Choices where the spec is silent:

- A session's state is keyed by fragment (its first layer), not by the span of one request: after a failover
  the orchestrator may address the same session with another span of this worker's fragments (e.g. only its
  second fragment), and each fragment's cache stands on its own.
- Memory is what the caches really allocate (they grow by doubling). Before a step, :meth:`SessionStore.admit`
  asks each cache what its footprint *would become* (``nbytes_after``) and refuses the step with
  :class:`SessionCapacityError` when the worker's total would pass ``max_bytes``, before any allocation (the
  server maps it to ``RESOURCE_EXHAUSTED``). ``max_sessions`` caps the number of live sessions the same way.
- Each session belongs to the caller that opened it (``owner``: the server passes the gRPC peer's host);
  ``max_per_owner`` caps how many one owner holds at once, so one caller cannot take every slot. A refusal
  names the cap (``max_sessions_per_caller``) and leaves the store as it was.
- Idle sessions (no Forward for ``ttl_s`` seconds) are evicted by :meth:`SessionStore.evict_idle`, which the
  server calls before each compute step and on ``Health``; time is always an argument (``now``).
- The store is not thread-safe by itself: the server serialises every call behind one lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ethen.mesh.worker.errors import SessionCapacityError, SessionNotFoundError, WorkerInputError

__all__ = ["CacheLike", "Session", "SessionStore"]


class CacheLike(Protocol):
    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def nbytes_after(self, n_new: int) -> int: ...


C = TypeVar("C", bound=CacheLike)


@dataclass(slots=True)
class Session(Generic[C]):
    session_id: str
    last_used: float
    caches: dict[int, C] = field(default_factory=dict)  # fragment first layer -> cache
    nbytes: int = 0
    owner: str = ""


class SessionStore(Generic[C]):
    """Sessions of one worker. ``new_cache(fragment_start)`` builds an empty cache for one fragment."""

    def __init__(self, new_cache: Callable[[int], C], max_bytes: int, ttl_s: float,
                 max_sessions: int = 256, max_per_owner: int | None = None) -> None:
        if max_bytes <= 0 or ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("max_bytes, ttl_s and max_sessions must be > 0")
        if max_per_owner is not None and max_per_owner <= 0:
            raise ValueError(f"max_per_owner must be > 0, got {max_per_owner}")
        self._new_cache = new_cache
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_owner = max_sessions if max_per_owner is None else max_per_owner
        self._sessions: dict[str, Session[C]] = {}
        self._owned: dict[str, int] = {}  # owner -> sessions it holds

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def length(self, session_id: str, fragments: Sequence[int]) -> int:
        """Cached positions of ``session_id`` on ``fragments`` (0 for an unknown session or fragment).

        Raises :class:`WorkerInputError` when the fragments disagree (the session was fed another span).
        """
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        found = {session.caches[f].length if f in session.caches else 0 for f in fragments}
        if len(found) != 1:
            raise WorkerInputError(
                f"session {session_id!r} has uneven cache lengths {sorted(found)} over fragments starting at "
                f"{list(fragments)}: address the span it was built with")
        return found.pop()

    def owned(self, owner: str) -> int:
        """Sessions ``owner`` holds now."""
        return self._owned.get(owner, 0)

    def admit(self, session_id: str, fragments: Sequence[int], tokens: int, now: float,
              owner: str = "") -> list[C]:
        """Check the caps for ``tokens`` more positions on ``fragments``; return each fragment's cache.
        A new session is recorded as ``owner``'s.

        Raises :class:`SessionCapacityError` (leaving the store as it was) when a cap would be exceeded.
        """
        session = self._sessions.get(session_id)
        if session is None and len(self._sessions) >= self.max_sessions:
            raise SessionCapacityError(
                f"session {session_id!r} refused: {len(self._sessions)} sessions open, "
                f"max_sessions={self.max_sessions}")
        if session is None and self._owned.get(owner, 0) >= self.max_per_owner:
            raise SessionCapacityError(
                f"session {session_id!r} refused: caller {owner!r} holds {self._owned[owner]} sessions, "
                f"max_sessions_per_caller={self.max_per_owner} (close one, or let it idle out after "
                f"{self.ttl_s:g}s)")
        caches = [session.caches[f] if session is not None and f in session.caches else self._new_cache(f)
                  for f in fragments]
        current = session.caches if session is not None else {}
        before = sum(c.nbytes for f, c in current.items() if f in fragments)
        after = sum(c.nbytes_after(tokens) for c in caches)
        total = self.nbytes
        if total - before + after > self.max_bytes:
            raise SessionCapacityError(
                f"session {session_id!r}: {tokens} more positions would bring this worker's KV caches to "
                f"{total - before + after} bytes, over max_cache_bytes={self.max_bytes} ({total} in use)")
        if session is None:
            session = Session(session_id=session_id, last_used=now, owner=owner)
            self._sessions[session_id] = session
            self._owned[owner] = self._owned.get(owner, 0) + 1
        session.last_used = now
        for f, c in zip(fragments, caches, strict=True):
            session.caches[f] = c
        return caches

    def refresh(self, session_id: str) -> None:
        """Re-measure a session's footprint after its caches changed."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.nbytes = sum(c.nbytes for c in session.caches.values())

    def require(self, session_id: str) -> Session[C]:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"unknown session_id {session_id!r} (closed, expired or never opened)")
        return session

    def close(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        left = self._owned[session.owner] - 1
        if left:
            self._owned[session.owner] = left
        else:
            del self._owned[session.owner]
        return True

    def evict_idle(self, now: float) -> list[str]:
        """Drop sessions idle for more than ``ttl_s``; returns their ids."""
        expired = [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
        for sid in expired:
            self.close(sid)
        return expired
