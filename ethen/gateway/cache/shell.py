"""The response cache's shell: reads the clock, talks to the backend, counts the metrics.

:class:`ResponseCache` is built from ``[cache]`` (:func:`response_cache_for`; ``None`` when disabled) and
used by the request path (:class:`~ethen.gateway.api.pipeline.Pipeline`):

- :meth:`ResponseCache.consult` (at admission, after the routing decision): the request's verdict and key
  (:mod:`ethen.gateway.cache.policy`) as a :class:`CacheCall`;
- :meth:`ResponseCache.lookup`: the stored entry, if any and readable: a hit or a miss (both counted);
- :meth:`ResponseCache.store_body` / :meth:`ResponseCache.store_stream`: keep a successful answer.

``x-ethen-cache`` on the answer and ``cache`` on the receipt come from :meth:`CacheCall.header` /
:meth:`CacheCall.receipt`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ethen.gateway.cache.backends import Backend, MemoryBackend, RedisBackend
from ethen.gateway.cache.entry import Entry, decode, encode_body, encode_stream
from ethen.gateway.cache.policy import IGNORED, CachePolicy, cache_key, directive, verdict

if TYPE_CHECKING:
    from ethen.gateway.config import CacheConfig
    from ethen.gateway.observation.metrics import GatewayMetrics
    from ethen.gateway.redis_state import SharedState

__all__ = ["CacheCall", "ResponseCache", "response_cache_for"]


@dataclass(slots=True)
class CacheCall:
    """One request's dealings with the cache: its key (``None``: not cacheable), whether it may be served
    from and stored in the cache, the bypass reason, and after the lookup its status and entry."""

    key: str | None
    read: bool
    write: bool
    reason: str | None
    status: str = "bypass"  # hit | miss | bypass
    entry: Entry | None = None
    age_s: float | None = None

    @property
    def header(self) -> str:
        """The ``x-ethen-cache`` value."""
        return self.status

    def receipt(self) -> dict[str, Any]:
        """The receipt's ``cache``: ``{hit, age_s}`` (+ ``status``, and ``reason`` for a bypass)."""
        out: dict[str, Any] = {"hit": self.status == "hit", "age_s": self.age_s, "status": self.status}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


class ResponseCache:
    """The gateway's response cache (module docstring). ``wall`` / ``mono``: the clocks (tests pass fakes)."""

    def __init__(self, policy: CachePolicy, backend: Backend, metrics: GatewayMetrics | None = None, *,
                 wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.backend = backend
        self.wall = wall
        self.mono = mono
        self.metrics = metrics
        if metrics is not None:
            metrics.cache_entries.set_function(lambda: backend.entries)
            metrics.cache_bytes.set_function(lambda: backend.size)

    def consult(self, scope: str, endpoint: str, body: Mapping[str, Any], payload: Mapping[str, Any],
                cache_control: str | None, pragma: str | None, sent: Mapping[str, Any] | None = None,
                beta: str | None = None) -> CacheCall:
        """The request's verdict and key (no I/O): ``body`` is what the router saw, ``payload`` what goes
        upstream; ``sent``: the client's body before an endpoint's translation, ``beta``: its
        ``anthropic-beta`` header (both in the key when there was a translation)."""
        read, write, reason = verdict(self.policy, body, directive(cache_control, pragma))
        key = None
        if read or write:
            client = None
            if sent is not None:
                kept = {k: v for k, v in sent.items() if k not in IGNORED and k != "providerOptions"}
                client = {"body": kept, "anthropic-beta": beta}
            key = cache_key(scope, endpoint, payload, client)
        return CacheCall(key, read, write, reason)

    async def lookup(self, cc: CacheCall, usable: Callable[[Entry], bool]) -> Entry | None:
        """The entry to serve (``usable`` checks its candidate), counting a hit or a miss; ``None`` when
        the request may not read the cache or nothing usable is stored."""
        if not cc.read or cc.key is None:
            return None
        raw = await self.backend.get(cc.key, self.mono())
        entry = decode(raw) if raw is not None else None
        if entry is not None and usable(entry):
            cc.status, cc.entry = "hit", entry
            cc.age_s = round(max(0.0, self.wall() - entry.at), 3)
            if self.metrics is not None:
                self.metrics.cache_hits.inc()
            return entry
        cc.status = "miss"
        if self.metrics is not None:
            self.metrics.cache_misses.inc()
        return None

    def store_body(self, cc: CacheCall, candidate: str, body: bytes) -> None:
        """Keep a buffered answer (its JSON, without the gateway's receipt)."""
        if cc.write and cc.key is not None:
            self.backend.put(cc.key, encode_body(self.wall(), candidate, body), self.mono())

    def store_stream(self, cc: CacheCall, candidate: str, chunks: Sequence[bytes]) -> None:
        """Keep a stream that completed normally (its chunk payloads)."""
        if cc.write and cc.key is not None:
            raw = encode_stream(self.wall(), candidate, chunks)
            if raw is not None:
                self.backend.put(cc.key, raw, self.mono())

    async def aclose(self) -> None:
        await self.backend.aclose()


def response_cache_for(cfg: CacheConfig, shared: SharedState | None,
                       metrics: GatewayMetrics | None = None) -> ResponseCache | None:
    """The cache of a ``[cache]`` section (``None`` unless ``enabled``); ``redis`` needs ``shared`` (the
    config's cross-check has made sure there is one)."""
    if not cfg.enabled:
        return None
    policy = CachePolicy.of(True, cfg.cache_nondeterministic, cfg.aliases, cfg.routes)
    backend: Backend
    if cfg.backend == "redis":
        assert shared is not None, "[cache] backend = 'redis' needs [shared]"
        backend = RedisBackend(shared, cfg.ttl_s)
    else:
        backend = MemoryBackend(cfg.max_entries, cfg.ttl_s)
    return ResponseCache(policy, backend, metrics)
