"""Issue 44 through the real gateway on loopback: a provider whose rate-limit headers say it is out of
requests has a predicted wait beyond the ``[[wait_targets]]`` of ``ethen/cheap``, so the next request spills
to another provider, with ``spillover`` on the receipt and ``ethen_gateway_spillover_total`` counted; the
scripted upstream (real HTTP) sends the headers. Anthropic's ``anthropic-ratelimit-*`` headers block a
provider the same way."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tests.gateway.service_harness import live
from tests.gateway.upstream import Behavior

MSG = [{"role": "user", "content": "hello"}]
TARGETS = [{"alias": "ethen/cheap", "max_wait_ms": 1000}]


def _routing(resp: Any) -> dict[str, Any]:
    return resp.model_extra["ethen"]["routing"]  # type: ignore[no-any-return]


def _metric(base: str, pattern: str, timeout_s: float = 5.0) -> str:
    """The value of the first series matching ``pattern`` (the request log counts off the request path)."""
    end = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        m = re.search(pattern, text, re.M)
        if m or time.monotonic() > end:
            assert m, text
            return m.group(1)
        time.sleep(0.05)


def test_a_rate_limited_provider_spills_to_the_next_within_the_wait_target() -> None:
    limited = Behavior(headers={"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "30s"})
    with live({"up-beta-small": limited}, wait_targets=TARGETS) as lv:
        client = lv.client()
        first = _routing(client.chat.completions.create(model="ethen/cheap", messages=MSG))  # type: ignore
        assert first["served_provider"] == "beta" and first["served_model"] == "beta-small"
        assert "spillover" not in first
        assert first["predicted_wait_ms"] > 0
        second = _routing(client.chat.completions.create(model="ethen/cheap", messages=MSG))  # type: ignore
        assert second["served_provider"] != "beta"
        spill = second["spillover"]
        assert spill["from"] == "beta" and spill["reason"] == "predicted_wait_exceeds_target"
        assert spill["target_ms"] == 1000 and 20_000 < spill["predicted_wait_ms"] <= 31_000
        rejected = {r["candidate"]: r["reasons"] for r in second["rejected"]}
        assert "predicted_wait_exceeds_target" in rejected["beta/beta-small"]
        assert second["predicted_wait_ms"] < 1000
        to = second["served_provider"]
        series = rf'^ethen_gateway_spillover_total\{{from="beta",to="{to}"\}} (\S+)$'
        assert _metric(lv.base_url, series) == "1.0"
        assert float(_metric(lv.base_url, r"^ethen_gateway_predicted_wait_seconds_count (\S+)$")) >= 1
        # a request that asks for a looser target than the config's gets the config's (it only tightens)
        loose = client.chat.completions.create(  # type: ignore[call-overload]
            model="ethen/cheap", messages=MSG, metadata=None,
            extra_body={"metadata": {"routing": {"max_wait_ms": 100_000}}})
        assert _routing(loose)["served_provider"] != "beta"


def test_without_a_wait_target_the_block_lowers_the_score_only() -> None:
    limited = Behavior(headers={"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "30s"})
    with live({"up-beta-small": limited}) as lv:
        client = lv.client()
        first = _routing(client.chat.completions.create(model="ethen/cheap", messages=MSG))  # type: ignore
        second = _routing(client.chat.completions.create(model="ethen/cheap", messages=MSG))  # type: ignore
        assert not any("predicted_wait_exceeds_target" in r["reasons"] for r in second["rejected"])
        # the TTFT and latency components are those of a 30 s wait now (cost still dominates ethen/cheap)
        assert first["score_components"]["ttft"] > 0.5
        assert second["score_components"]["ttft"] < 0.02 and second["score"] < first["score"]
        # ethen/fast weighs latency: there the blocked provider is passed over (by score, no target)
        fast = _routing(client.chat.completions.create(model="ethen/fast", messages=MSG))  # type: ignore
        assert fast["served_provider"] != "beta"


def test_anthropic_ratelimit_headers_block_the_provider() -> None:
    reset = (datetime.now(UTC) + timedelta(seconds=20)).isoformat().replace("+00:00", "Z")
    limited = Behavior(headers={"anthropic-ratelimit-requests-remaining": "0",
                                "anthropic-ratelimit-requests-reset": reset})
    with live({"up-gamma-claude": limited}) as lv:
        client = lv.client()
        client.chat.completions.create(model="gamma-claude", messages=MSG)  # type: ignore[call-overload]
        gw = lv.gateway.server.config.app.state.gateway  # type: ignore[attr-defined]
        cap = gw.capacity().get("gamma")
        assert cap is not None and cap.source == "rate_limit" and 15_000 < cap.queue_ms <= 20_000
        assert gw.capacity().get("alpha") is None  # not called: idle, left out of the snapshot
