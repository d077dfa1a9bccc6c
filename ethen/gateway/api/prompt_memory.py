"""The shell of cache-aware routing (issue 45 item 2): before a decision, which providers hold the request's
prompt prefix in their prompt cache; after an answer, who holds it now. The memory and its rules are pure
(:mod:`ethen.gateway.routing.prefix`); this adds the clock, the providers' kinds and the ``[shared]`` Redis.

Scope: a project (``project:<name>``), else the config key (``config:<name>``): one project never learns
another's prefixes. With ``[shared]`` Redis, every instance writes what it served to a hash per (scope,
prompt hash) (``<key_prefix>:pcache:<scope>:<hash>``, field ``provider/model``, value ``tokens expiry``, the
key expiring with its longest-kept holder) and a lookup reads the request's prefixes there in one pipelined
round trip, folding them into its own memory; Redis unreachable: the instance's own memory answers.

``[prompt_cache] cache_aware_routing = false`` (``aware``): the memory is neither read nor written, every
candidate is priced uncached (the baseline of ``bench/prompt_cache.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ethen.gateway.errors import SharedStateUnavailableError
from ethen.gateway.redis_state import SharedState
from ethen.gateway.routing import Candidate, PrefixMemory, cache_ttl_s, prefix_hashes
from ethen.gateway.routing.prefix import MIN_CACHED_TOKENS

__all__ = ["PrefixSeen", "PromptMemory"]

log = logging.getLogger("ethen.gateway.prompt_cache")
#: the longest prompts' last prefixes read from Redis (a turn extends the previous one by a few messages)
MAX_REMOTE_PREFIXES = 64
_NOTHING: Mapping[tuple[str, str], int] = MappingProxyType({})


@dataclass(slots=True)
class PrefixSeen:
    """What admission learnt of a request's prompt: its scope, per (provider, model) the tokens expected from
    its cache and :attr:`prompt`, the hash of the whole prompt (of ``body``; worked out when first read: a
    scope with nothing recorded is looked up without hashing, and a prompt too short to be cached is never
    recorded, so a short prompt of such a scope is never hashed)."""

    scope: str
    body: Mapping[str, Any]
    cached: Mapping[tuple[str, str], int]
    _prompt: str | None = None

    @property
    def prompt(self) -> str:
        if self._prompt is None:
            self._prompt = prefix_hashes(self.body)[-1]
        return self._prompt


class PromptMemory:
    """A :class:`PrefixMemory` with the clock, each provider's kind and (optionally) the shared Redis."""

    def __init__(self, kinds: Mapping[str, str], auto_breakpoints: bool, memory: PrefixMemory | None = None,
                 state: SharedState | None = None, aware: bool = True) -> None:
        self.kinds = dict(kinds)
        self.aware = aware
        self.auto_breakpoints = auto_breakpoints
        self.memory = memory if memory is not None else PrefixMemory()
        self.state = state
        self._writes: set[asyncio.Task[None]] = set()

    def _key(self, scope: str, prompt: str) -> str:
        assert self.state is not None
        return self.state.key("pcache", scope, prompt)

    async def lookup(self, scope: str, body: Mapping[str, Any]) -> PrefixSeen | None:
        """Who holds ``body``'s prompt (``None``: not a chat body, or cache-blind). Without ``[shared]`` Redis
        and with nothing recorded for ``scope``, nothing can be found: the prompt is not hashed here."""
        if not self.aware:
            return None
        if self.state is None and not self.memory.holds(scope):
            messages = body.get("messages")
            if not isinstance(messages, list) or not any(isinstance(m, Mapping) for m in messages):
                return None  # no prefix (as prefix_hashes would find)
            return PrefixSeen(scope, body, _NOTHING)
        hashes = prefix_hashes(body)
        if not hashes:
            return None
        if self.state is not None:
            await self._pull(scope, hashes[-MAX_REMOTE_PREFIXES:])
        return PrefixSeen(scope, body, self.memory.lookup(scope, hashes, time.time()), hashes[-1])

    async def _pull(self, scope: str, hashes: Sequence[str]) -> None:
        """Fold the shared holders of ``hashes`` into the local memory."""
        assert self.state is not None
        keys = [self._key(scope, h) for h in hashes]

        async def read(r: Any) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            out: list[Any] = await pipe.execute()
            return out

        try:
            found = await self.state.call(read)
        except SharedStateUnavailableError:
            return  # the local memory answers
        now = time.time()
        for h, fields in zip(hashes, found, strict=True):
            for name, value in (fields or {}).items():
                provider, _, model = name.decode().partition("/")
                tokens, _, expires = value.decode().partition(" ")
                try:
                    left = float(expires) - now
                    if left > 0 and provider and model:
                        self.memory.record(scope, h, (provider, model), int(tokens), left, now)
                except ValueError:
                    continue

    def remember(self, seen: PrefixSeen | None, candidate: Candidate | None, tokens: int,
                 *bodies: Mapping[str, Any]) -> None:
        """``candidate`` answered the prompt ``seen`` names (``tokens`` long; ``bodies``: the forms it was
        sent in). The shared write runs in the background."""
        if seen is None or candidate is None or tokens < MIN_CACHED_TOKENS:
            return  # shorter: no provider caches it, and a lookup would never report it
        ttl = cache_ttl_s(self.kinds.get(candidate.provider, ""), bodies, self.auto_breakpoints)
        if ttl is None:
            return
        now = time.time()
        self.memory.record(seen.scope, seen.prompt, candidate.key, tokens, ttl, now)
        if self.state is not None:
            key, value = self._key(seen.scope, seen.prompt), f"{tokens} {now + ttl:.3f}"
            task = asyncio.get_running_loop().create_task(self._push(key, candidate.id, value, ttl))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _push(self, key: str, field: str, value: str, ttl: float) -> None:
        assert self.state is not None

        async def write(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            pipe.hset(key, field, value)
            pipe.expire(key, max(1, int(ttl) + 1), gt=True)  # never shortens a longer-kept holder's key
            pipe.expire(key, max(1, int(ttl) + 1), nx=True)
            await pipe.execute()

        try:
            await self.state.call(write)
        except SharedStateUnavailableError:
            log.debug("prompt-cache holder not shared: redis unreachable")
