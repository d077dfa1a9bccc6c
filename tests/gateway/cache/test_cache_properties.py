"""The response cache's pure core (issue 27): key, verdict, ``Cache-Control``, entries, the memory LRU;
hypothesis properties against brute-force oracles."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.cache import (
    IGNORED,
    CachePolicy,
    MemoryBackend,
    cache_key,
    decode,
    deterministic,
    directive,
    encode_body,
    encode_stream,
    verdict,
)

_leaf = (st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2, allow_nan=False)
         | st.text(max_size=5))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)
_field = st.sampled_from(["model", "messages", "tools", "temperature", "seed", "max_tokens", "top_p", "stop",
                          "response_format", "n", "stream", "tool_choice", "user", "metadata",
                          "stream_options", "logprobs"])
_body = st.dictionaries(_field, _json, max_size=8)


def _shuffled(obj: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rnd) for v in obj]
    return obj


def _oracle_key(scope: str, endpoint: str, body: dict[str, Any]) -> str:
    """Brute force: sort every object's keys by hand, then serialize."""
    def norm(o: Any) -> Any:
        if isinstance(o, dict):
            return [[k, norm(o[k])] for k in sorted(o)]
        if isinstance(o, list):
            return ["L", [norm(v) for v in o]]
        return ["V", json.dumps(o)]
    kept = {k: v for k, v in body.items() if k not in IGNORED}
    return json.dumps([scope, endpoint, norm(kept)])


@settings(max_examples=300, deadline=None)
@given(_body, st.randoms(use_true_random=False))
def test_key_is_invariant_under_key_order(body: dict[str, Any], rnd: random.Random) -> None:
    assert cache_key("p", "chat", body) == cache_key("p", "chat", _shuffled(body, rnd))


@settings(max_examples=300, deadline=None)
@given(_body, _body, st.sampled_from(["project:a", "project:b", "config:test"]),
       st.sampled_from(["project:a", "config:test"]), st.sampled_from(["chat", "responses"]),
       st.sampled_from(["chat", "messages"]))
def test_keys_equal_exactly_when_the_oracle_says_so(b1: dict[str, Any], b2: dict[str, Any], s1: str, s2: str,
                                                    e1: str, e2: str) -> None:
    same = _oracle_key(s1, e1, b1) == _oracle_key(s2, e2, b2)
    assert (cache_key(s1, e1, b1) == cache_key(s2, e2, b2)) == same


@settings(max_examples=200, deadline=None)
@given(_body, _field, _json)
def test_any_answer_changing_field_changes_the_key(body: dict[str, Any], field: str, value: Any) -> None:
    changed = {**body, field: value}
    differs = json.dumps(changed.get(field), sort_keys=True) != json.dumps(body.get(field), sort_keys=True) \
        or (field in changed) != (field in body)
    if field in IGNORED:
        assert cache_key("p", "chat", changed) == cache_key("p", "chat", body)
    elif differs:
        assert cache_key("p", "chat", changed) != cache_key("p", "chat", body)


def test_key_is_sha256_hex_and_handles_lone_surrogates() -> None:
    k = cache_key("p", "chat", {"messages": [{"content": "\ud800"}]})
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == hashlib.sha256(json.dumps(["p", "chat", {"messages": [{"content": "\ud800"}]}],
                                          separators=(",", ":"), ensure_ascii=False)
                               .encode("utf-8", "surrogatepass")).hexdigest()


_temps = st.none() | st.just(0) | st.just(0.0) | st.just(False) | st.floats(0, 2) | st.text(max_size=2)
_seeds = st.none() | st.integers(-3, 3) | st.booleans() | st.floats(0, 2) | st.text(max_size=2)


def _oracle_deterministic(t: Any, s: Any) -> bool:
    return (type(t) in (int, float) and t == 0) or type(s) is int


@settings(max_examples=300, deadline=None)
@given(_temps, _seeds, st.sampled_from([None, "no-cache", "no-store"]), st.booleans(),
       st.sampled_from([None, ("ethen/fast",), ("beta-small", "ethen/fast"), ()]),
       st.sampled_from(["ethen/fast", "beta-small", "other", 3]))
def test_verdict_against_oracle(t: Any, s: Any, d: str | None, widen: bool, listed: tuple[str, ...] | None,
                                model: Any) -> None:
    body: dict[str, Any] = {"model": model}
    if t is not None:
        body["temperature"] = t
    if s is not None:
        body["seed"] = s
    policy = CachePolicy(True, widen, frozenset(listed) if listed is not None else None)
    opted = listed is None or model in listed
    det = _oracle_deterministic(t, s)
    assert deterministic(body) == det
    if d == "no-store":
        want: tuple[bool, bool, str | None] = (False, False, "no-store")
    elif not opted:
        want = (False, False, "not_opted_in")
    elif not (det or widen):
        want = (False, False, "nondeterministic")
    elif d == "no-cache":
        want = (False, True, "no-cache")
    else:
        want = (True, True, None)
    assert verdict(policy, body, d) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["no-cache", "No-Store", "max-age=0", "private", " no-cache ", "x=1",
                                 "no-cache=\"a\""]), max_size=4),
       st.none() | st.sampled_from(["no-cache", "x"]))
def test_directive_against_oracle(parts: list[str], pragma: str | None) -> None:
    header = ",".join(parts) if parts else None
    names = [p.partition("=")[0].strip().lower() for p in parts]
    if header is None:
        want = "no-cache" if pragma == "no-cache" else None
    elif "no-store" in names:
        want = "no-store"
    else:
        want = "no-cache" if "no-cache" in names else None
    assert directive(header, pragma) == want


def test_policy_lists() -> None:
    assert CachePolicy.of(True, False, None, None).models is None
    assert CachePolicy.of(True, False, ["ethen/fast"], None).models == frozenset({"ethen/fast"})
    assert CachePolicy.of(True, False, None, ["a", "p/b"]).models == frozenset({"a", "p/b"})


@given(st.floats(0, 2e9), st.text(min_size=1, max_size=10),
       st.lists(st.binary(max_size=20).filter(lambda b: b"\n" not in b), min_size=1, max_size=5))
def test_entries_round_trip(at: float, cand: str, chunks: list[bytes]) -> None:
    e = decode(encode_body(at, cand, b'{"a":1}'))
    assert e is not None and not e.stream and e.body == b'{"a":1}' and e.candidate == cand
    assert abs(e.at - at) <= 0.001
    raw = encode_stream(at, cand, chunks)
    assert raw is not None
    s = decode(raw)
    assert s is not None and s.stream and list(s.chunks) == chunks
    assert encode_stream(at, cand, [b"a\nb"]) is None and encode_stream(at, cand, []) is None
    assert decode(b"garbage") is None and decode(b'{"v":2}\n{}') is None


_ops = st.lists(st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 5), st.floats(0, 3)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(1, 4), st.floats(0.1, 2))
def test_memory_lru_against_oracle(ops: list[tuple[str, int, float]], cap: int, ttl: float) -> None:
    """Brute force: a list of (key, stored at, value) in use order; expired entries vanish when read."""
    lru = MemoryBackend(cap, ttl)
    model: list[tuple[str, float, bytes]] = []
    now = 0.0
    for i, (op, k, dt) in enumerate(ops):
        now += dt
        key = f"k{k}"
        if op == "put":
            value = f"v{i}".encode()
            model = [m for m in model if m[0] != key] + [(key, now, value)]
            lru.put(key, value, now)
            model = model[-cap:]
        else:
            hit = next((m for m in model if m[0] == key), None)
            want = None
            if hit is not None:
                model.remove(hit)
                if hit[1] + ttl > now:
                    model.append(hit)
                    want = hit[2]
            assert lru.lookup(key, now) == want
        assert lru.entries == len(model)
        assert lru.size == sum(len(m[2]) for m in model)


@settings(max_examples=200, deadline=None)
@given(_body, _body, _body, st.randoms(use_true_random=False))
def test_client_body_is_part_of_the_key(payload: dict[str, Any], c1: dict[str, Any], c2: dict[str, Any],
                                        rnd: random.Random) -> None:
    """A translated request's key covers the client's own body too (a native provider sends it as is)."""
    k1 = cache_key("p", "messages", payload, {"body": c1})
    assert k1 == cache_key("p", "messages", _shuffled(payload, rnd), {"body": _shuffled(c1, rnd)})
    assert k1 != cache_key("p", "messages", payload)
    if json.dumps(c1, sort_keys=True) != json.dumps(c2, sort_keys=True):
        assert k1 != cache_key("p", "messages", payload, {"body": c2})
