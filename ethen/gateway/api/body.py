"""A request body, read and parsed once: size bound, strict JSON (no NaN/Infinity, no lone surrogates, bounded
nesting) and the stream options, each refused with the gateway's own errors (a 4xx naming the field)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from ethen.gateway.errors import InvalidRequestError, RequestTooLargeError

__all__ = ["MAX_BODY_BYTES", "parse_body", "read_body", "stream_options"]

#: Largest accepted request body (a base64 image-heavy request stays well below it).
MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing more than ``limit`` bytes without reading them all."""
    too_large = f"The request body is larger than the gateway's limit of {limit} bytes."
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(too_large)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(too_large)
        chunks.append(chunk)
    return b"".join(chunks)


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise _NonFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: valid JSON syntax, but no double holds it
        raise _NonFinite(text)
    return value


#: Python's json reads NaN / Infinity / -Infinity and turns 1e400 into inf; RFC 8259 (and OpenAI) have no
#: such numbers, and forwarding them would hand the upstream invalid JSON. json's C scanner still does the
#: parsing (the float hook runs per float literal, a handful per body); only a body holding one re-parses.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _non_finite_path(body: Any) -> str:
    """Dotted path of the first NaN/Infinity in ``body`` (iterative: any depth json parsed)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return ""


#: A JSON escape of a UTF-16 surrogate (``\\uD800``-``\\uDFFF``). json joins a valid pair into one code point,
#: so a surrogate left in a parsed string was alone: valid JSON text, but no Unicode string (no UTF-8 for it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_path(body: dict[str, Any]) -> str | None:
    """Dotted path of the first string (or key: then its object's path) holding a lone surrogate, else
    ``None`` (iterative: any depth json parsed)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if _LONE_SURROGATE.search(k):
                    return path
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = _DECODER.decode(raw.decode())  # decoding first skips json's encoding sniffing
    except _NonFinite as exc:
        try:
            path = _non_finite_path(json.loads(raw.decode()))
        except (ValueError, RecursionError):  # also malformed after the constant: no path to name
            path = ""
        raise InvalidRequestError(
            f"{repr(path) if path else 'The body'} holds {exc}, which is not a finite number "
            "(JSON has no NaN or Infinity).",
            code="invalid_value",
            param=path or None,
        ) from None
    except (ValueError, RecursionError):
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. The body must be a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, got {type(body).__name__}.", code="invalid_type"
        )
    # a memchr for any escape, then one regex scan of the bytes; the walk only when that matches
    if b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None:
        where = _lone_surrogate_path(body)
        if where is not None:
            raise InvalidRequestError(
                f"{repr(where) if where else 'The body'} holds a lone UTF-16 surrogate escape "
                "(\\uD800-\\uDFFF without its pair), which is not valid Unicode.",
                code="invalid_value",
                param=where or None,
            )
    return body


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequestError(
            f"Invalid type for 'stream': expected a boolean, got {type(stream).__name__}.",
            code="invalid_type",
            param="stream",
        )
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, Mapping):
            raise InvalidRequestError(
                "Invalid type for 'stream_options': expected an object.",
                code="invalid_type",
                param="stream_options",
            )
        iu = opts.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise InvalidRequestError(
                "Invalid type for 'stream_options.include_usage': expected a boolean.",
                code="invalid_type",
                param="stream_options.include_usage",
            )
        if not stream:
            raise InvalidRequestError(
                "'stream_options' is only allowed when 'stream' is true.",
                code="invalid_value",
                param="stream_options",
            )
        include_usage = bool(iu)
    return stream, include_usage
