"""One stored answer, as bytes (the same encoding in memory and in Redis).

``<header JSON>\\n<body>``: the header is ``{"v": 1, "at": <wall-clock s>, "c": <candidate id>,
"k": "b" | "s"}``; a buffered answer's body is its JSON (the upstream's chat completion as the executor
returned it, without the gateway's receipt); a stream's body is its chunk payloads (one JSON object each,
as the upstream sent them) joined by ``\\n``. A stream with a chunk holding a raw newline is not stored
(:func:`encode_stream` returns ``None``); JSON written on one line never has one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Entry", "decode", "encode_body", "encode_stream"]


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded entry: when it was stored (wall clock), the candidate that answered, and the answer."""

    at: float
    candidate: str
    stream: bool
    body: bytes  # a buffered answer's JSON (stream: empty)
    chunks: tuple[bytes, ...] = ()  # a stream's chunk payloads


def _header(at: float, candidate: str, kind: str) -> bytes:
    return json.dumps({"v": 1, "at": round(at, 3), "c": candidate, "k": kind},
                      separators=(",", ":")).encode()


def encode_body(at: float, candidate: str, body: bytes) -> bytes:
    """A buffered answer's entry (``body``: its compact JSON, one line)."""
    return _header(at, candidate, "b") + b"\n" + body


def encode_stream(at: float, candidate: str, chunks: Sequence[bytes]) -> bytes | None:
    """A stream's entry, ``None`` when a chunk cannot be stored on one line (or there is none)."""
    if not chunks or any(b"\n" in c for c in chunks):
        return None
    return _header(at, candidate, "s") + b"\n" + b"\n".join(chunks)


def decode(raw: bytes) -> Entry | None:
    """The entry of ``raw``; ``None`` for bytes that are no entry of this version (then: a miss)."""
    head, sep, rest = raw.partition(b"\n")
    if not sep:
        return None
    try:
        h = json.loads(head)
        at, cand, kind = float(h["at"]), h["c"], h["k"]
    except (ValueError, KeyError, TypeError):
        return None
    if h.get("v") != 1 or not isinstance(cand, str) or kind not in ("b", "s"):
        return None
    if kind == "b":
        return Entry(at, cand, False, rest)
    return Entry(at, cand, True, b"", tuple(rest.split(b"\n")))
