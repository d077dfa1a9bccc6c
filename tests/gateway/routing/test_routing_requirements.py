"""Requirements parsing: every hard requirement, every malformed field (named in ``param``), the estimator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ethen.gateway.errors import InvalidRequestError, http_status
from ethen.gateway.routing import parse_requirements
from ethen.gateway.routing.requirements import IMAGE_TOKENS

MSG = [{"role": "user", "content": "hello"}]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "ethen/auto", "messages": MSG, **extra}


def test_plain_body_has_no_requirements() -> None:
    req = parse_requirements(body())
    assert not (req.tools or req.vision or req.structured_output or req.certification_live)
    assert req.max_output_tokens is None and req.budget_ceiling_usd is None and req.only_providers is None
    assert req.model == "ethen/auto"


def test_tools_array_requires_tools_even_empty_and_legacy_functions() -> None:
    assert parse_requirements(body(tools=[{"type": "function", "function": {"name": "f"}}])).tools
    assert parse_requirements(body(tools=[])).tools
    assert parse_requirements(body(functions=[{"name": "f"}])).tools
    assert not parse_requirements(body(tools=None)).tools


def test_image_part_in_any_message_requires_vision() -> None:
    msgs = [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "what"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
    ]
    assert parse_requirements({"model": "m", "messages": msgs}).vision
    assert not parse_requirements({"model": "m", "messages": msgs[:1]}).vision


@pytest.mark.parametrize(
    ("fmt", "structured"), [("json_object", True), ("json_schema", True), ("text", False)]
)
def test_response_format(fmt: str, structured: bool) -> None:
    assert parse_requirements(body(response_format={"type": fmt})).structured_output is structured


def test_n_is_the_number_of_choices() -> None:
    assert parse_requirements(body()).choices == 1 and parse_requirements(body(n=None)).choices == 1
    assert parse_requirements(body(n=3)).choices == 3


def test_max_output_takes_the_larger_of_both_fields() -> None:
    assert parse_requirements(body(max_tokens=100)).max_output_tokens == 100
    assert parse_requirements(body(max_completion_tokens=300)).max_output_tokens == 300
    assert parse_requirements(body(max_tokens=500, max_completion_tokens=300)).max_output_tokens == 500
    assert parse_requirements(body(max_tokens=None)).max_output_tokens is None


def test_routing_metadata() -> None:
    req = parse_requirements(
        body(metadata={"routing": {"budget_ceiling_usd": 0.05, "latency_target": "fast",
                                   "certification_level": "live"}})
    )
    assert req.budget_ceiling_usd == 0.05 and req.latency_target == "fast" and req.certification_live
    balanced = parse_requirements(body(metadata={"routing": {"latency_target": "balanced"}}))
    assert balanced.latency_target is None
    anyc = parse_requirements(body(metadata={"routing": {"certification_level": "any"}}))
    assert not anyc.certification_live


def test_provider_only() -> None:
    req = parse_requirements(body(providerOptions={"gateway": {"only": ["openai", "groq"]}}))
    assert req.only_providers == frozenset({"openai", "groq"})


def test_estimator_is_conservative_and_counts_tools_and_images() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 100  # ~1,000 GPT tokens
    base = parse_requirements({"model": "m", "messages": [{"role": "user", "content": text}]}).input_tokens
    assert base >= len(text) // 4 + 4  # above the ~4 chars/token average of BPE tokenizers
    assert base >= len(text) // 3
    tools = [{"type": "function", "function": {"name": "lookup", "description": "x" * 300,
                                               "parameters": {"type": "object"}}}]
    with_tools = parse_requirements({"model": "m", "messages": [{"role": "user", "content": text}],
                                     "tools": tools}).input_tokens
    assert with_tools - base >= len(json.dumps(tools)) // 4
    url = "data:image/png;base64," + "A" * 90000
    img = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    one_image = parse_requirements({"model": "m", "messages": [img]}).input_tokens
    assert IMAGE_TOKENS <= one_image < IMAGE_TOKENS + 50  # the base64 payload is not counted as text
    cjk = "漢字" * 500
    cjk_req = parse_requirements({"model": "m", "messages": [{"role": "user", "content": cjk}]})
    assert cjk_req.input_tokens >= len(cjk)  # ~1 token per CJK character


MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"messages": MSG}, "model"),
    ({"model": 3, "messages": MSG}, "model"),
    ({"model": "", "messages": MSG}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [MSG[0], {"role": "user", "content": [{"text": "x"}]}]},
     "messages[1].content[0].type"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    (body(tools={"type": "function"}), "tools"),
    (body(tools=["f"]), "tools[0]"),
    (body(functions="f"), "functions"),
    (body(response_format="json"), "response_format"),
    (body(response_format={"type": "yaml"}), "response_format.type"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens="10"), "max_tokens"),
    (body(max_tokens=True), "max_tokens"),
    (body(max_completion_tokens=-5), "max_completion_tokens"),
    (body(metadata="x"), "metadata"),
    (body(metadata={"routing": []}), "metadata.routing"),
    (body(metadata={"routing": {"budget_ceiling": 1}}), "metadata.routing.budget_ceiling"),
    (body(metadata={"routing": {"budget_ceiling_usd": -1}}), "metadata.routing.budget_ceiling_usd"),
    (body(metadata={"routing": {"budget_ceiling_usd": "0.05"}}), "metadata.routing.budget_ceiling_usd"),
    (body(metadata={"routing": {"budget_ceiling_usd": float("nan")}}), "metadata.routing.budget_ceiling_usd"),
    (body(metadata={"routing": {"budget_ceiling_usd": True}}), "metadata.routing.budget_ceiling_usd"),
    (body(metadata={"routing": {"latency_target": "ludicrous"}}), "metadata.routing.latency_target"),
    (body(metadata={"routing": {"certification_level": "gold"}}), "metadata.routing.certification_level"),
    (body(providerOptions=[]), "providerOptions"),
    (body(providerOptions={"gateway": "x"}), "providerOptions.gateway"),
    (body(providerOptions={"gateway": {"only": "openai"}}), "providerOptions.gateway.only"),
    (body(providerOptions={"gateway": {"only": []}}), "providerOptions.gateway.only"),
    (body(providerOptions={"gateway": {"only": ["openai", ""]}}), "providerOptions.gateway.only"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]},
     "messages[0].content[0].image_url"),
]


@pytest.mark.parametrize(("bad", "param"), MALFORMED, ids=[p for _, p in MALFORMED])
def test_malformed_field_is_named(bad: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_requirements(bad)
    err = info.value
    assert err.param == param
    assert err.type == "invalid_request_error"
    assert err.code in {"invalid_value", "invalid_type", "missing_required_parameter", "unknown_parameter"}
    assert http_status(err) == 400
    assert param.split(".")[-1].split("[")[0] in err.message


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (body(max_tokens="10"), "invalid_type"),
        (body(max_tokens=True), "invalid_type"),
        (body(max_completion_tokens=[1]), "invalid_type"),
        (body(max_tokens=0), "invalid_value"),
        (body(max_completion_tokens=-5), "invalid_value"),
        (body(n="2"), "invalid_type"),
        (body(n=0), "invalid_value"),
        (body(n=2.5), "invalid_value"),
        (body(max_tokens=1.5), "invalid_value"),
        (body(max_tokens=10**400), "invalid_value"),  # would overflow float(): a 500 before
        (body(max_completion_tokens=2**53), "invalid_value"),
        (body(metadata={"routing": {"budget_ceiling_usd": 10**400}}), "invalid_value"),
        (body(metadata={"routing": {"budget_ceiling_usd": "0.05"}}), "invalid_type"),
        (body(metadata={"routing": {"budget_ceiling_usd": -1}}), "invalid_value"),
        (body(metadata={"routing": {"budget_ceiling_usd": float("nan")}}), "invalid_value"),
        (body(metadata={"routing": {"latency_target": 3}}), "invalid_type"),
        (body(metadata={"routing": {"latency_target": "ludicrous"}}), "invalid_value"),
        (body(metadata={"routing": {"certification_level": True}}), "invalid_type"),
        (body(metadata={"routing": {"certification_level": "gold"}}), "invalid_value"),
        (body(metadata={"routing": {"budget_ceiling": 1}}), "unknown_parameter"),
        (body(providerOptions={"gateway": {"only": "openai"}}), "invalid_type"),
        (body(providerOptions={"gateway": {"only": []}}), "invalid_value"),
        (body(response_format={"type": 1}), "invalid_type"),
        # unhashable types: a TypeError (a 500) before
        (body(response_format={"type": ["json_object"]}), "invalid_type"),
        (body(response_format={"type": {"json_object": True}}), "invalid_type"),
        (body(response_format={"type": None}), "invalid_type"),
        (body(response_format={"type": True}), "invalid_type"),
        (body(response_format={}), "invalid_type"),
        (body(metadata={"routing": {"latency_target": ["fast"]}}), "invalid_type"),
        (body(metadata={"routing": {"certification_level": {"live": 1}}}), "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": ["image_url"]}]}]},
         "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": {"t": 1}}]}]}, "invalid_type"),
        ({"model": ["m"], "messages": MSG}, "invalid_type"),
        ({"model": "m", "messages": [{"role": ["user"], "content": "x"}]}, "invalid_type"),
        (body(providerOptions={"gateway": {"only": [["openai"]]}}), "invalid_value"),
        (body(providerOptions={"gateway": {"only": {"openai": 1}}}), "invalid_type"),
        (body(response_format={"type": "yaml"}), "invalid_value"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]},
         "invalid_type"),
    ],
)
def test_wrong_type_and_out_of_range_get_distinct_codes(bad: dict[str, Any], code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_requirements(bad)
    assert info.value.code == code


def test_integer_bounds_are_inclusive() -> None:
    assert parse_requirements(body(max_tokens=2**53 - 1)).max_output_tokens == 2**53 - 1
    huge = parse_requirements(body(metadata={"routing": {"budget_ceiling_usd": 2**53 - 1}}))
    assert huge.budget_ceiling_usd == 2**53 - 1


def test_image_url_may_be_an_object_or_the_url_string() -> None:
    for image in ({"url": "https://x/y.png", "detail": "low"}, "https://x/y.png"):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": image}]}]
        assert parse_requirements({"model": "m", "messages": msgs}).vision


def test_non_object_body() -> None:
    with pytest.raises(InvalidRequestError):
        parse_requirements(["model"])  # type: ignore[arg-type]


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda v: body(tools=[{"type": "function", "function": {"name": "f", "parameters": v}}]), "tools"),
        (lambda v: body(functions=[{"name": "f", "parameters": v}]), "functions"),
        (lambda v: body(response_format={"type": "json_schema", "json_schema": v}), "response_format"),
        (lambda v: {"model": "m", "messages": [{"role": "user", "content": "x", "name": v}]},
         "messages[0].name"),
        (lambda v: {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                              "extra": v}]}]},
         "messages[0].content[0]"),
    ],
)
def test_nesting_beyond_the_limit_is_named_not_a_recursion_error(make: Any, param: str) -> None:
    """The estimator walks these fields recursively: 600 levels (json parses ~900) was a RecursionError."""
    parse_requirements(make(_nested(50)))
    for depth in (70, 600, 5000):
        with pytest.raises(InvalidRequestError) as info:
            parse_requirements(make(_nested(depth)))
        assert (info.value.code, info.value.param) == ("invalid_value", param)
        assert "deeper than 64 levels" in info.value.message
