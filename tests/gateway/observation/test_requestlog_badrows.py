"""Issue 23 item 2: a row the database cannot hold as given never takes its batch with it.

Postgres ``text`` cannot hold ``\\x00`` (and its JSON cannot hold ``\\u0000``); no UTF-8 column can hold a
lone surrogate (``"\\ud800"`` in a JSON body). Before, one request with ``"model": "m-a\\u0000"`` made the
whole insert batch fail on Postgres: every other client's rows of that batch were lost. Now such text is
stored with U+FFFD in place of the character, and a row that still cannot be stored (here: a token count past
64 bits) is dropped alone and counted in ``ethen_gateway_request_log_rows_dropped_total``. A bad filter of
``GET /api/admin/v1/requests`` (a NUL, a date out of range, a number that is not one) is a 400, not a 503/500.
Real gateway + scripted upstream over HTTP; SQLite and Postgres (skips without ETHEN_TEST_PG_URL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ethen.gateway.config import LogConfig
from ethen.gateway.observation.metrics import GatewayMetrics
from ethen.gateway.observation.requestlog import RequestLog, RequestRecord
from ethen.gateway.providers.base import Usage
from ethen.store import Store
from ethen.store.groupcommit import GroupCommit
from ethen.store.requests import RequestQuery, get_request, list_requests
from tests.gateway.budget_harness import admin, db_url, live_store
from tests.gateway.service_harness import CLIENT_KEY

__all__ = ["db_url"]  # the fixture, re-exported for pytest

USER = [{"role": "user", "content": "hello"}]
FFFD = "\ufffd"


def _wait(fn: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:  # bounded: the deadline
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_nul_model_is_stored_with_the_40_concurrent_rows_of_others(db_url: str) -> None:
    """41 requests at once (one batch): 40 ordinary ones and one whose model holds a NUL (a 404). Every row
    lands; the NUL one with U+FFFD in its place."""
    with live_store(db_url) as lv:
        async def burst() -> list[int]:
            hdr = {"authorization": f"Bearer {CLIENT_KEY}"}
            async with httpx.AsyncClient(base_url=lv.base_url, headers=hdr, timeout=30) as c:
                def one(rid: str, model: str) -> Any:
                    return c.post("/chat/completions", headers={"x-request-id": rid},
                                  json={"model": model, "messages": USER, "max_tokens": 5})
                calls = [one(f"other-{i}", "beta-small") for i in range(40)]
                calls.insert(20, one("nul-1", "m-a\u0000"))
                return [r.status_code for r in await asyncio.gather(*calls)]

        codes = asyncio.run(burst())
        assert codes.count(200) == 40 and codes[20] == 404, codes
        want = {f"other-{i}" for i in range(40)} | {"nul-1"}
        with admin(lv) as a:
            def stored() -> dict[str, Any] | None:
                r = a.get("/requests", params={"limit": 100})
                assert r.status_code == 200, r.text
                rows = {x["request_id"]: x for x in r.json()["data"]}
                return rows if want <= set(rows) else None

            rows = _wait(stored, "all 41 rows")
            assert len(rows) == 41
            nul = rows["nul-1"]
            assert (nul["status"], nul["requested_model"]) == (404, f"m-a{FFFD}"), nul
            assert all(rows[f"other-{i}"]["selected_model"] == "beta-small" for i in range(40))
            # the stored value is found by its stored form
            r = a.get("/requests", params={"model": f"m-a{FFFD}"})
            assert [x["request_id"] for x in r.json()["data"]] == ["nul-1"]
            # nothing was refused or dropped on the way
            metrics = httpx.get(f"{lv.base_url}/metrics").text
            assert "ethen_gateway_request_log_write_errors_total 0.0" in metrics
            assert "ethen_gateway_request_log_rows_dropped_total 0.0" in metrics


BAD_FILTERS: list[tuple[dict[str, str], str]] = [
    ({"model": "\u0000"}, "model"),
    ({"model": "m-a\u0000"}, "model"),
    ({"project": "acme\u0000"}, "project"),
    ({"status": "\u0000"}, "status"),
    ({"since": "2026-01-01\u0000"}, "since"),
    ({"until": "\u0000"}, "until"),
    ({"since": "0001-01-01T00:00:00+05:00"}, "since"),  # before year 1 in UTC
    ({"until": "9999-12-31T23:59:59-05:00"}, "until"),  # after year 9999 in UTC
    ({"limit": "\u00b2"}, "limit"),  # a digit to str.isdigit, not to int()
    ({"limit": "9" * 5000}, "limit"),  # past int()'s digit limit
    ({"cursor": "\u00b9"}, "cursor"),
    ({"cursor": "9" * 30}, "cursor"),
    ({"cursor": "\u0000"}, "cursor"),
]


def test_a_bad_filter_is_a_400_naming_it(db_url: str) -> None:
    with live_store(db_url) as lv, admin(lv) as a:
        assert a.get("/requests", params={"model": "beta-small"}).status_code == 200
        for params, name in BAD_FILTERS:
            r = a.get("/requests", params=params)
            assert r.status_code == 400, (params, r.status_code, r.text)
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value",
                                                                name), (params, err)
        # the raw percent-encoded form of the issue
        r = httpx.get(f"{lv.gateway.url}/api/admin/v1/requests?model=%00", headers=a.headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def _record(rid: str, **kw: Any) -> RequestRecord:
    return RequestRecord(time.time(), rid, "chat", False, 200, "ok", 0.02, **kw)


NASTY = "a\u0000b\ud800c"  # a NUL and a lone surrogate (json.loads makes one of "\ud800")


@pytest.mark.parametrize("through", ["ledger writer", "store"])
def test_every_text_field_is_stored_and_an_unstorable_row_is_dropped_alone(db_url: str, through: str) -> None:
    """NULs and lone surrogates in every text field (the plain columns, the attempts, the receipt's keys and
    values) are stored as U+FFFD; a backslash followed by ``u0000`` is text, kept as it is; a row whose token
    count no integer column holds is refused by the database: dropped alone (bisecting the batch), counted,
    and the 40 rows around it land."""

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any] | None, float, float, int]:
        st = await Store.open(db_url)
        gc = GroupCommit(st, "test-instance", lambda b: None, lambda b: None)
        gc.start()
        try:
            m = GatewayMetrics()
            rl = RequestLog(LogConfig(), m)
            rl.store = lambda: st
            if through == "ledger writer":
                rl.write = lambda: gc.transaction
            for i in range(40):
                rl.record(_record(f"ok-{i}", requested_model="beta-small"))
                if i == 13:
                    rl.record(_record("nasty", project=f"p{NASTY}", key_id=f"k{NASTY}",
                                      requested_model=f"m{NASTY}", error_code=f"e{NASTY}",
                                      attempts=[{"candidate": f"pr{NASTY}/mo{NASTY}", "outcome": f"o{NASTY}",
                                                 "note": NASTY, f"key{NASTY}": 1}],
                                      receipt={"selected_model": NASTY, f"k{NASTY}": [NASTY, {NASTY: NASTY}],
                                               "literal": "\\u0000 stays", "emoji": "\U0001f600"}))
                if i == 27:
                    rl.record(_record("too-big", usage=Usage(2**70, 1)))
            await rl.flush()
            rows = await list_requests(st, RequestQuery(limit=100))
            nasty = await get_request(st, "nasty")
            dropped = m.registry.get_sample_value("ethen_gateway_request_log_rows_dropped_total")
            errors = m.log_write_errors._value.get()
            return rows, nasty, dropped or 0.0, errors, rl.written
        finally:
            await gc.aclose()
            await st.aclose()

    rows, nasty, dropped, errors, written = asyncio.run(main())
    ids = [r["request_id"] for r in rows]
    assert sorted(ids) == sorted([f"ok-{i}" for i in range(40)] + ["nasty"]), ids
    assert dropped == 1 and errors == 0 and written == 42
    clean = f"a{FFFD}b{FFFD}c"
    assert nasty is not None
    assert (nasty["project"], nasty["key_id"], nasty["requested_model"], nasty["error_code"]) == (
        f"p{clean}", f"k{clean}", f"m{clean}", f"e{clean}")
    assert nasty["attempts"] == [{"candidate": f"pr{clean}/mo{clean}", "outcome": f"o{clean}", "note": clean,
                                  f"key{clean}": 1, "provider": f"pr{clean}", "model": f"mo{clean}",
                                  "status": None}]
    assert nasty["receipt"] == {"selected_model": clean, f"k{clean}": [clean, {clean: clean}],
                                "literal": "\\u0000 stays", "emoji": "\U0001f600"}
