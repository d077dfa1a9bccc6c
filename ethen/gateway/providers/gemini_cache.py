"""Gemini explicit context caching (issue 45), pure: no I/O, no clock (``now`` is an argument). The provider
(:mod:`.gemini`) does the calls.

Gemini caches repeated prefixes on its own (implicit caching); a client that marks a prefix with
``cache_control`` breakpoints (LiteLLM's form on chat: on a content part, a message or a tool) asks for more:
a ``cachedContents`` resource holding the prefix, which the request then names in ``cachedContent`` while
sending only the turns after it. As OpenRouter and LiteLLM do:

- :func:`breakpoints`: the client's breakpoints of a chat body, each as the number of leading messages it
  covers (a tool's: none) and its ``ttl`` (``"1h"``: 3600 s, anything else 300 s); a Messages body's are
  found on its blocks (:func:`~ethen.gateway.api.messages.chat_breakpoints`) and passed in;
- :func:`plan`: the split of the Gemini body (:func:`~.gemini_wire.to_gemini`) at the last breakpoint that
  leaves the request at least one turn of its own (:func:`choose_cut`): the cached part is
  ``systemInstruction``, ``tools``, ``toolConfig`` (a request naming a cache may not set them) and the
  ``contents`` turns made of the covered messages alone (a turn later messages were merged into stays in the
  rest); ``None`` when nothing is worth a cache (no breakpoint, nothing before it, or a prefix estimated
  under the model's minimum: :func:`min_cache_tokens`);
- :func:`prefix_key`: a SHA-256 of the model and the cached part in canonical JSON (never the text);
- :class:`CacheNames`: the bounded memory prefix key -> cache name (until a little before its
  ``expireTime``), or a refusal (not retried until it runs out).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ethen.gateway.providers.gemini_wire import turn_owners
from ethen.gateway.routing.requirements import BYTES_PER_TOKEN

__all__ = [
    "CACHED_KEYS",
    "DEFAULT_TTL_S",
    "MAX_NAMES",
    "Breakpoint",
    "CacheNames",
    "CacheSplit",
    "breakpoints",
    "choose_cut",
    "closed_turns",
    "expire_epoch",
    "min_cache_tokens",
    "plan",
    "prefix_key",
    "split_at",
]

#: the ``GenerateContentRequest`` keys that live in the cache (Gemini refuses them beside ``cachedContent``)
CACHED_KEYS = ("systemInstruction", "tools", "toolConfig")
#: a breakpoint's ``ttl`` unless it says ``"1h"`` (Anthropic's default, which clients mean by a bare mark)
DEFAULT_TTL_S = 300
#: prefixes remembered per provider (least recently used out)
MAX_NAMES = 4096
#: a cache is not used in its last this many seconds (at most a tenth of its life): it must not go in flight
EXPIRY_MARGIN_S = 30.0


@dataclass(frozen=True, slots=True)
class Breakpoint:
    covered: int  # the leading chat messages it covers (0: the tools and what precedes the messages)
    ttl_s: int


@dataclass(frozen=True, slots=True)
class CacheSplit:
    key: str  # :func:`prefix_key`
    cached: dict[str, Any]  # the ``cachedContents`` body, without ``model`` and ``ttl``
    rest: dict[str, Any]  # the ``generateContent`` body, without ``cachedContent``
    ttl_s: int
    turns: int  # how many ``contents`` turns are in the cache


def _ttl(mark: Mapping[str, Any]) -> int:
    return 3600 if mark.get("ttl") == "1h" else DEFAULT_TTL_S


def _mark_of(msg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The message's breakpoint: the longest-lived of its ``cache_control`` marks (LiteLLM's message-level
    one and those on its content parts), ``None`` without one."""
    found = msg.get("cache_control") if isinstance(msg.get("cache_control"), Mapping) else None
    content = msg.get("content")
    for part in content if isinstance(content, list) else ():
        if isinstance(part, Mapping) and isinstance(part.get("cache_control"), Mapping):
            mark = part["cache_control"]
            found = mark if found is None or _ttl(mark) > _ttl(found) else found
    return found


def breakpoints(body: Mapping[str, Any],
                marks: Sequence[tuple[int, Mapping[str, Any]]] | None = None) -> list[Breakpoint]:
    """A chat body's ``cache_control`` breakpoints (tools first, then messages in order); ``marks``: the
    breakpoints of the body it was translated from, as (messages covered, mark), used instead."""
    if marks is not None:
        return [Breakpoint(covered, _ttl(mark)) for covered, mark in marks]
    out: list[Breakpoint] = []
    tools = body.get("tools")
    on_tools = [t["cache_control"] for t in tools if isinstance(t, Mapping)
                and isinstance(t.get("cache_control"), Mapping)] if isinstance(tools, list) else []
    if on_tools:
        out.append(Breakpoint(0, max(_ttl(m) for m in on_tools)))
    messages = body.get("messages")
    for i, msg in enumerate(messages if isinstance(messages, list) else ()):
        mark = _mark_of(msg) if isinstance(msg, Mapping) else None
        if mark is not None:
            out.append(Breakpoint(i + 1, _ttl(mark)))
    return out


def closed_turns(owners: Sequence[int], covered: int) -> int:
    """How many leading ``contents`` turns are made of the first ``covered`` messages alone (``owners``:
    :func:`~.gemini_wire.turn_owners`): the turns they went into, less the last if a later message went
    into it too."""
    done = max((o for o in owners[:covered] if o >= 0), default=-1) + 1
    if done and any(o == done - 1 for o in owners[covered:]):
        done -= 1
    return done


#: (pattern on the model name, minimum cacheable tokens); Google's caching guide: Pro models 4096, else 1024
_MINIMUMS: tuple[tuple[re.Pattern[str], int], ...] = ((re.compile(r"pro"), 4096),)


def min_cache_tokens(model: str) -> int:
    """The shortest prefix (tokens) Gemini caches for ``model``: 4096 for Pro models, 1024 for the rest."""
    name = model.lower()
    return next((tokens for pattern, tokens in _MINIMUMS if pattern.search(name)), 1024)


_ENCODE = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode


def prefix_key(model: str, cached: Mapping[str, Any]) -> str:
    """The cached part's name: a SHA-256 of the model and the part in canonical JSON."""
    seed = {"model": model.removeprefix("models/"), "cached": cached}
    return hashlib.sha256(_ENCODE(seed).encode()).hexdigest()


def choose_cut(chat: Mapping[str, Any], turns: int,
               marks: Sequence[tuple[int, Mapping[str, Any]]] | None = None) -> tuple[int, int] | None:
    """(the ``contents`` turns to cache, the ``ttl``) at ``chat``'s last breakpoint that leaves at least one
    of its ``turns`` (the translation's ``contents`` length) to the request, the ``ttl`` the longest of the
    breakpoints that end there. When every breakpoint is in the last turn (a client marking its newest
    message), ``(0, the longest ttl)``: what precedes the messages (system instruction, tools), the part of
    the marked prefix every later turn shares. ``None`` without a breakpoint. ``marks``: as for
    :func:`breakpoints`."""
    found = breakpoints(chat, marks)
    if not found or turns <= 0:
        return None
    owners = turn_owners(chat)
    best: tuple[int, int] | None = None
    for bp in found:
        cut = closed_turns(owners, bp.covered)
        if cut >= turns:
            continue
        if best is None or cut > best[0]:
            best = (cut, bp.ttl_s)
        elif cut == best[0]:
            best = (cut, max(best[1], bp.ttl_s))
    return best if best is not None else (0, max(bp.ttl_s for bp in found))


def split_at(gemini: Mapping[str, Any], cut: int, model: str, ttl_s: int) -> CacheSplit:
    """``gemini`` split after its first ``cut`` ``contents`` turns: the cached part takes those and
    :data:`CACHED_KEYS`, the rest the other turns and every other key."""
    contents = list(gemini.get("contents") or ())
    cached = {k: gemini[k] for k in CACHED_KEYS if k in gemini}
    if cut:
        cached["contents"] = contents[:cut]
    rest = {k: v for k, v in gemini.items() if k not in CACHED_KEYS}
    rest["contents"] = contents[cut:]
    return CacheSplit(prefix_key(model, cached), cached, rest, ttl_s, cut)


def plan(chat: Mapping[str, Any], gemini: Mapping[str, Any], model: str,
         marks: Sequence[tuple[int, Mapping[str, Any]]] | None = None) -> CacheSplit | None:
    """The split of ``gemini`` (the translation of ``chat``) at the client's last usable breakpoint
    (:func:`choose_cut`), or ``None``: no usable breakpoint, nothing to cache, or a cached part estimated
    (:data:`~ethen.gateway.routing.requirements.BYTES_PER_TOKEN` bytes of JSON a token) under the model's
    minimum (:func:`min_cache_tokens`)."""
    contents = gemini.get("contents")
    chosen = choose_cut(chat, len(contents) if isinstance(contents, list) else 0, marks)
    if chosen is None:
        return None
    out = split_at(gemini, chosen[0], model, chosen[1])
    if not out.cached or len(_ENCODE(out.cached).encode()) // BYTES_PER_TOKEN < min_cache_tokens(model):
        return None
    return out


_FRACTION = re.compile(r"(\.\d{6})\d+")


def expire_epoch(text: object, fallback: float) -> float:
    """A ``cachedContents`` ``expireTime`` (RFC 3339, up to nanoseconds) as epoch seconds; ``fallback`` if it
    is missing or unreadable."""
    if not isinstance(text, str):
        return fallback
    try:
        return datetime.fromisoformat(_FRACTION.sub(r"\1", text.replace("Z", "+00:00"))).timestamp()
    except ValueError:
        return fallback


@dataclass(slots=True)
class _Held:
    name: str | None  # None: creating it was refused
    until: float  # epoch seconds


class CacheNames:
    """Prefix key -> cache name (or a refusal), each until a time; at most ``max_entries``, least recently
    used out. Never holds a prompt's text."""

    def __init__(self, max_entries: int = MAX_NAMES) -> None:
        self.max_entries = max(1, max_entries)
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def lookup(self, key: str, now: float) -> tuple[str | None] | None:
        """``(name,)`` for a live cache, ``(None,)`` for a refusal still standing, ``None`` if unknown."""
        held = self._held.get(key)
        if held is None:
            return None
        if held.until <= now:
            del self._held[key]
            return None
        self._held.move_to_end(key)
        return (held.name,)

    def _put(self, key: str, held: _Held) -> None:
        self._held[key] = held
        self._held.move_to_end(key)
        while len(self._held) > self.max_entries:
            self._held.popitem(last=False)

    def hold(self, key: str, name: str, expires: float, now: float) -> None:
        """Remember ``name`` until a margin before ``expires`` (epoch seconds)."""
        until = expires - min(EXPIRY_MARGIN_S, max(0.0, expires - now) / 10)
        if until > now:
            self._put(key, _Held(name, until))

    def refuse(self, key: str, until: float) -> None:
        """Do not try to create this prefix's cache again before ``until``."""
        self._put(key, _Held(None, until))

    def drop(self, key: str) -> None:
        self._held.pop(key, None)
