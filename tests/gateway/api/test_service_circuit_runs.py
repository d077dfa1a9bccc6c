"""Issue 42 item 1 over real HTTP: a provider that had been serving is routed to again within 15 s of its
recovery, after an outage in which its port was closed.

Two scripted upstreams on 127.0.0.1 serve model ``m``: the primary ``okP`` (quality 0.9) and the alternative
``okQ`` (quality 0.5), each its own server. ``okP`` serves, then its server is stopped (port closed: every
attempt is a ``connect_error``), then a new server is started on the same port. Before, ``okP``'s earlier
successes kept its circuit from opening (the gate was only "0 successes over >= 3 samples") while its
reliability (10 successes + 17 failures: 19/37) ranked it below ``okQ``: for 200 s every request went to
``okQ`` and nothing probed ``okP``. Now its last 3 outcomes failing open its circuit (logged), it is probed,
and the probe's success drops the outage's failures: ``okP`` is the primary again within 15 s. Also without
an alternative (requests fail during the outage) and without earlier successes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from ethen.app import create_app
from ethen.gateway.config import parse_config
from tests.gateway.service_harness import ENV, Live, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

USER = [{"role": "user", "content": "hi"}]
#: short cool-downs for the variants (the default [circuit], 2 s doubling to 10 s, is the first test's)
FAST = {"cooldown_s": 0.5, "max_cooldown_s": 1.0}


def routing(resp: Any) -> dict[str, Any]:
    return resp.model_extra["ethen"]["routing"]  # type: ignore[no-any-return]


def _route(provider: str, quality: float) -> dict[str, Any]:
    return {
        "model": "m",
        "provider": provider,
        "upstream_model": f"up-{provider}",
        "info": {"context_window": 128_000, "max_output_tokens": 4_000, "quality": quality,
                 "latency_ms": 500.0, "ttft_ms": 200.0},
        "prices": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
    }  # fmt: skip


class Upstream:
    """One scripted upstream that can be stopped (its port closed) and brought back on the same port."""

    def __init__(self) -> None:
        self.script = Script()
        self.server: ServerThread | None = ServerThread(make_upstream_app(self.script)).__enter__()
        self.port = self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        assert self.server is not None
        self.server.__exit__(None, None, None)
        self.server = None

    def revive(self) -> None:
        self.server = ServerThread(make_upstream_app(self.script), port=self.port).__enter__()

    def close(self) -> None:
        if self.server is not None:
            self.kill()

    def probes(self) -> int:
        return len([c for c in self.script.calls if c["body"].get("max_tokens") == 1])


@contextmanager
def gateway(alternative: bool, circuit: dict[str, Any] | None) -> Iterator[tuple[Live, Upstream]]:
    ok_p, ok_q = Upstream(), Upstream()
    try:
        providers = [
            {"id": pid, "kind": "openai_compat", "base_url": f"{up.url}/v1", "api_key_env": env,
             "timeouts": {"connect_s": 2.0, "first_byte_s": 2.0, "total_s": 5.0}}
            for pid, up, env in (("okP", ok_p, "ALPHA_KEY"), ("okQ", ok_q, "BETA_KEY"))
        ]  # fmt: skip
        routes = [_route("okP", 0.9), _route("okQ", 0.5)] if alternative else [_route("okP", 0.9)]
        over: dict[str, Any] = {"providers": providers, "routes": routes}
        if circuit is not None:
            over["circuit"] = circuit
        cfg = parse_config(config_dict(ok_p.url, **over))
        with ServerThread(create_app(cfg, env=ENV)) as gw:
            assert ok_p.server is not None
            yield Live(ok_p.script, ok_p.server, gw, cfg), ok_p
    finally:
        ok_p.close()
        ok_q.close()


def serve_through_outage(
    lv: Live, ok_p: Upstream, *, alternative: bool, earlier: int, outage_s: float
) -> tuple[float, list[dict[str, Any]]]:
    """``earlier`` requests served by okP, okP down for ``outage_s`` (requests every 0.1 s), okP back:
    seconds until a request is served by okP again (bounded: 15 s), and the outage's receipts."""
    c = lv.client()
    for _ in range(earlier):
        r = c.chat.completions.create(model="m", messages=USER)
        assert routing(r)["served_provider"] == "okP"
    ok_p.kill()
    during: list[dict[str, Any]] = []
    t_down = time.monotonic()
    while time.monotonic() - t_down < outage_s:  # bounded
        try:
            during.append(routing(c.chat.completions.create(model="m", messages=USER)))
        except openai.APIStatusError as exc:  # sole provider: the attempt failed, or its circuit is open
            assert not alternative, exc
            got = (exc.status_code, exc.code)
            assert got in {(502, "upstream_connection_error"), (503, "no_healthy_candidate")}, got
        time.sleep(0.1)
    ok_p.revive()
    t_back = time.monotonic()
    while time.monotonic() - t_back < 15.0:  # bounded
        try:
            r = c.chat.completions.create(model="m", messages=USER)
        except openai.APIStatusError as exc:
            assert not alternative and exc.status_code == 503, exc
        else:
            if routing(r)["served_provider"] == "okP":
                return time.monotonic() - t_back, during
        time.sleep(0.1)
    raise AssertionError(f"okP not served within 15 s of its recovery ({ok_p.probes()} probes reached it)")


def test_primary_down_10_s_after_serving_is_the_primary_again_within_15_s_default_circuit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's scenario with the default [circuit] (2 s cool-down doubling to 10 s, probes on)."""
    caplog.set_level(logging.WARNING)
    with gateway(alternative=True, circuit=None) as (lv, ok_p):
        back_after, during = serve_through_outage(lv, ok_p, alternative=True, earlier=10, outage_s=10.0)
        print(f"served by okP again {back_after:.2f} s after its recovery")
        assert all(d["served_provider"] == "okQ" for d in during)
        tried = [d for d in during if any(a["candidate"] == "okP/m" for a in d["attempts"])]
        assert len(tried) == 3  # the run that opened the circuit; then straight to okQ
        assert all(d["attempts"][0]["code"] == "upstream_connection_error" for d in tried)
        assert ok_p.probes() >= 1  # before: none
        c = lv.client()
        for _ in range(5):  # it ranks as before the outage: the primary, first try, no trial
            r = routing(c.chat.completions.create(model="m", messages=USER))
            assert r["served_provider"] == "okP" and [a["outcome"] for a in r["attempts"]] == ["ok"]
            assert r["chain"][0] == "okP/m" and "circuit_half_open_trial" not in r["reason_codes"]
    messages = [r.getMessage() for r in caplog.records if r.name == "ethen.gateway.circuit"]
    assert messages[0] == (
        "circuit open: okP/m excluded from routing (candidate_failing: its last 3 recent outcomes failed); "
        "first trial in 2.0 s"
    )
    assert "circuit closed: okP/m is routed to again (a trial succeeded)" in messages
    assert back_after <= 15.0


@pytest.mark.parametrize(
    ("alternative", "earlier"),
    [(True, 10), (False, 10), (True, 0), (False, 0)],
    ids=["alternative-earlier-successes", "sole-earlier-successes", "alternative-none-before",
         "sole-none-before"],
)  # fmt: skip
def test_recovered_primary_is_served_again_with_or_without_alternative_or_history(
    alternative: bool, earlier: int
) -> None:
    with gateway(alternative=alternative, circuit=FAST) as (lv, ok_p):
        back_after, during = serve_through_outage(
            lv, ok_p, alternative=alternative, earlier=earlier, outage_s=3.0
        )
        print(f"served by okP again {back_after:.2f} s after its recovery")
        if alternative:
            assert during and all(d["served_provider"] == "okQ" for d in during)
        # a probe or a live trial finds it within max_cooldown_s (1 s) of its recovery, plus slack
        assert back_after <= 5.0
        r = routing(lv.client().chat.completions.create(model="m", messages=USER))
        assert r["served_provider"] == "okP" and "circuit_half_open_trial" not in r["reason_codes"]
