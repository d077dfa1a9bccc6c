"""Hard requirements from the raw chat-completions body, parsed once and validated field by field.

Every malformed field raises :class:`~ethen.gateway.errors.InvalidRequestError` whose ``param`` is the dotted
path of the field (``messages[1].content[0].type``, ``metadata.routing.budget_ceiling_usd``, ...). Fields the
router does not read are left to the upstream.

Choices where the spec is silent:

* ``tools``: a ``tools`` array that is present (even empty) requires tool support; so does the legacy
  ``functions`` array. ``null`` means absent.
* ``response_format``: ``{"type": "json_object"}`` and ``{"type": "json_schema", ...}`` require structured
  output; ``{"type": "text"}`` is the default behaviour and requires nothing.
* vision: any content part of type ``image_url`` or ``input_image`` in any message. An ``image_url`` part
  must carry its image: ``image_url`` is an object with a non-empty string ``url`` (OpenAI's shape) or, as
  LiteLLM also accepts, the URL string itself; anything else is refused naming
  ``messages[i].content[j].image_url``.
* error codes: a value of the wrong JSON type gets ``invalid_type``, a value of the right type outside its
  range or set gets ``invalid_value``, a missing required field ``missing_required_parameter`` and an unknown
  key under ``metadata.routing`` ``unknown_parameter``; ``param`` is always the field's dotted path.
* ``n`` (choices, ``null`` = 1) is an integer in ``[1, MAX_SAFE_INTEGER]`` like the max output fields (the
  upstream judges its own upper limit); routing ignores it, the gateway's budget bounds use it (a request's
  completion tokens may reach ``n`` x its max output).
* max output: ``max_completion_tokens`` and ``max_tokens`` (``null`` = absent); when both are given the larger
  one must fit (conservative: providers differ in which one they honour). Each must be an integer in
  ``[1, MAX_SAFE_INTEGER]`` (2^53 - 1, the largest integer every JSON client represents exactly); a larger
  integer, like a number that is not finite, is refused with ``invalid_value`` (it would not convert to a
  float for the cost estimate). The same bound applies to an integer ``budget_ceiling_usd``.
* sampling fields (issue 42): ``temperature`` in ``[0, 2]``, ``top_p`` in ``[0, 1]``, ``presence_penalty`` and
  ``frequency_penalty`` in ``[-2, 2]``, ``top_logprobs`` an integer in ``[0, 20]``, ``seed`` a 64-bit integer,
  ``logprobs`` a boolean, ``logit_bias`` an object of numbers in ``[-100, 100]`` (the OpenAI API's ranges,
  :data:`SAMPLING_RANGES`; ``null`` = absent). Out of range: 400 ``invalid_value`` naming the field before
  routing, so a client's mistake never reaches (nor counts against) a provider.
* ``metadata.routing`` is our namespace, so unknown keys in it are rejected (a typo must not silently drop a
  budget; OpenAI likewise refuses unrecognized request arguments, so strictness is what its clients expect).
  Keys elsewhere in ``metadata`` are the client's own tags and pass through to the upstream untouched.
  ``certification_level`` is ``"any"`` (default) or ``"live"``; ``latency_target`` is one of
  :data:`~ethen.gateway.routing.policy.LATENCY_TARGETS`.
* ``providerOptions.gateway.only`` must be a non-empty array of provider ids.
* nesting: a field the estimator walks (a message's fields and content parts, ``tools``, ``functions``,
  ``response_format``) may nest arrays/objects at most :data:`MAX_NESTING` (64) levels deep, else
  ``invalid_value`` naming it (OpenAI's structured-output schemas stop at 10 levels). The walk recurses once
  per level, so a deeper body that json still parses (~900 levels) would exhaust Python's recursion limit.
* types before sets: every value tested for membership in a set (``response_format.type``, routing enums,
  content-part types) is first checked to be a string, so a list, object, number, bool or ``null`` where a
  string is expected is a 400 ``invalid_type``, never a ``TypeError`` (unhashable) or a silent pass.

Token estimator (conservative, no tokenizer): the UTF-8 byte length of every string in the messages, the tool
schemas and the ``response_format`` schema (plus the bytes of every object key and 4 bytes of punctuation
per key, 1 per array item) divided by 3 and rounded up, plus 4 tokens per message and 3 for the reply
primer; each image part counts :data:`IMAGE_TOKENS` (1,600: above the largest per-image cost of OpenAI high
detail (1,105 at 2048x768) and Anthropic's ~1,600 cap) and its URL/base64 payload is not counted as text.
BPE tokenizers average about 4 bytes per token on English and about 3 bytes per CJK character token, so
bytes/3 overestimates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from ethen.gateway.errors import InvalidRequestError

from .policy import LATENCY_TARGETS

__all__ = [
    "BYTES_PER_TOKEN",
    "CERTIFICATION_LEVELS",
    "IMAGE_PART_TYPES",
    "IMAGE_TOKENS",
    "MAX_NESTING",
    "MAX_SAFE_INTEGER",
    "ROUTING_KEYS",
    "SAMPLING_RANGES",
    "Requirements",
    "estimate_tokens",
    "parse_requirements",
]

BYTES_PER_TOKEN: Final = 3
_MAPPING: Final = (dict, Mapping)  # dict first: the common case skips the ABC check
IMAGE_TOKENS: Final = 1600
MAX_SAFE_INTEGER: Final = 2**53 - 1
MAX_NESTING: Final = 64
TOKENS_PER_MESSAGE: Final = 4
TOKENS_REPLY_PRIMER: Final = 3
IMAGE_PART_TYPES: Final = frozenset({"image_url", "input_image"})
CERTIFICATION_LEVELS: Final = ("any", "live")
ROUTING_KEYS: Final = frozenset(
    {"budget_ceiling_usd", "latency_target", "certification_level", "max_wait_ms"}
)
STRUCTURED_FORMATS: Final = frozenset({"json_object", "json_schema"})
RESPONSE_FORMATS: Final = frozenset({"text", "json_object", "json_schema"})
#: numeric sampling fields of a chat body: (lowest, highest, integer only), the OpenAI API's ranges
SAMPLING_RANGES: Final = MappingProxyType({
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "top_logprobs": (0, 20, True),
    "seed": (-(2**63), 2**63 - 1, True),
})
LOGIT_BIAS_RANGE: Final = (-100.0, 100.0)
#: every field :func:`_check_sampling` reads: a body naming none of them (most do) skips the checks at once
_SAMPLING_KEYS: Final = frozenset((*SAMPLING_RANGES, "logprobs", "logit_bias"))


class Requirements(NamedTuple):
    """What the request needs from any candidate, plus the routing options it carries. Immutable (a
    ``NamedTuple``: built once per request, cheaper than a frozen dataclass)."""

    model: str
    tools: bool = False
    vision: bool = False
    structured_output: bool = False
    input_tokens: int = 0
    max_output_tokens: int | None = None
    budget_ceiling_usd: float | None = None
    certification_live: bool = False
    only_providers: frozenset[str] | None = None
    latency_target: str | None = None
    choices: int = 1  # ``n``: completions asked for (each up to ``max_output_tokens``); billing bounds only
    max_wait_ms: float | None = None  # metadata.routing.max_wait_ms (issue 44): tightens [[wait_targets]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tools": self.tools,
            "vision": self.vision,
            "structured_output": self.structured_output,
            "estimated_input_tokens": self.input_tokens,
            "max_output_tokens": self.max_output_tokens,
            "budget_ceiling_usd": self.budget_ceiling_usd,
            "certification_level": "live" if self.certification_live else "any",
            "only_providers": sorted(self.only_providers) if self.only_providers is not None else None,
            "latency_target": self.latency_target,
            "max_wait_ms": self.max_wait_ms,
        }


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, code=code, param=param)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _str_bytes(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def _json_bytes(value: object, where: str, depth: int = 1) -> int:
    """Approximate compact-JSON byte size of a parsed JSON value (strings by UTF-8 bytes). ``where`` names
    the field in the error for nesting deeper than :data:`MAX_NESTING`."""
    if isinstance(value, str):
        return _str_bytes(value) + 2
    if isinstance(value, _MAPPING):
        if depth > MAX_NESTING:
            raise _too_deep(where)
        depth += 1
        return sum(_str_bytes(str(k)) + 4 + _json_bytes(v, where, depth) for k, v in value.items()) + 2
    if isinstance(value, list | tuple):
        if depth > MAX_NESTING:
            raise _too_deep(where)
        depth += 1
        return sum(_json_bytes(v, where, depth) + 1 for v in value) + 2
    return 5  # number, bool, null


def _too_deep(where: str) -> InvalidRequestError:
    return _bad(where, f"{where} nests arrays/objects deeper than {MAX_NESTING} levels")


def estimate_tokens(nbytes: int, images: int = 0, messages: int = 0) -> int:
    """The estimator's arithmetic (see module docstring)."""
    return (
        -(-nbytes // BYTES_PER_TOKEN)
        + images * IMAGE_TOKENS
        + messages * TOKENS_PER_MESSAGE
        + (TOKENS_REPLY_PRIMER if messages else 0)
    )


def _parse_messages(messages: object) -> tuple[int, int]:
    """Validate ``messages``; return (text bytes, image parts)."""
    if messages is None:
        raise _bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, got {_type_name(messages)}", "invalid_type")
    if not messages:
        raise _bad("messages", "'messages' must contain at least one message")
    nbytes = 0
    images = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, _MAPPING):
            raise _bad(where, f"{where} must be an object, got {_type_name(msg)}", "invalid_type")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(
                f"{where}.role", f"{where}.role must be a non-empty string, got {role!r}", "invalid_type"
            )
        for key, value in msg.items():
            if key != "content":
                nbytes += _str_bytes(str(key)) + _json_bytes(value, f"{where}.{key}")
        content = msg.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            nbytes += _str_bytes(content)
            continue
        if not isinstance(content, list):
            raise _bad(
                f"{where}.content",
                f"{where}.content must be a string or an array of parts, got {_type_name(content)}",
                "invalid_type",
            )
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, _MAPPING):
                raise _bad(pwhere, f"{pwhere} must be an object, got {_type_name(part)}", "invalid_type")
            ptype = part.get("type")
            if not isinstance(ptype, str) or not ptype:
                raise _bad(
                    f"{pwhere}.type",
                    f"{pwhere}.type must be a non-empty string, got {ptype!r}",
                    "invalid_value" if isinstance(ptype, str) else "invalid_type",
                )
            if ptype in IMAGE_PART_TYPES:
                if ptype == "image_url":
                    _check_image_url(part.get("image_url"), f"{pwhere}.image_url")
                images += 1
                continue
            if ptype == "text" and not isinstance(part.get("text"), str):
                raise _bad(f"{pwhere}.text", f"{pwhere}.text must be a string", "invalid_type")
            nbytes += _json_bytes(part, pwhere)
    return nbytes, images


def _check_image_url(value: object, where: str) -> None:
    url = value.get("url") if isinstance(value, _MAPPING) else value
    if not isinstance(url, str) or not url:
        raise _bad(
            where,
            f"{where} must be an object with a non-empty string 'url' (or the URL string), got {value!r:.80}",
            "invalid_type" if value is not None else "missing_required_parameter",
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        code = "invalid_value" if _is_number(value) else "invalid_type"  # 1.5, NaN: a number, not an int
        raise _bad(key, f"'{key}' must be an integer >= 1, got {value!r}", code)
    if not 1 <= value <= MAX_SAFE_INTEGER:
        shown = repr(value) if value < 10**20 else f"an integer of {len(str(value))} digits"
        raise _bad(key, f"'{key}' must be an integer between 1 and {MAX_SAFE_INTEGER}, got {shown}")
    return value


def _in_range(key: str, value: object, lo: float, hi: float, integer: bool) -> None:
    """``value`` (not ``None``) a number (an integer when ``integer``) within ``[lo, hi]``, else 400."""
    if not _is_number(value) or (integer and not isinstance(value, int)):
        code = "invalid_value" if _is_number(value) else "invalid_type"
        raise _bad(key, f"'{key}' must be {_range_text(lo, hi, integer)}, got {value!r:.40}", code)
    assert isinstance(value, int | float)
    if not lo <= value <= hi:
        big = f"{value:.3g}" if isinstance(value, float) else "a huge integer"
        shown = repr(value) if abs(value) < 10**20 else big
        raise _bad(key, f"'{key}' must be {_range_text(lo, hi, integer)}, got {shown}")


def _range_text(lo: float, hi: float, integer: bool) -> str:
    """The allowed range as an error message states it (built only for an error)."""
    return f"an integer between {lo} and {hi}" if integer else f"a number between {lo:g} and {hi:g}"


def _check_sampling(body: Mapping[str, Any]) -> None:
    """The sampling fields' types and ranges (:data:`SAMPLING_RANGES`, ``logprobs``, ``logit_bias``)."""
    if _SAMPLING_KEYS.isdisjoint(body):  # none present: nothing to check (one hash lookup per body key)
        return
    for key, (lo, hi, integer) in SAMPLING_RANGES.items():
        value = body.get(key)
        if value is not None:
            _in_range(key, value, lo, hi, integer)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", f"'logprobs' must be a boolean, got {_type_name(logprobs)}", "invalid_type")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, _MAPPING):
        raise _bad("logit_bias", f"'logit_bias' must be an object, got {_type_name(bias)}", "invalid_type")
    lo, hi = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        _in_range(f"logit_bias.{token}", value, lo, hi, False)


def _parse_max_wait(routing: Mapping[str, Any]) -> float | None:
    value = routing.get("max_wait_ms")
    if value is None:
        return None
    if not _is_number(value) or (isinstance(value, int) and abs(value) > MAX_SAFE_INTEGER) or not (
        math.isfinite(value) and value > 0
    ):
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**20 else "a huge integer"
        raise _bad(
            "metadata.routing.max_wait_ms",
            f"'metadata.routing.max_wait_ms' must be a finite number > 0, got {shown}",
            "invalid_value" if _is_number(value) else "invalid_type",
        )
    return float(value)


def _parse_routing(metadata: object) -> tuple[float | None, str | None, bool, float | None]:
    if metadata is None:
        return None, None, False, None
    if not isinstance(metadata, _MAPPING):
        raise _bad("metadata", f"'metadata' must be an object, got {_type_name(metadata)}", "invalid_type")
    routing = metadata.get("routing")
    if routing is None:
        return None, None, False, None
    if not isinstance(routing, _MAPPING):
        raise _bad(
            "metadata.routing",
            f"'metadata.routing' must be an object, got {_type_name(routing)}",
            "invalid_type",
        )
    for key in routing:
        if key not in ROUTING_KEYS:
            raise _bad(
                f"metadata.routing.{key}",
                f"unknown key 'metadata.routing.{key}'; allowed: {', '.join(sorted(ROUTING_KEYS))}",
                "unknown_parameter",
            )
    ceiling = routing.get("budget_ceiling_usd")
    if ceiling is not None and (
        not _is_number(ceiling)
        or (isinstance(ceiling, int) and abs(ceiling) > MAX_SAFE_INTEGER)
        or not math.isfinite(ceiling)
        or ceiling < 0
    ):
        shown = repr(ceiling) if not isinstance(ceiling, int) or abs(ceiling) < 10**20 else "a huge integer"
        raise _bad(
            "metadata.routing.budget_ceiling_usd",
            f"'metadata.routing.budget_ceiling_usd' must be a finite number >= 0, got {shown}",
            "invalid_value" if _is_number(ceiling) else "invalid_type",
        )
    target = routing.get("latency_target")
    if target is not None and (not isinstance(target, str) or target not in LATENCY_TARGETS):
        raise _bad(
            "metadata.routing.latency_target",
            f"'metadata.routing.latency_target' must be one of {', '.join(LATENCY_TARGETS)}, got {target!r}",
            "invalid_value" if isinstance(target, str) else "invalid_type",
        )
    level = routing.get("certification_level")
    if level is not None and (not isinstance(level, str) or level not in CERTIFICATION_LEVELS):
        raise _bad(
            "metadata.routing.certification_level",
            f"'metadata.routing.certification_level' must be one of {', '.join(CERTIFICATION_LEVELS)}, "
            f"got {level!r}",
            "invalid_value" if isinstance(level, str) else "invalid_type",
        )
    return (
        float(ceiling) if ceiling is not None else None,
        target if target != "balanced" else None,
        level == "live",
        _parse_max_wait(routing),
    )


def _parse_only(body: Mapping[str, Any]) -> frozenset[str] | None:
    options = body.get("providerOptions")
    if options is None:
        return None
    if not isinstance(options, _MAPPING):
        raise _bad("providerOptions", "'providerOptions' must be an object", "invalid_type")
    gateway = options.get("gateway")
    if gateway is None:
        return None
    if not isinstance(gateway, _MAPPING):
        raise _bad("providerOptions.gateway", "'providerOptions.gateway' must be an object", "invalid_type")
    only = gateway.get("only")
    if only is None:
        return None
    if (
        not isinstance(only, list)
        or not only
        or not all(isinstance(p, str) and p for p in only)
    ):
        raise _bad(
            "providerOptions.gateway.only",
            f"'providerOptions.gateway.only' must be a non-empty array of provider ids, got {only!r}",
            "invalid_value" if isinstance(only, list) else "invalid_type",
        )
    return frozenset(only)


def _parse_tools(body: Mapping[str, Any], key: str) -> tuple[bool, int]:
    tools = body.get(key)
    if tools is None:
        return False, 0
    if not isinstance(tools, list):
        raise _bad(key, f"'{key}' must be an array, got {_type_name(tools)}", "invalid_type")
    for i, tool in enumerate(tools):
        if not isinstance(tool, _MAPPING):
            raise _bad(
                f"{key}[{i}]", f"'{key}[{i}]' must be an object, got {_type_name(tool)}", "invalid_type"
            )
    return True, _json_bytes(tools, key)


def parse_requirements(body: Mapping[str, Any]) -> Requirements:
    """Parse and validate the body once; raise ``InvalidRequestError`` naming the first malformed field."""
    if not isinstance(body, _MAPPING):
        raise _bad("", f"the request body must be a JSON object, got {_type_name(body)}", "invalid_type")
    model = body.get("model")
    if model is None:
        raise _bad("model", "'model' is required", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"'model' must be a non-empty string, got {model!r}", "invalid_type")
    nbytes, images = _parse_messages(body.get("messages"))
    needs_tools, tool_bytes = _parse_tools(body, "tools")
    needs_functions, function_bytes = _parse_tools(body, "functions")
    nbytes += tool_bytes + function_bytes

    structured = False
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, _MAPPING):
            raise _bad("response_format", "'response_format' must be an object", "invalid_type")
        ftype = fmt.get("type")
        if not isinstance(ftype, str) or ftype not in RESPONSE_FORMATS:  # a list/dict is unhashable
            raise _bad(
                "response_format.type",
                f"'response_format.type' must be one of {', '.join(sorted(RESPONSE_FORMATS))}, got {ftype!r}",
                "invalid_value" if isinstance(ftype, str) else "invalid_type",
            )
        structured = ftype in STRUCTURED_FORMATS
        if structured:
            nbytes += _json_bytes(fmt, "response_format")

    mct = _positive_int(body, "max_completion_tokens")
    mt = _positive_int(body, "max_tokens")
    n = _positive_int(body, "n")
    _check_sampling(body)
    max_out = mt if mct is None else (mct if mt is None else max(mct, mt))
    ceiling, target, live, max_wait = _parse_routing(body.get("metadata"))
    only = _parse_only(body)
    return Requirements(
        model=model,
        tools=needs_tools or needs_functions,
        vision=images > 0,
        structured_output=structured,
        input_tokens=estimate_tokens(nbytes, images, len(body["messages"])),
        max_output_tokens=max_out,
        budget_ceiling_usd=ceiling,
        certification_live=live,
        only_providers=only,
        latency_target=target,
        choices=1 if n is None else n,
        max_wait_ms=max_wait,
    )
