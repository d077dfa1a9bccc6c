"""Issue 42 item 6, property: ``parse_requirements`` accepts a sampling field exactly when the OpenAI API
description (``/work/shared/openai/openapi.json``, ``CreateChatCompletionRequest``) does: the oracle reads
each field's type, ``minimum`` and ``maximum`` from the description itself, not from the gateway's table.
A refused value is 400 ``invalid_value`` (right type, out of range) or ``invalid_type``, naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.errors import InvalidRequestError
from ethen.gateway.routing.requirements import SAMPLING_RANGES, parse_requirements
from tests.gateway.schemas import SPEC_PATH

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
#: described elsewhere: ``n`` (the gateway lets the upstream judge its upper bound), ``seed`` (the
#: description's bounds are 2^63 rounded to a double; the gateway takes the int64 range, tested below)
NOT_ORACLED = {"n", "seed"}


def _numeric_fields() -> dict[str, tuple[str, float, float]]:
    """field -> (JSON type, minimum, maximum) of every bounded numeric field of the chat request."""
    schemas = json.loads(SPEC_PATH.read_text())["components"]["schemas"]

    def props(schema: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in schema:
            return props(schemas[schema["$ref"].rsplit("/", 1)[1]])
        out: dict[str, Any] = {}
        for part in schema.get("allOf", []):
            out.update(props(part))
        out.update(schema.get("properties", {}))
        return out

    found: dict[str, tuple[str, float, float]] = {}
    for name, spec in props(schemas["CreateChatCompletionRequest"]).items():
        for alt in [spec, *spec.get("anyOf", []), *spec.get("oneOf", [])]:
            if alt.get("type") in ("number", "integer") and "minimum" in alt and "maximum" in alt:
                found[name] = (alt["type"], alt["minimum"], alt["maximum"])
    return found


FIELDS = _numeric_fields()
ORACLED = sorted(set(FIELDS) - NOT_ORACLED)


def test_the_gateway_checks_every_bounded_field_of_the_description() -> None:
    assert set(ORACLED) == {"temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs"}
    assert set(ORACLED) <= set(SAMPLING_RANGES)


def _oracle(field: str, value: Any) -> str | None:
    """``None`` (valid), else the error code the description implies."""
    kind, lo, hi = FIELDS[field]
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number:
        return "invalid_type"
    if kind == "integer" and not isinstance(value, int):
        return "invalid_value"
    return None if lo <= value <= hi else "invalid_value"


values = (
    st.none() | st.booleans() | st.text(max_size=3) | st.lists(st.integers(), max_size=1)
    | st.integers(-40, 40) | st.integers(-(2**70), 2**70)
    | st.floats(-25, 25, allow_nan=False) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 0.0, 1, 1.0, 2, 2.0, -2, -2.0, 20, 21, 2.0000001, -2.0000001, 1.0000001, -0.0])
)


@settings(max_examples=600, deadline=None, database=None)
@given(field=st.sampled_from(ORACLED), value=values)
def test_accepted_exactly_when_the_description_allows_it(field: str, value: Any) -> None:
    expected = _oracle(field, value)
    try:
        parse_requirements({**BASE, field: value})
    except InvalidRequestError as err:
        assert (err.code, err.param) == (expected, field), (field, value, err)
    else:
        assert expected is None, (field, value)


@settings(max_examples=300, deadline=None, database=None)
@given(fields=st.dictionaries(st.sampled_from(ORACLED), values, min_size=2, max_size=5))
def test_several_fields_the_first_wrong_one_is_named(fields: dict[str, Any]) -> None:
    wrong = [f for f in SAMPLING_RANGES if f in fields and _oracle(f, fields[f]) is not None]
    try:
        parse_requirements({**BASE, **fields})
    except InvalidRequestError as err:
        assert wrong and err.param == wrong[0]
    else:
        assert not wrong


@pytest.mark.parametrize(("value", "code"), [(2**63 - 1, None), (-(2**63), None), (2**63, "invalid_value"),
                                             (-(2**63) - 1, "invalid_value"), (1.0, "invalid_value"),
                                             ("1", "invalid_type"), (True, "invalid_type")])
def test_seed_is_a_64_bit_integer(value: Any, code: str | None) -> None:
    try:
        parse_requirements({**BASE, "seed": value})
    except InvalidRequestError as err:
        assert (err.code, err.param) == (code, "seed")
    else:
        assert code is None
