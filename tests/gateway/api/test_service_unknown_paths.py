"""Requests to paths the gateway does not serve (issue 26: Claude Code's ``HEAD /`` got 404s that appeared
nowhere): still a 404 with the OpenAI error envelope, now a WARNING (one per path and client per minute, with
the user agent) and ``ethen_gateway_unknown_path_requests_total{method}`` (no path label)."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client import CollectorRegistry

from ethen.gateway.api.unknown_paths import UnknownPaths
from tests.gateway.service_harness import live


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("unknown path")]


def _count(metrics: str, method: str) -> float:
    prefix = f'ethen_gateway_unknown_path_requests_total{{method="{method}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def test_unknown_paths_are_404_logged_once_per_minute_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ethen.gateway")
    with live() as lv, httpx.Client(base_url=lv.gateway.url, timeout=10,
                                    headers={"user-agent": "claude-cli/2.1.100"}) as client:
        head = client.head("/")
        assert head.status_code == 404
        for _ in range(3):
            r = client.get("/v2/chat/completions")
            assert r.status_code == 404
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("not_found", "invalid_request_error")
        assert client.get("/api/gateway/v1/chat/completions").status_code == 405  # a served path: not counted
        metrics = client.get("/api/gateway/v1/metrics").text
    lines = _lines(caplog)
    assert len(lines) == 2  # HEAD / once, /v2/chat/completions once (not 3 times)
    assert "HEAD '/'" in lines[0] and "127.0.0.1" in lines[0] and "claude-cli/2.1.100" in lines[0]
    assert "GET '/v2/chat/completions'" in lines[1]
    assert _count(metrics, "HEAD") == 1 and _count(metrics, "GET") == 3
    assert "/v2/chat" not in metrics  # the path is never a label


def test_throttle_window_methods_and_bounded_memory(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ethen.gateway")
    now = [0.0]
    reg = CollectorRegistry()
    up = UnknownPaths(reg, window_s=60.0, max_keys=8, clock=lambda: now[0])
    assert up.seen("GET", "/x", "10.0.0.1", "ua") is True
    assert up.seen("GET", "/x", "10.0.0.1", "ua") is False  # same path and client within the minute
    assert up.seen("GET", "/x", "10.0.0.2", "ua") is True  # another client
    assert up.seen("GET", "/y", "10.0.0.1", None) is True  # another path
    now[0] = 59.9
    assert up.seen("GET", "/x", "10.0.0.1", "ua") is False
    now[0] = 60.0
    assert up.seen("GET", "/x", "10.0.0.1", "ua") is True  # a minute later: logged again
    for i in range(1000):  # a client scanning paths: memory stays bounded
        up.seen("GET", f"/scan/{i}", "10.0.0.9", "ua")
        assert len(up._logged) <= 8
    assert up.seen("BREW", "/" + "p" * 5000, "10.0.0.1", "ua\nforged") is True
    assert reg.get_sample_value("ethen_gateway_unknown_path_requests_total", {"method": "other"}) == 1
    assert reg.get_sample_value("ethen_gateway_unknown_path_requests_total", {"method": "GET"}) == 1006
    last = _lines(caplog)[-1]
    assert "\n" not in last and len(last) < 600  # cut and quoted: one line, no forged line
