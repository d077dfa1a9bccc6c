"""Joined mesh workers where every gateway instance of one deployment sees them: the interface
(:class:`MemberBackend`) and its Redis backend (:class:`SharedMembers`); the store backend (the gateway's
``[store]`` when there is no Redis) is :class:`~ethen.mesh.orchestrator.store_members.StoreMembers`.

Layout (one Redis, the gateway's ``[shared]``; ``P`` = ``<key_prefix>:mesh:<provider id>``):

- ``P:node:<node id>``: the last announcement of a joined worker, JSON ``{"node_id", "address",
  "fragments": [[first, last], ...], "seen": <wall-clock seconds>, "by": <instance id>}``, written by the
  registry that got the ``Join`` with ``SET ... PX <expiry>``: Redis drops it when the worker stops
  announcing (its expiry is the writing instance's ``member_expiry_s``; each heartbeat renews it).
- ``P:nodes``: a set of the node ids ever written, the index a reader walks. One Lua script reads every
  live announcement and drops the ids whose key expired, atomically (a concurrent announcement cannot lose
  its index entry).

``Leave`` deletes the key only while it still names the leaving address (a late ``Leave`` of an old process
never drops its successor), in a script too. Every call is bounded by ``timeout_s`` (connect and read); any
redis-py or socket error becomes :class:`SharedMembersUnavailable` (one exception tree: it derives from
:class:`~ethen.mesh.orchestrator.errors.MeshRuntimeError`). Synchronous client: the membership runs on its own
thread and on the registry's gRPC threads, never on the gateway's event loop.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from ethen.mesh.orchestrator.errors import MeshRuntimeError

__all__ = ["Announcement", "MemberBackend", "SharedMembers", "SharedMembersUnavailable"]

_ERRORS = (RedisError, OSError, TimeoutError)

_READ = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then out[#out + 1] = v else redis.call('SREM', KEYS[1], id) end
end
return out
"""

_DELETE = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if cjson.decode(v)['address'] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""


class SharedMembersUnavailable(MeshRuntimeError):
    """The shared membership's backend did not answer (Redis or the store: refused, timed out, any driver
    error)."""


@dataclass(frozen=True, slots=True)
class Announcement:
    """One worker's announcement: where it serves and which fragments it holds."""

    node_id: str
    address: str
    fragments: tuple[tuple[int, int], ...] = ()


class MemberBackend(Protocol):
    """Where the shared membership lives (Redis or the gateway's store). Every call is synchronous and bounded
    (the membership's thread and the registry's gRPC threads call it); a failure raises
    :class:`SharedMembersUnavailable`."""

    kind: str  # "redis" or "store": named in the membership's log lines
    instance_id: str

    def write(self, a: Announcement, ttl_s: float) -> None:
        """Record ``a`` now; it lapses ``ttl_s`` seconds after unless written again."""

    def delete(self, node_id: str, address: str) -> bool:
        """Drop ``node_id``'s announcement if it still names ``address``; True when it did."""

    def read(self) -> dict[str, Announcement]:
        """Every live announcement, by node id."""

    def close(self) -> None:
        """Release the connections."""


class SharedMembers:
    """The joined workers of mesh provider ``provider_id`` in the Redis at ``url``."""

    kind = "redis"

    def __init__(self, url: str, provider_id: str, *, key_prefix: str = "ethen",
                 timeout_s: float = 0.5) -> None:
        base = f"{key_prefix}:mesh:{provider_id}"
        self.index = f"{base}:nodes"
        self.node_prefix = f"{base}:node:"
        self.instance_id = uuid.uuid4().hex[:12]
        self.url = url
        # one retry on a fresh connection: a pooled connection broken by a Redis restart fails once
        self._r: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self._read = self._r.register_script(_READ)
        self._delete = self._r.register_script(_DELETE)

    def write(self, a: Announcement, ttl_s: float) -> None:
        """Record ``a`` (now), dropped by Redis ``ttl_s`` seconds after unless announced again."""
        value = json.dumps({"node_id": a.node_id, "address": a.address,
                            "fragments": [list(f) for f in a.fragments], "seen": round(time.time(), 3),
                            "by": self.instance_id}, separators=(",", ":"))
        try:
            with self._r.pipeline(transaction=True) as pipe:
                pipe.set(self.node_prefix + a.node_id, value, px=max(1, int(ttl_s * 1000)))
                pipe.sadd(self.index, a.node_id)
                pipe.execute()
        except _ERRORS as exc:
            raise SharedMembersUnavailable(f"redis: {type(exc).__name__}: {exc}") from None

    def delete(self, node_id: str, address: str) -> bool:
        """Drop ``node_id``'s announcement if it still names ``address``; True when it did."""
        try:
            return bool(self._delete(keys=[self.node_prefix + node_id, self.index], args=[address, node_id]))
        except _ERRORS as exc:
            raise SharedMembersUnavailable(f"redis: {type(exc).__name__}: {exc}") from None

    def read(self) -> dict[str, Announcement]:
        """Every live announcement, by node id (malformed entries are skipped)."""
        try:
            raw: Sequence[bytes] = self._read(keys=[self.index], args=[self.node_prefix])
        except _ERRORS as exc:
            raise SharedMembersUnavailable(f"redis: {type(exc).__name__}: {exc}") from None
        out: dict[str, Announcement] = {}
        for item in raw:
            try:
                d = json.loads(item)
                a = Announcement(str(d["node_id"]), str(d["address"]),
                                 tuple((int(f[0]), int(f[1])) for f in d.get("fragments", ())))
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            out[a.node_id] = a
        return out

    def close(self) -> None:
        with contextlib.suppress(*_ERRORS):
            self._r.close()
