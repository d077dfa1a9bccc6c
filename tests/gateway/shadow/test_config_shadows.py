"""``[[shadows]]`` config (issue 27): errors name the key and the value; a config with shadows and no
``[store]`` is refused naming the key; a skipped provider's shadows go with it."""

from __future__ import annotations

from typing import Any

import pytest

from ethen.gateway.config import parse_config, skip_providers_without_keys
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.shadow.harness import SMALL, TOOLS, config, rule

DB = "sqlite:///unused.db"


def parse(shadows: list[dict[str, Any]], **overrides: Any) -> Any:
    return parse_config(config("http://127.0.0.1:9", shadows, DB, **overrides))


def test_a_valid_rule_parses_with_defaults() -> None:
    cfg = parse([rule(percent=5), rule(SMALL, percent=0.5, max_in_flight=2, min_success_rate=1,
                                       min_samples=100)])
    got = [(s.alias, s.candidate, s.percent, s.project, s.max_in_flight, s.min_success_rate, s.min_samples)
           for s in cfg.shadows]
    assert got == [("ethen/fast", TOOLS, 5.0, "shadow-evals", 8, 0.95, 20),
                   ("ethen/fast", SMALL, 0.5, "shadow-evals", 2, 1.0, 100)]


def test_shadows_need_a_store() -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse([rule()], store=None)
    msg = info.value.message
    assert "shadows[0].alias = 'ethen/fast'" in msg and "needs a [store] section" in msg


@pytest.mark.parametrize(("shadows", "needle"), [
    ([rule(percent=101)], "shadows[0].percent = 101"),
    ([rule(percent=-1)], "shadows[0].percent = -1"),
    ([rule(max_in_flight=0)], "shadows[0].max_in_flight = 0"),
    # sweep27: finer than the 0.01 % sampling step, a percent was silently rounded (0.001 never sampled)
    ([rule(percent=0.001)], "shadows[0].percent = 0.001: at most two decimals"),
    ([rule(percent=5.125)], "shadows[0].percent = 5.125: at most two decimals"),
    ([rule(min_success_rate=1.5)], "shadows[0].min_success_rate = 1.5"),
    ([rule(min_samples=-3)], "shadows[0].min_samples = -3"),
    ([rule(project="")], "shadows[0].project = ''"),
    ([{**rule(), "alias": "ethen/nope"}], "shadows[0].alias = 'ethen/nope': unknown alias"),
    ([{**rule(), "alias": "gpt-4o"}], "shadows[0].alias = 'gpt-4o'"),
    ([rule("beta/nothing")], "shadows[0].candidate = 'beta/nothing': no such chat provider/model"),
    ([rule("no-slash")], "shadows[0].candidate = 'no-slash'"),
    ([rule(), rule()], "shadows[1].candidate = 'beta/beta-tools': duplicate for alias 'ethen/fast' (also "
                       "shadows[0])"),
    ([{**rule(), "sample": 1}], "shadows[0].sample"),
    ([{k: v for k, v in rule().items() if k != "project"}], "shadows[0].project: required key is missing"),
])
def test_errors_name_the_key_and_value(shadows: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse(shadows)
    assert needle in info.value.message, info.value.message


def test_a_skipped_providers_shadows_are_dropped() -> None:
    cfg = parse([rule(), {**rule(), "candidate": "alpha/alpha-large", "alias": "ethen/cheap"}])
    kept = skip_providers_without_keys(cfg, {"ALPHA_KEY": "x"})
    assert [(s.alias, s.candidate) for s in kept.shadows] == [("ethen/cheap", "alpha/alpha-large")]
