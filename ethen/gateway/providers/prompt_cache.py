"""Prompt-cache hints for upstreams (issue 45), pure: no I/O.

Anthropic caches a prompt prefix only where a ``cache_control`` breakpoint asks for it; OpenAI caches a
repeated prefix on its own, best when requests that share it carry the same ``prompt_cache_key``.

- :func:`place_breakpoints`: for an Anthropic Messages body that carries no ``cache_control`` anywhere,
  breakpoints as Anthropic's prompt-caching guide recommends: on the last tool, on the last ``system`` block,
  and on the last block of the last two user turns (the newest one writes this turn's prefix, the one before
  reads the previous turn's); at most :data:`MAX_BREAKPOINTS`, and each only where the prefix it closes
  reaches the model's minimum cacheable length (:func:`min_cacheable_tokens`, estimated at
  :data:`~ethen.gateway.routing.requirements.BYTES_PER_TOKEN` bytes a token). A body with any client
  breakpoint is left as it is (its ``ttl`` included).
- :func:`conversation_key`: the ``prompt_cache_key`` of a chat body, the same for every turn of a
  conversation: a hash of its tools, system/developer messages and first user message (never their text).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ethen.gateway.routing.prefix import canonical_message, canonical_tools
from ethen.gateway.routing.requirements import BYTES_PER_TOKEN

__all__ = [
    "MAX_BREAKPOINTS",
    "conversation_key",
    "has_breakpoints",
    "leading_messages",
    "min_cacheable_tokens",
    "place_breakpoints",
]

#: Anthropic accepts at most 4 ``cache_control`` breakpoints per request
MAX_BREAKPOINTS = 4
_EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}

#: (pattern on the model name, minimum cacheable prompt length in tokens), first match wins; Anthropic's
#: prompt-caching guide: Opus 4.5+/Haiku 4.5 4096, Sonnet 4.6 and Haiku 3/3.5 2048, other models 1024
_MINIMUMS: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"opus-4-[5-9]|opus-4\.[5-9]|haiku-4|haiku-[5-9]"), 4096),
    (re.compile(r"sonnet-4-[6-9]|sonnet-4\.[6-9]|haiku"), 2048),
)


def min_cacheable_tokens(model: str) -> int:
    """The shortest prefix (tokens) Anthropic caches for ``model`` (1024 unless the model is known longer)."""
    name = model.lower()
    for pattern, tokens in _MINIMUMS:
        if pattern.search(name):
            return tokens
    return 1024


def _tokens(obj: object) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()) // BYTES_PER_TOKEN


def _marked(obj: object) -> bool:
    if isinstance(obj, Mapping):
        return "cache_control" in obj or any(_marked(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_marked(v) for v in obj)
    return False


def has_breakpoints(body: Mapping[str, Any]) -> bool:
    """Whether a Messages body carries any ``cache_control`` (top level, tools, system or messages)."""
    return "cache_control" in body or any(_marked(body.get(k)) for k in ("tools", "system", "messages"))


def _content_blocks(content: object) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content) if isinstance(content, list) else []


def _markable(block: object) -> bool:
    if not isinstance(block, Mapping) or block.get("type") in ("thinking", "redacted_thinking"):
        return False
    return not (block.get("type") == "text" and not block.get("text"))


def place_breakpoints(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """``body`` (Anthropic Messages) with breakpoints placed (see the module docstring); a body already
    carrying any breakpoint is returned as it is (a copy)."""
    out = dict(body)
    if has_breakpoints(body):
        return out
    minimum = min_cacheable_tokens(model)
    budget = MAX_BREAKPOINTS
    seen = 0  # tokens of the prefix up to the current position
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        seen += _tokens(tools)
        if seen >= minimum and isinstance(tools[-1], Mapping):
            out["tools"] = [*tools[:-1], {**tools[-1], "cache_control": dict(_EPHEMERAL)}]
            budget -= 1
    system = body.get("system")
    blocks = _content_blocks(system)
    if blocks:
        seen += _tokens(blocks)
        if seen >= minimum and _markable(blocks[-1]):
            out["system"] = [*blocks[:-1], {**blocks[-1], "cache_control": dict(_EPHEMERAL)}]
            budget -= 1
    messages = body.get("messages")
    if not isinstance(messages, list):
        return out
    ends: list[int] = []  # the prefix length (tokens) at the end of each message
    for msg in messages:
        seen += _tokens(msg)
        ends.append(seen)
    users = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "user"]
    new = list(messages)
    for i in reversed(users[-2:]):
        if budget <= 0 or ends[i] < minimum:
            continue
        content = _content_blocks(messages[i].get("content"))
        if not content or not _markable(content[-1]):
            continue
        last = {**content[-1], "cache_control": dict(_EPHEMERAL)}
        new[i] = {**messages[i], "content": [*content[:-1], last]}
        budget -= 1
    out["messages"] = new
    return out


#: ``json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))``, its encoder built once
_ENCODE = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode


def _canonical(obj: object) -> bytes:
    return _ENCODE(obj).encode()


def leading_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat body's stable head, canonical (:func:`canonical_message`): its system/developer messages and
    first other message, in order."""
    head: list[dict[str, Any]] = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        if not isinstance(msg, Mapping):
            continue
        head.append(canonical_message(msg))
        if msg.get("role") not in ("system", "developer"):
            break
    return head


def conversation_key(body: Mapping[str, Any]) -> str | None:
    """``ethen-`` and a hash of a chat body's tools and leading messages (``None`` without messages)."""
    head = leading_messages(body)
    if not head:
        return None
    seed = {"tools": canonical_tools(body.get("tools")), "head": head}
    digest = hashlib.sha256(_canonical(seed)).hexdigest()
    return f"ethen-{digest[:40]}"
