"""No secret in receipts, bodies, headers or logs: neither the client's key nor a provider's credential."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.gateway.service_harness import CLIENT_KEY, PROVIDER_KEY, live
from tests.gateway.upstream import Behavior

USER = [{"role": "user", "content": "hello"}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
SECRETS = (CLIENT_KEY, PROVIDER_KEY, PROVIDER_KEY[8:24])


def test_no_key_in_receipts_errors_headers_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    behaviors = {
        "up-beta-small": Behavior(fail_status=500, echo_credentials=True),
        "up-gamma-claude": Behavior(fail_status=400, echo_credentials=True),
        "up-alpha-large": Behavior(fail_status=400, echo_credentials=True),
    }
    seen: list[str] = []
    with live(behaviors) as lv:
        url = f"{lv.base_url}/chat/completions"
        for body in (
            {"model": "ethen/auto", "messages": USER},
            {
                "model": "ethen/auto",
                "messages": USER,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            {"model": "beta-small", "messages": USER},
            {"model": "gamma-claude", "messages": USER},
            {"model": "alpha-large", "messages": USER, "stream": True},
            {"model": "nope", "messages": USER},
        ):
            r = httpx.post(url, json=body, headers=AUTH, timeout=15)
            seen.append(r.text)
            seen.append(str(r.headers))
        r = httpx.post(
            f"{lv.base_url}/routing/explain", json={"model": "ethen/auto", "messages": USER}, headers=AUTH
        )
        seen.append(r.text)
        seen.append(httpx.get(f"{lv.base_url}/metrics").text)
        # the leaky upstream did echo the credential it received; the gateway masked it
        assert any("[redacted]" in s for s in seen)
        # the provider got its own credential, never the client's key
        sent = [c["headers"] for c in lv.script.calls]
        assert all(CLIENT_KEY not in str(h) for h in sent)
        assert any(h.get("authorization") == f"Bearer {PROVIDER_KEY}" for h in sent)
        assert any(h.get("x-api-key") == PROVIDER_KEY for h in sent)
    seen.extend(rec.getMessage() for rec in caplog.records)
    seen.extend(str(rec.exc_info) for rec in caplog.records if rec.exc_info)
    assert caplog.records, "expected some log output to scan"
    for text in seen:
        for secret in SECRETS:
            assert secret not in text
