"""Which provider holds a conversation's prompt prefix in its cache (issue 45 item 2); pure: no I/O, ``now``
is an argument.

A chat body's prefixes are named by a hash chain over its messages in canonical form (:func:`prefix_hashes`:
the tools seed the chain, then one hash per message; never the text itself). After an answer, the gateway
records under the hash of the whole prompt which (provider, model) served it, how many prompt tokens it had
and until when that provider keeps it (:func:`cache_ttl_s`). Before routing the next turn, :meth:`PrefixMemory
.lookup` finds the longest recorded prefix of the new prompt and returns, per (provider, model) still holding
it, the tokens expected to be read from its cache; the scorer (:func:`~.score.score_pool`) prices those at
the candidate's cache-read price.

The memory is bounded by entries and by (estimated) bytes, least recently used out first.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ANTHROPIC_TTL_S",
    "OPENAI_TTL_S",
    "PrefixMemory",
    "cache_ttl_s",
    "canonical_message",
    "canonical_tools",
    "prefix_hashes",
]

#: Anthropic keeps a prefix 5 minutes from its last use (a breakpoint's ``ttl: "1h"``: an hour)
ANTHROPIC_TTL_S = 300.0
#: OpenAI keeps a prefix "5-10 minutes of inactivity"; the lower bound
OPENAI_TTL_S = 300.0
#: the fewest prompt tokens any provider caches (OpenAI and Anthropic's Sonnet/Opus: 1024)
MIN_CACHED_TOKENS = 1024
_TTL = {"anthropic": ANTHROPIC_TTL_S, "openai_compat": OPENAI_TTL_S, "azure_openai": OPENAI_TTL_S,
        "gemini": OPENAI_TTL_S}  # fmt: skip
_ENTRY_BYTES = 200  # an entry's overhead: its key (scope + 64 hex), the LRU slot, the holders' dict
_HOLDER_BYTES = 120  # one (provider, model) -> (tokens, expiry)


def canonical_message(msg: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in the form every API shape translates it to alike: ``developer`` as ``system``, text
    parts joined into one string, ``cache_control`` marks left out."""
    role = msg.get("role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = msg.get("content")
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, Mapping)]
        if all(p.get("type") == "text" for p in parts):
            content = "\n\n".join(str(p.get("text", "")) for p in parts)
        else:
            content = [{k: v for k, v in p.items() if k != "cache_control"} for p in parts]
    out["content"] = content
    for key in ("tool_calls", "tool_call_id"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


#: ``json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))``, its encoder built once
_ENCODE = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode


def _canonical(obj: object) -> bytes:
    return _ENCODE(obj).encode()


def canonical_tools(tools: object) -> list[Any] | None:
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        return None
    return [{k: v for k, v in t.items() if k != "cache_control"} if isinstance(t, Mapping) else t
            for t in tools]


def prefix_hashes(body: Mapping[str, Any]) -> tuple[str, ...]:
    """One hash per message of a chat body: ``[i]`` names the prompt up to and including message ``i`` (and
    the tools). Equal prompts give equal hashes whatever API shape they came in."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()  # not a chat body (the decision refuses it with a 400)
    tools = canonical_tools(body.get("tools"))
    h = _NO_TOOLS if tools is None else hashlib.sha256(b"tools:" + _canonical(tools)).digest()
    out: list[str] = []
    for msg in messages:
        if isinstance(msg, Mapping):
            h = hashlib.sha256(h + _canonical(canonical_message(msg))).digest()
            out.append(h.hex())
    return tuple(out)


_NO_TOOLS = hashlib.sha256(b"tools:" + _canonical(None)).digest()  # the chain's seed of a body without tools


def _marks(obj: object, found: list[Mapping[str, Any]]) -> None:
    if isinstance(obj, Mapping):
        mark = obj.get("cache_control")
        if isinstance(mark, Mapping):
            found.append(mark)
        for v in obj.values():
            _marks(v, found)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _marks(v, found)


def cache_ttl_s(kind: str, bodies: Sequence[Mapping[str, Any]], auto_breakpoints: bool) -> float | None:
    """How long a provider of ``kind`` keeps the prompt of a request (``bodies``: the forms it was sent in,
    to find its ``cache_control`` marks); ``None``: it caches nothing (the mesh; Anthropic without
    breakpoints)."""
    if kind != "anthropic":
        return _TTL.get(kind)
    found: list[Mapping[str, Any]] = []
    for body in bodies:
        _marks(body, found)
    if not found:
        return ANTHROPIC_TTL_S if auto_breakpoints else None
    return 3600.0 if any(m.get("ttl") == "1h" for m in found) else ANTHROPIC_TTL_S


@dataclass(slots=True)
class _Held:
    tokens: int
    expires: float  # epoch seconds


class PrefixMemory:
    """Per scope (a project) and prompt hash: the (provider, model) holders of that prompt in their cache.
    Bounded by ``max_entries`` and ``max_bytes`` (estimated), least recently used out first."""

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 32 * 2**20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("PrefixMemory bounds must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], dict[tuple[str, str], _Held]] = OrderedDict()
        self._scopes: dict[str, int] = {}  # scope -> its entries (a scope with none needs no hashing)

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, scope: str) -> bool:
        """Whether any prompt of ``scope`` is recorded (without one, :meth:`lookup` finds nothing)."""
        return scope in self._scopes

    def _dropped(self, scope: str) -> None:
        left = self._scopes[scope] - 1
        if left:
            self._scopes[scope] = left
        else:
            del self._scopes[scope]

    @staticmethod
    def _size(key: tuple[str, str], holders: Mapping[tuple[str, str], _Held]) -> int:
        return _ENTRY_BYTES + len(key[0]) + sum(_HOLDER_BYTES + len(p) + len(m) for p, m in holders)

    def record(self, scope: str, prefix: str, holder: tuple[str, str], tokens: int, ttl_s: float,
               now: float) -> None:
        """``holder`` served the prompt ``prefix`` (``tokens`` long) at ``now`` and keeps it ``ttl_s``."""
        key = (scope, prefix)
        holders = self._entries.pop(key, None)
        if holders is not None:
            self.bytes -= self._size(key, holders)
        else:
            self._scopes[scope] = self._scopes.get(scope, 0) + 1
        holders = {h: v for h, v in (holders or {}).items() if v.expires > now}
        holders[holder] = _Held(tokens, now + ttl_s)
        self._entries[key] = holders
        self.bytes += self._size(key, holders)
        entries = self._entries
        while len(entries) > self.max_entries or (self.bytes > self.max_bytes and len(entries) > 1):
            old_key, old = entries.popitem(last=False)
            self.bytes -= self._size(old_key, old)
            self._dropped(old_key[0])

    def lookup(self, scope: str, hashes: Sequence[str], now: float) -> dict[tuple[str, str], int]:
        """Per (provider, model): the prompt tokens expected from its cache for a prompt whose prefix hashes
        are ``hashes`` (:func:`prefix_hashes`): those of the longest recorded prefix it still holds (only
        prefixes of at least :data:`MIN_CACHED_TOKENS`)."""
        out: dict[tuple[str, str], int] = {}
        for h in reversed(hashes):
            holders = self._entries.get((scope, h))
            if holders is None:
                continue
            self._entries.move_to_end((scope, h))
            for holder, held in holders.items():
                if held.expires > now and held.tokens >= MIN_CACHED_TOKENS and holder not in out:
                    out[holder] = held.tokens
        return out
