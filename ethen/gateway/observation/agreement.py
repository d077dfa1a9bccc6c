"""How far a shadow's answer agrees with the primary's (issue 27, shadow evaluation). Pure functions of the
two answers and the request's JSON schema; the shell (``ethen.gateway.api.shadow``) records the result.

- An :class:`Answer` is the first choice's text and tool calls, read from a ``chat.completion`` body
  (:func:`answer_of_completion`) or from a chat stream's SSE chunks (:func:`answer_of_chunks`: the deltas'
  ``content`` concatenated, tool calls assembled by ``index``).
- ``exact``: the texts are equal, byte for byte, and so are the tool calls (:func:`tool_calls_equal`, or
  neither has any).
- ``similarity``: ``difflib.SequenceMatcher(None, a, b).ratio()`` over the *normalized* texts
  (:func:`normalize`: casefolded, every run of whitespace made one space, stripped), each cut to its first
  :data:`SIMILARITY_CHARS` characters (the ratio is quadratic in the worst case); two empty texts are 1.0.
- ``tool_calls_equal``: the same number of tool calls, pairwise the same function name and the same
  arguments compared as parsed JSON (``{"a": 1, "b": 2}`` equals ``{"b":2,"a":1}``; arguments that are no
  JSON compare as strings). ``None`` when neither answer called a tool.
- ``schema_valid`` / ``primary_schema_valid``: the candidate's (the primary's) text parses as JSON and
  validates against the request's ``response_format.json_schema.schema`` (``jsonschema``, the draft the
  schema names, else 2020-12). ``None`` when the request had no schema (:func:`schema_of`).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
from referencing.exceptions import Unresolvable

__all__ = [
    "SIMILARITY_CHARS",
    "Agreement",
    "Answer",
    "ToolCall",
    "agreement",
    "answer_of_chunks",
    "answer_of_completion",
    "normalize",
    "schema_of",
    "schema_valid",
    "similarity",
    "tool_calls_equal",
]

SIMILARITY_CHARS = 8_000


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # as the model sent it (JSON text, normally)


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Agreement:
    exact: bool
    similarity: float
    tool_calls_equal: bool | None
    schema_valid: bool | None
    primary_schema_valid: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {"exact": self.exact, "similarity": self.similarity, "tool_calls_equal": self.tool_calls_equal,
                "schema_valid": self.schema_valid, "primary_schema_valid": self.primary_schema_valid}


def _calls(raw: Any) -> tuple[ToolCall, ...]:
    out = []
    for tc in raw if isinstance(raw, list) else ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(fn, Mapping):
            name, args = fn.get("name"), fn.get("arguments")
            out.append(ToolCall(name if isinstance(name, str) else "", args if isinstance(args, str) else
                                json.dumps(args) if args is not None else ""))
    return tuple(out)


def answer_of_completion(body: Mapping[str, Any]) -> Answer:
    """The first choice of a ``chat.completion`` body (text ``""`` when it has none)."""
    choices = body.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    msg = first.get("message") if isinstance(first, Mapping) else None
    if not isinstance(msg, Mapping):
        return Answer("")
    content = msg.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping)
                          and isinstance(p.get("text"), str))
    return Answer(content if isinstance(content, str) else "", _calls(msg.get("tool_calls")))


def _payloads(chunk: bytes) -> Iterable[bytes]:
    chunk = chunk.strip()
    if chunk.startswith(b"{"):  # a provider stream's payload: one JSON object
        yield chunk
        return
    for line in chunk.split(b"\n"):  # SSE frames
        if line.startswith(b"data:"):
            yield line[5:].strip()


def _events(chunks: Iterable[bytes]) -> Iterable[Mapping[str, Any]]:
    for chunk in chunks:
        for data in _payloads(chunk):
            if not data or data == b"[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if isinstance(obj, Mapping):
                yield obj


def answer_of_chunks(chunks: Iterable[bytes]) -> Answer:
    """The first choice of a chat stream: ``chat.completion.chunk`` objects, one JSON object per chunk (a
    provider stream's payloads) or as SSE ``data:`` lines."""
    text: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]
    for ev in _events(chunks):
        choices = ev.get("choices")
        for ch in choices if isinstance(choices, list) else ():
            if not isinstance(ch, Mapping) or ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta")
            if not isinstance(delta, Mapping):
                continue
            c = delta.get("content")
            if isinstance(c, str):
                text.append(c)
            for tc in delta.get("tool_calls") or ():
                if not isinstance(tc, Mapping):
                    continue
                i = tc.get("index", 0)
                slot = calls.setdefault(i if isinstance(i, int) else 0, ["", ""])
                fn = tc.get("function")
                if isinstance(fn, Mapping):
                    if isinstance(fn.get("name"), str):
                        slot[0] += fn["name"]
                    if isinstance(fn.get("arguments"), str):
                        slot[1] += fn["arguments"]
    return Answer("".join(text), tuple(ToolCall(n, a) for _, (n, a) in sorted(calls.items())))


def normalize(text: str) -> str:
    """Casefolded, whitespace runs as one space, stripped."""
    return " ".join(text.casefold().split())


def similarity(a: str, b: str) -> float:
    """``difflib`` ratio of the normalized texts (module docstring), in ``[0, 1]``."""
    na, nb = normalize(a)[:SIMILARITY_CHARS], normalize(b)[:SIMILARITY_CHARS]
    if na == nb:
        return 1.0
    return difflib.SequenceMatcher(None, na, nb).ratio()


def _parsed(s: str) -> Any:
    try:
        return ("json", json.loads(s))
    except ValueError:
        return ("text", s)


def tool_calls_equal(a: tuple[ToolCall, ...], b: tuple[ToolCall, ...]) -> bool | None:
    """Same names and JSON-equal arguments, in order; ``None`` when neither side has a tool call."""
    if not a and not b:
        return None
    if len(a) != len(b):
        return False
    return all(x.name == y.name and _parsed(x.arguments) == _parsed(y.arguments) for x, y in zip(a, b,
                                                                                                strict=True))


def schema_of(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The request's ``response_format`` JSON schema (``type: json_schema``), else ``None``."""
    rf = body.get("response_format")
    if not isinstance(rf, Mapping) or rf.get("type") != "json_schema":
        return None
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, Mapping) else None
    return schema if isinstance(schema, Mapping) else None


def schema_valid(text: str, schema: Mapping[str, Any] | None) -> bool | None:
    """Whether ``text`` is JSON valid against ``schema`` (``None`` without a schema; an invalid schema makes
    every text invalid)."""
    if schema is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return bool(cls(schema).is_valid(doc))
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType, Unresolvable,
            RecursionError):
        return False


def agreement(primary: Answer, candidate: Answer, schema: Mapping[str, Any] | None) -> Agreement:
    """Every agreement field of one pair (module docstring)."""
    tools = tool_calls_equal(primary.tool_calls, candidate.tool_calls)
    exact = primary.text == candidate.text and tools is not False
    return Agreement(exact, similarity(primary.text, candidate.text), tools,
                     schema_valid(candidate.text, schema), schema_valid(primary.text, schema))
