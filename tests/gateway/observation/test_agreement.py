"""Agreement of a shadow pair (issue 27, ``ethen.gateway.observation.agreement``): properties against
brute-force oracles and examples."""

from __future__ import annotations

import difflib
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.observation.agreement import (
    Answer,
    ToolCall,
    agreement,
    answer_of_chunks,
    answer_of_completion,
    normalize,
    schema_of,
    schema_valid,
    similarity,
    tool_calls_equal,
)

texts = st.text(alphabet=st.sampled_from(list("abAB \t\nxyZ.é")), max_size=60)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                                       inner, max_size=3),
                           max_leaves=8)


def oracle_normalize(s: str) -> str:
    words: list[str] = []
    cur = ""
    for ch in s.casefold():
        if ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        words.append(cur)
    return " ".join(words)


@settings(max_examples=300, deadline=None)
@given(texts, texts)
def test_similarity_is_the_difflib_ratio_of_the_normalized_texts(a: str, b: str) -> None:
    na, nb = oracle_normalize(a), oracle_normalize(b)
    want = 1.0 if na == nb else difflib.SequenceMatcher(None, na, nb).ratio()
    assert normalize(a) == na
    assert similarity(a, b) == want and 0.0 <= want <= 1.0
    assert similarity(a, a) == 1.0
    assert similarity(a, a.upper().replace(" ", "  \n")) == 1.0 or a.upper().casefold() != a.casefold()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f", "g"]), st.dictionaries(st.text(max_size=3), json_values,
                                                                       max_size=3)), max_size=3),
       st.randoms(use_true_random=False))
def test_tool_calls_compare_arguments_as_parsed_json(calls: list[tuple[str, dict[str, Any]]],
                                                     rnd: Any) -> None:
    a = tuple(ToolCall(n, json.dumps(args)) for n, args in calls)
    shuffled = []
    for n, args in calls:  # the same objects, keys in another order and other spacing
        items = list(args.items())
        rnd.shuffle(items)
        shuffled.append(ToolCall(n, json.dumps(dict(items), indent=rnd.choice([None, 2]))))
    b = tuple(shuffled)
    assert tool_calls_equal(a, b) is (None if not calls else True)
    if calls:
        other = (ToolCall(calls[0][0] + "x", a[0].arguments), *a[1:])
        assert tool_calls_equal(a, other) is False
        assert tool_calls_equal(a, a[:-1]) is False


def test_answers_of_completion_and_stream_agree() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]}}]}
    chunks = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" there","tool_calls":[{"index":0,'
        b'"function":{"name":"get","arguments":"{\\"a\\""}}]}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":": 1}"}}]}}]}'
        b'\n\ndata: {"choices":[],"usage":{"prompt_tokens":1}}\n\n',
        b"data: [DONE]\n\n",
    ]
    a, b = answer_of_completion(body), answer_of_chunks(chunks)
    assert a == b == Answer("Hi there", (ToolCall("get", '{"a": 1}'),))
    ag = agreement(a, b, None)
    assert ag.exact and ag.similarity == 1.0 and ag.tool_calls_equal is True and ag.schema_valid is None
    assert answer_of_completion({}) == Answer("")
    payloads = [c.removeprefix(b"data: ").split(b"\n\n")[0] for c in chunks]  # as a provider stream yields
    assert answer_of_chunks(payloads) == a


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_schema_valid_matches_a_hand_written_check(doc: Any) -> None:
    n = doc.get("n") if isinstance(doc, dict) else None
    want = isinstance(n, int) and not isinstance(n, bool)
    assert schema_valid(json.dumps(doc), SCHEMA) is want
    assert schema_valid(json.dumps(doc), None) is None


def test_schema_examples() -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    assert schema_of(body) == SCHEMA
    assert schema_of({"response_format": {"type": "json_object"}}) is None and schema_of({}) is None
    assert schema_valid("not json", SCHEMA) is False
    assert schema_valid('{"n": 3}', {"type": "nonsense-type"}) is False  # an invalid schema validates nothing
    ag = agreement(Answer('{"n": 1}'), Answer('{"n": "one"}'), SCHEMA)
    assert ag.primary_schema_valid is True and ag.schema_valid is False and not ag.exact
    assert 0 < ag.similarity < 1


@settings(max_examples=200, deadline=None)
@given(texts, texts)
def test_exact_means_equal_text_and_tools(a: str, b: str) -> None:
    ag = agreement(Answer(a), Answer(b), None)
    assert ag.exact == (a == b) and ag.tool_calls_equal is None
    assert agreement(Answer(a, (ToolCall("f", "{}"),)), Answer(a), None).exact is False
