"""The shell of cache-aware routing (issue 45 item 2): before a decision, which providers hold the request's
prompt prefix in their prompt cache; after an answer, who holds it now. The memory and its rules are pure
(:mod:`ethen.gateway.routing.prefix`); this adds the clock and the providers' kinds.

Scope: a project (``project:<name>``), else the config key (``config:<name>``): one project never learns
another's prefixes. Process-local (not shared through ``[shared]`` Redis yet).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ethen.gateway.routing import Candidate, PrefixMemory, cache_ttl_s, prefix_hashes

__all__ = ["PrefixSeen", "PromptMemory"]


@dataclass(frozen=True, slots=True)
class PrefixSeen:
    """What admission learnt of a request's prompt: its scope, the hash of the whole prompt and, per
    (provider, model), the tokens expected from its cache."""

    scope: str
    prompt: str
    cached: Mapping[tuple[str, str], int]


class PromptMemory:
    """A :class:`PrefixMemory` with the clock and each provider's kind."""

    def __init__(self, kinds: Mapping[str, str], auto_breakpoints: bool, memory: PrefixMemory | None = None
                 ) -> None:
        self.kinds = dict(kinds)
        self.auto_breakpoints = auto_breakpoints
        self.memory = memory if memory is not None else PrefixMemory()

    def lookup(self, scope: str, body: Mapping[str, Any]) -> PrefixSeen | None:
        hashes = prefix_hashes(body)
        if not hashes:
            return None
        return PrefixSeen(scope, hashes[-1], self.memory.lookup(scope, hashes, time.time()))

    def remember(self, seen: PrefixSeen | None, candidate: Candidate | None, tokens: int,
                 *bodies: Mapping[str, Any]) -> None:
        """``candidate`` answered the prompt ``seen`` names (``tokens`` long; ``bodies``: the forms it was
        sent in)."""
        if seen is None or candidate is None or tokens <= 0:
            return
        ttl = cache_ttl_s(self.kinds.get(candidate.provider, ""), bodies, self.auto_breakpoints)
        if ttl is not None:
            self.memory.record(seen.scope, seen.prompt, candidate.key, tokens, ttl, time.time())
