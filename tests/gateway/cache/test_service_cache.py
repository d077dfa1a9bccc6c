"""The response cache (issue 27) over real HTTP: a live gateway with ``[cache]`` in front of a scripted
upstream that counts its calls (``tests/gateway/upstream.py``), on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.budget_harness import admin, live_store, new_project_key, with_store
from tests.gateway.service_harness import CLIENT_KEY, ENV, Live, config_dict, live
from tests.gateway.upstream import Behavior

MSG = [{"role": "user", "content": "What is 2 + 2?"}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


def cache(**kw: Any) -> dict[str, Any]:
    return {"enabled": True, **kw}


def post(lv: Live, body: dict[str, Any], headers: dict[str, str] | None = None, key: str = CLIENT_KEY,
         path: str = "/chat/completions") -> httpx.Response:
    h = {"authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(f"{lv.base_url}{path}", json=body, headers=h, timeout=15)


def chat(model: str = "beta-small", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSG, "temperature": 0, **kw}


def calls(lv: Live) -> int:
    return len(lv.script.calls)


def metric(lv: Live, name: str) -> float:
    text = httpx.get(f"{lv.base_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


@pytest.fixture
def lv() -> Iterator[Live]:
    with live(cache=cache()) as x:
        yield x


def test_miss_then_hit_calls_upstream_once_headers_receipt_metrics(lv: Live) -> None:
    r1 = post(lv, chat())
    assert r1.status_code == 200, r1.text
    assert r1.headers["x-ethen-cache"] == "miss"
    assert r1.json()["ethen"]["routing"]["cache"] == {"hit": False, "age_s": None, "status": "miss"}
    lv.script.default.pieces = ("changed",)  # the upstream would answer differently now
    time.sleep(0.05)
    r2 = post(lv, chat())
    assert r2.status_code == 200, r2.text
    assert calls(lv) == 1  # the second answer came from the cache
    assert r2.headers["x-ethen-cache"] == "hit"
    a, b = r1.json(), r2.json()
    assert b["choices"] == a["choices"] and b["id"] == a["id"]
    assert b["choices"][0]["message"]["content"] == "Hello from upstream"
    receipt = b["ethen"]["routing"]
    assert receipt["cache"]["hit"] is True and receipt["cache"]["status"] == "hit"
    assert 0.0 <= receipt["cache"]["age_s"] < 5.0
    assert receipt["attempts"] == [] and receipt["served_model"] == "beta-small"
    assert receipt["cost"]["total_usd"] == 0.0 and receipt["cost"]["source"] == "cache"  # a hit costs nothing
    assert float(r2.headers["x-ethen-overhead-ms"]) >= 0
    assert metric(lv, "ethen_gateway_cache_hits_total") == 1
    assert metric(lv, "ethen_gateway_cache_misses_total") == 1
    assert metric(lv, "ethen_gateway_cache_entries") == 1
    assert metric(lv, "ethen_gateway_cache_bytes") > 100
    # logged as a hit: the request log's row has the receipt's cache, no attempt, no tokens, cost 0
    ring = lv.gateway.server.config.app.state.gateway.requestlog.ring  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while len(ring) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    row = next(r for r in ring if r["request_id"] == r2.headers["x-request-id"])
    assert row["outcome"] == "ok" and row["receipt"]["cache"]["hit"] is True
    assert row["attempts"] == [] and row["cost_nano"] == 0 and row["prompt_tokens"] is None
    assert row["receipt"]["cost"]["total_usd"] == 0.0


def test_every_answer_changing_field_is_its_own_entry(lv: Live) -> None:
    post(lv, chat())
    for variant in (chat(max_tokens=5), chat(messages=[{"role": "user", "content": "other"}]),
                    chat(model="beta-tools"), chat(seed=1), chat(stop=["x"])):
        r = post(lv, variant)
        assert r.headers["x-ethen-cache"] == "miss", variant
    n = calls(lv)
    r = post(lv, chat(user="someone-else", metadata={"tag": "x"}))  # fields that change nothing: same entry
    assert r.headers["x-ethen-cache"] == "hit" and calls(lv) == n


def test_nondeterministic_requests_bypass_unless_widened() -> None:
    body = {"model": "beta-small", "messages": MSG, "temperature": 0.7}
    with live(cache=cache()) as lv:
        for _ in range(2):
            r = post(lv, body)
            assert r.headers["x-ethen-cache"] == "bypass"
            assert r.json()["ethen"]["routing"]["cache"]["reason"] == "nondeterministic"
        assert calls(lv) == 2
        r = post(lv, {**body, "seed": 7})  # a seed makes it deterministic
        assert r.headers["x-ethen-cache"] == "miss"
        assert post(lv, {**body, "seed": 7}).headers["x-ethen-cache"] == "hit"
    with live(cache=cache(cache_nondeterministic=True)) as lv:
        assert post(lv, body).headers["x-ethen-cache"] == "miss"
        assert post(lv, body).headers["x-ethen-cache"] == "hit"
        assert calls(lv) == 1


def test_no_cache_refreshes_and_no_store_bypasses(lv: Live) -> None:
    assert post(lv, chat()).headers["x-ethen-cache"] == "miss"
    lv.script.default.pieces = ("fresh",)
    r = post(lv, chat(), {"cache-control": "no-store"})  # neither read nor written
    assert r.headers["x-ethen-cache"] == "bypass"
    assert r.json()["ethen"]["routing"]["cache"]["reason"] == "no-store"
    assert r.json()["choices"][0]["message"]["content"] == "fresh"
    r = post(lv, chat())
    assert r.headers["x-ethen-cache"] == "hit"
    assert r.json()["choices"][0]["message"]["content"] == "Hello from upstream"  # no-store wrote nothing
    r = post(lv, chat(), {"Cache-Control": "max-age=0, No-Cache"})  # not read, but the entry is refreshed
    assert r.headers["x-ethen-cache"] == "bypass"
    assert r.json()["choices"][0]["message"]["content"] == "fresh"
    r = post(lv, chat())
    assert r.headers["x-ethen-cache"] == "hit" and r.json()["choices"][0]["message"]["content"] == "fresh"
    assert calls(lv) == 3


def test_cache_control_sent_as_several_field_lines_is_one_list(lv: Live) -> None:
    """RFC 9110 5.3: two ``Cache-Control`` lines are one list; a ``no-store`` / ``no-cache`` in the second
    line counts (sweep27: only the first line was read, so this was a hit)."""
    assert post(lv, chat()).headers["x-ethen-cache"] == "miss"
    lines = [("authorization", f"Bearer {CLIENT_KEY}"), ("cache-control", "max-age=5"),
             ("cache-control", "no-store")]
    r = httpx.post(f"{lv.base_url}/chat/completions", json=chat(), headers=lines, timeout=15)
    assert r.headers["x-ethen-cache"] == "bypass"
    assert r.json()["ethen"]["routing"]["cache"]["reason"] == "no-store"
    lines = [("authorization", f"Bearer {CLIENT_KEY}"), ("pragma", "x"), ("pragma", "no-cache")]
    r = httpx.post(f"{lv.base_url}/chat/completions", json=chat(), headers=lines, timeout=15)
    assert r.json()["ethen"]["routing"]["cache"]["reason"] == "no-cache"
    assert calls(lv) == 3


def test_ttl_expiry() -> None:
    with live(cache=cache(ttl_s=0.4)) as lv:
        assert post(lv, chat()).headers["x-ethen-cache"] == "miss"
        assert post(lv, chat()).headers["x-ethen-cache"] == "hit"
        time.sleep(0.6)
        assert post(lv, chat()).headers["x-ethen-cache"] == "miss"
        assert calls(lv) == 2


def test_max_entries_evicts_least_recently_used() -> None:
    with live(cache=cache(max_entries=2)) as lv:
        a, b, c = (chat(messages=[{"role": "user", "content": s}]) for s in "abc")
        post(lv, a)
        post(lv, b)
        assert post(lv, a).headers["x-ethen-cache"] == "hit"  # a is now the most recently used
        post(lv, c)  # evicts b
        assert metric(lv, "ethen_gateway_cache_entries") == 2
        assert post(lv, a).headers["x-ethen-cache"] == "hit"
        assert post(lv, c).headers["x-ethen-cache"] == "hit"
        assert post(lv, b).headers["x-ethen-cache"] == "miss"


def test_opt_in_by_alias_or_route() -> None:
    with live(cache=cache(aliases=["ethen/fast"], routes=["beta-tools"])) as lv:
        for model in ("ethen/fast", "beta-tools"):
            assert post(lv, chat(model)).headers["x-ethen-cache"] == "miss"
            assert post(lv, chat(model)).headers["x-ethen-cache"] == "hit"
        r = post(lv, chat("beta-small"))
        assert r.headers["x-ethen-cache"] == "bypass"
        assert r.json()["ethen"]["routing"]["cache"]["reason"] == "not_opted_in"


def test_disabled_cache_says_nothing() -> None:
    with live() as lv:
        r = post(lv, chat())
        assert "x-ethen-cache" not in r.headers and "cache" not in r.json()["ethen"]["routing"]
        post(lv, chat())
        assert calls(lv) == 2


def _sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def test_stream_hit_is_a_valid_stream_for_the_openai_sdk(lv: Live) -> None:
    client = lv.client()
    kw: dict[str, Any] = {"model": "beta-small", "messages": MSG, "temperature": 0, "stream": True}
    live_chunks = list(client.chat.completions.create(**kw))
    assert calls(lv) == 1
    raw = client.chat.completions.with_raw_response.create(**kw)
    assert raw.headers["x-ethen-cache"] == "hit"
    replayed = list(raw.parse())
    assert calls(lv) == 1  # replayed from the cache
    text = "".join(c.choices[0].delta.content or "" for c in replayed if c.choices)
    assert text == "Hello from upstream"
    assert [c.model_dump(exclude={"ethen"}) for c in replayed[:-1]] == [
        c.model_dump(exclude={"ethen"}) for c in live_chunks[:-1]]
    receipt = replayed[-1].model_extra["ethen"]["routing"]  # type: ignore[index]
    assert receipt["cache"]["hit"] is True and receipt["attempts"] == []
    # on the wire: chat.completion.chunk objects, the receipt chunk, then [DONE]
    wire = post(lv, {**kw, "stream_options": {"include_usage": True}})
    assert wire.headers["x-ethen-cache"] == "hit"  # include_usage changes nothing stored: same entry
    events = _sse_events(wire.text)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["ethen"]["routing"]["cache"]["hit"] is True and objs[-1]["usage"] is None
    assert objs[-1]["ethen"]["routing"]["cache"]["age_s"] >= 0
    assert objs[-1]["ethen"]["routing"]["cost"]["total_usd"] == 0.0  # a stream hit costs nothing too
    assert calls(lv) == 1


def test_a_stream_cut_midway_is_not_stored() -> None:
    with live({"up-beta-small": Behavior(cut_after=1)}, cache=cache()) as lv:
        body = {**chat(), "stream": True}
        r = post(lv, body)
        assert "event: error" in r.text
        lv.script.behaviors["up-beta-small"].cut_after = None
        assert post(lv, body).headers["x-ethen-cache"] == "miss"
        assert post(lv, body).headers["x-ethen-cache"] == "hit"


def test_responses_and_messages_hits(lv: Live) -> None:
    body = {"model": "beta-small", "input": "What is 2 + 2?", "temperature": 0}
    r1 = post(lv, body, path="/responses")
    r2 = post(lv, body, path="/responses")
    assert (r1.headers["x-ethen-cache"], r2.headers["x-ethen-cache"]) == ("miss", "hit")
    assert r2.json()["output"][0]["content"][0]["text"] == "Hello from upstream"
    stream = post(lv, {**body, "stream": True}, path="/responses")
    again = post(lv, {**body, "stream": True}, path="/responses")
    assert (stream.headers["x-ethen-cache"], again.headers["x-ethen-cache"]) == ("miss", "hit")
    assert "response.completed" in again.text
    m = {"model": "beta-small", "max_tokens": 50, "temperature": 0, "messages": MSG}
    h = {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"}
    m1 = httpx.post(f"{lv.base_url}/messages", json=m, headers=h, timeout=15)
    m2 = httpx.post(f"{lv.base_url}/messages", json=m, headers=h, timeout=15)
    assert (m1.headers["x-ethen-cache"], m2.headers["x-ethen-cache"]) == ("miss", "hit")
    assert m2.json()["content"] == m1.json()["content"]
    assert calls(lv) == 3


def test_projects_are_isolated_and_a_hit_costs_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gw.db'}"
    with live_store(url, cache=cache()) as lv:
        a = new_project_key(lv, "a", budget_usd=1.0)
        b = new_project_key(lv, "b", budget_usd=1.0)
        assert post(lv, chat(), key=a).headers["x-ethen-cache"] == "miss"
        for _ in range(3):
            assert post(lv, chat(), key=a).headers["x-ethen-cache"] == "hit"
        assert post(lv, {**chat(), "stream": True}, key=a).headers["x-ethen-cache"] == "miss"
        assert post(lv, {**chat(), "stream": True}, key=a).headers["x-ethen-cache"] == "hit"
        assert post(lv, chat(), key=b).headers["x-ethen-cache"] == "miss"  # b never sees a's entry
        assert post(lv, chat(), key=CLIENT_KEY).headers["x-ethen-cache"] == "miss"  # nor a config key
        assert calls(lv) == 4

        async def spent(st: Any) -> tuple[float, int]:
            p = await st.get_project("a")
            rows = await st.usage(project="a")
            return (await st.spend(p)).settled_usd, sum(u.requests for u in rows)

        # the request log API (GET /api/admin/v1/requests): the hits cost 0, the misses their price
        deadline, rows = time.monotonic() + 5, []
        while len(rows) < 6 and time.monotonic() < deadline:
            rows = admin(lv).get("/requests", params={"project": "a"}).json()["data"]
            time.sleep(0.05)
        assert sorted(r["cost_usd"] for r in rows) == [0.0] * 4 + [pytest.approx(8.5e-7)] * 2
        settled, requests = with_store(url, spent)
        # only the two misses reached the ledger: 11 prompt + 3 completion tokens each at beta-small's prices
        assert requests == 2
        assert settled == pytest.approx(2 * (11 * 0.05 + 3 * 0.1) / 1e6, rel=1e-6)


def _cfg(**cache_: Any) -> dict[str, Any]:
    return config_dict("http://127.0.0.1:9", cache=cache_)


@pytest.mark.parametrize(("section", "message"), [
    ({"enabled": True, "backend": "redis"}, "cache.backend = 'redis': needs a [shared] section"),
    ({"backend": "disk"}, "cache.backend = 'disk'"),
    ({"ttl_s": 0}, "cache.ttl_s = 0"),
    ({"max_entries": 0}, "cache.max_entries = 0"),
    ({"aliases": ["ethen/nope"]}, "cache.aliases[0] = 'ethen/nope': unknown alias"),
    ({"routes": ["beta-small", "nope/x"]}, "cache.routes[1] = 'nope/x': no chat route"),
    ({"ttl": 5}, "cache.ttl"),
])
def test_config_errors_name_key_and_value(section: dict[str, Any], message: str) -> None:
    with pytest.raises(GatewayConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(_cfg(**section))


def test_config_defaults() -> None:
    cc = parse_config(config_dict("http://127.0.0.1:9")).cache
    assert (cc.enabled, cc.ttl_s, cc.max_entries, cc.backend, cc.cache_nondeterministic) == (
        False, 300.0, 10_000, "memory", False)
    assert ENV  # the harness' env is what the live tests run with


def test_native_anthropic_messages_are_replayed_as_they_came(lv: Live) -> None:
    """``/messages`` to a ``kind = "anthropic"`` route passes the client's body and ``anthropic-beta``
    through: both are in the key, and a hit replays the upstream's own Message / events."""
    m = {"model": "gamma-claude", "max_tokens": 50, "temperature": 0, "messages": MSG}
    h = {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"}

    def send(body: dict[str, Any], **extra: str) -> httpx.Response:
        r = httpx.post(f"{lv.base_url}/messages", json=body, headers={**h, **extra}, timeout=15)
        assert r.status_code == 200, r.text
        return r

    first, hit = send(m), send(m)
    assert (first.headers["x-ethen-cache"], hit.headers["x-ethen-cache"]) == ("miss", "hit")
    assert hit.json()["id"] == first.json()["id"] == "msg_1"  # the upstream's Message (a translation: new id)
    assert hit.json()["content"] == first.json()["content"]
    assert hit.json()["ethen"]["routing"]["cache"]["hit"] is True
    assert send({**m, "top_k": 3}).headers["x-ethen-cache"] == "miss"  # native-only field: its own entry
    assert send(m, **{"anthropic-beta": "x-2025"}).headers["x-ethen-cache"] == "miss"
    s1, s2 = send({**m, "stream": True}), send({**m, "stream": True})
    assert (s1.headers["x-ethen-cache"], s2.headers["x-ethen-cache"]) == ("miss", "hit")
    kinds = [line[7:] for line in s2.text.split("\n") if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert kinds == [line[7:] for line in s1.text.split("\n") if line.startswith("event: ")]
    assert calls(lv) == 4


def test_legacy_completions_hit(lv: Live) -> None:
    body = {"model": "beta-small", "prompt": "2 + 2 =", "temperature": 0}
    r1, r2 = post(lv, body, path="/completions"), post(lv, body, path="/completions")
    assert (r1.headers["x-ethen-cache"], r2.headers["x-ethen-cache"]) == ("miss", "hit")
    assert r2.json()["choices"][0]["text"] == r1.json()["choices"][0]["text"] == "Hello from upstream"
    assert calls(lv) == 1
