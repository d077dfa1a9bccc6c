"""Encoding a request log row for the database, once per row in the log writer (issue 11: the log's writes
cost the gateway's CPU): :func:`encode_row` serializes the JSON columns with ``json.dumps`` (as SQLAlchemy's
JSON type stored them, so reads return the same data) and extracts the row's attempts; text a column
cannot hold (:func:`storable`) is replaced, and overlong text cut, so one client's odd input never fails a
batch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String

from ethen.store._common import utc

from .table import COLUMNS, request_log

__all__ = ["EncodedRow", "encode_row", "storable"]

@dataclass(frozen=True, slots=True)
class EncodedRow:
    """A row ready for the database: ``values`` in :data:`COLUMNS` order with the JSON columns as text,
    ``attempts`` one tuple per stored attempt in :data:`ATTEMPT_COLUMNS` order without ``log_id``."""

    values: tuple[Any, ...]
    attempts: tuple[tuple[Any, ...], ...]


#: ``json.dumps``'s text (what SQLAlchemy's JSON type stored: the engines configure no ``json_serializer``),
#: without its cycle check (a row holds no cycles; one would fail the row with a RecursionError)
_dumps = json.JSONEncoder(check_circular=False).encode
_PLAIN = COLUMNS[:-2]
#: the columns a row may leave out (NULL): the ones added after the table (``0010``)
_OPTIONAL = frozenset({"cache_read_tokens", "cache_write_tokens", "saved_nano"})


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


#: the characters no text column holds: NUL (Postgres ``text``; ``\u0000`` in its JSON) and the surrogates
#: (a lone one, e.g. ``"\ud800"`` in a JSON body, is not UTF-8: neither SQLite's driver nor asyncpg takes it)
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_REPLACEMENT = "\ufffd"
#: (index, longest text) of each plain text column (``VARCHAR(n)``: Postgres refuses a longer text)
_TEXTS = tuple((i, int(t.length or 2**31)) for i, t in enumerate(request_log.c[c].type for c in _PLAIN)
               if isinstance(t, String))


def storable(s: str) -> str:
    """``s`` with every character a text column cannot hold (NUL, a surrogate) replaced by U+FFFD."""
    if "\x00" in s or not s.isascii():
        return _UNSTORABLE.sub(_REPLACEMENT, s)
    return s


def _storable_json(v: Any) -> Any:
    """``v`` (a JSON value) with :func:`storable` strings, keys included."""
    if isinstance(v, str):
        return storable(v)
    if isinstance(v, Mapping):
        return {storable(k) if isinstance(k, str) else k: _storable_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_storable_json(x) for x in v]
    return v


def _json_text(v: Any) -> str:
    """``v``'s JSON text (ASCII: ``json.dumps`` escapes the rest), re-encoded from a :func:`storable` copy
    when it holds ``\\u0000`` or a ``\\ud800``-``\\udfff`` escape (a surrogate: a lone one, or a pair of an
    astral character, which the copy keeps as it is)."""
    t = _dumps(v)
    if "\\u0000" in t or "\\ud" in t:
        t = _dumps(_storable_json(v))
    return t


def _plain(row: Mapping[str, Any]) -> list[Any]:
    """The plain columns' values: text made :func:`storable` and cut to its column's length."""
    out = [row[c] if c not in _OPTIONAL else row.get(c) for c in _PLAIN]
    for i, n in _TEXTS:
        v = out[i]
        if isinstance(v, str):
            out[i] = storable(v if len(v) <= n else v[:n])
    return out


def encode_row(row: Mapping[str, Any]) -> EncodedRow:
    """A row (as :func:`ethen.gateway.observation.requestlog.to_row` builds it) encoded for
    :func:`insert_requests`:
    done once per row, in the writer (raises ``TypeError`` / ``ValueError`` for a value JSON cannot hold).
    Text a column cannot hold (:func:`storable`) is stored with U+FFFD in its place, and a plain column's text
    cut to the column's length, so one client's odd input (``"model": "m\\u0000"``) never fails the batch."""
    attempts = row["attempts"]
    values = (*_plain(row), _json_text(attempts), _json_text(row["receipt"]))
    at = utc(row["at"])
    at_s = at.timestamp() if at is not None else 0.0
    out = []
    for seq, a in enumerate(attempts):
        if not isinstance(a, Mapping):
            continue
        cand = a.get("candidate")
        if not isinstance(cand, str) or not cand:
            continue
        status = a.get("status")
        provider = str(a.get("provider") or cand.partition("/")[0])  # as the page read it before
        out.append((seq, at_s, storable(cand), storable(provider), storable(str(a.get("model") or "")),
                    storable(str(a.get("outcome") or "")),
                    status if isinstance(status, int) and not isinstance(status, bool)
                    and abs(status) < 2**31 else None,
                    _number(a.get("latency_ms"))))
    return EncodedRow(values, tuple(out))
