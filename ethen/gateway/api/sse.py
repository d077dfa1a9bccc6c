"""Server-sent events, both directions, at the byte level.

The gateway never decodes a stream to ``str`` on the hot path: upstream bytes are split into events here
and the ``data`` payloads are handed on as ``bytes``. :func:`iter_events` is an incremental parser (a chunk
may end mid-line, lines may end in ``\\n``, ``\\r\\n`` or ``\\r``); :func:`encode_data` /
:func:`encode_error` build the frames the gateway sends.

Choices where the SSE spec or the OpenAI docs are silent:
- A multi-line ``data`` field is joined with ``\\n`` (per the SSE spec); comments (``:``) and ``id``/``retry``
  fields are dropped, since OpenAI-style chat streams do not use them.
- An error is sent as ``event: error`` + ``data: {"error": {...}}``: the official ``openai`` SDKs raise
  ``APIError`` on any data object carrying an ``error`` key, and the event name tells raw-SSE readers apart.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

DONE_FRAME = b"data: [DONE]\n\n"
DONE_PAYLOAD = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One parsed event: its ``event`` name (``None`` when absent) and its ``data`` bytes."""

    event: bytes | None
    data: bytes


def encode_data(payload: bytes) -> bytes:
    """Frame one ``data:`` event (payload must be a single line, as JSON produced by ``json.dumps`` is)."""
    return b"data: " + payload + b"\n\n"


def encode_json(obj: Mapping[str, Any]) -> bytes:
    """Frame one JSON object as a ``data:`` event."""
    return encode_data(dumps(obj))


def encode_error(error: Mapping[str, Any]) -> bytes:
    """Frame an error envelope (``{"error": {...}}``) as an ``event: error`` event."""
    return b"event: error\n" + encode_data(dumps(error))


def decode_frame(frame: bytes) -> tuple[bool, dict[str, Any]] | None:
    """A relayed chat frame (:func:`encode_json` / :func:`encode_error`) as ``(is_error, object)``; ``None``
    for ``[DONE]`` and for a frame whose data is no JSON object (nothing to translate)."""
    if frame == DONE_FRAME:
        return None
    try:
        obj = json.loads(frame.split(b"data: ", 1)[1])
    except (ValueError, IndexError):
        return None
    return (frame.startswith(b"event: error\n"), obj) if isinstance(obj, dict) else None


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (the one serializer used for every body and frame the gateway writes)."""
    return _ENCODER.encode(obj).encode()


async def iter_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[SSEEvent]:
    """Parse a byte stream into SSE events, yielding each as soon as its blank line arrives."""
    buf = b""
    event: bytes | None = None
    data: list[bytes] = []
    async for chunk in chunks:
        if not chunk:
            continue
        buf += chunk
        if b"\r" in buf:
            # Normalise CRLF / CR line ends; a trailing lone CR may be the first half of a CRLF.
            keep_cr = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:
                buf = buf[:-1] + b"\r"
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line:
                if data:
                    yield SSEEvent(event, b"\n".join(data))
                event, data = None, []
                continue
            if line[:1] == b":":
                continue
            field, _, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if field == b"data":
                data.append(value)
            elif field == b"event":
                event = value
    # Per the SSE spec an event not closed by a blank line at EOF is discarded: a cut stream never yields a
    # half-received payload.


__all__ = [
    "DONE_FRAME",
    "DONE_PAYLOAD",
    "SSEEvent",
    "decode_frame",
    "dumps",
    "encode_data",
    "encode_error",
    "encode_json",
    "iter_events",
]
