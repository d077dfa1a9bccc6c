"""``[[hedges]]`` config (issue 27): errors name the key and the value."""

from __future__ import annotations

from typing import Any

import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.hedging.harness import config


def parse(hedges: list[dict[str, Any]]) -> Any:
    return parse_config(config("http://127.0.0.1:9", hedges))


def test_a_valid_rule_parses() -> None:
    cfg = parse([{"alias": "ethen/fast", "after_percentile": 95, "min_samples": 30, "max_extra": 1},
                 {"alias": "ethen/cheap", "after_ms": 400}])
    assert [(h.alias, h.after_ms, h.after_percentile, h.min_samples, h.max_extra) for h in cfg.hedges] == [
        ("ethen/fast", None, 95, 30, 1), ("ethen/cheap", 400.0, None, 20, 1)]


@pytest.mark.parametrize(("hedges", "needle"), [
    ([{"alias": "ethen/nope", "after_ms": 400}], "hedges[0].alias = 'ethen/nope': unknown alias"),
    ([{"alias": "gpt-4o", "after_ms": 400}], "hedges[0].alias = 'gpt-4o'"),
    ([{"alias": "ethen/fast", "after_ms": 1}, {"alias": "ethen/fast", "after_ms": 2}],
     "hedges[1].alias = 'ethen/fast': duplicate (also hedges[0])"),
    ([{"alias": "ethen/fast"}], "set exactly one of after_ms and after_percentile"),
    ([{"alias": "ethen/fast", "after_ms": 400, "after_percentile": 95}],
     "set exactly one of after_ms and after_percentile"),
    ([{"alias": "ethen/fast", "after_ms": -1}], "hedges[0].after_ms = -1"),
    ([{"alias": "ethen/fast", "after_percentile": 101}], "hedges[0].after_percentile = 101"),
    ([{"alias": "ethen/fast", "after_ms": 400, "max_extra": 9}], "hedges[0].max_extra = 9"),
    ([{"alias": "ethen/fast", "after_percentile": 95, "min_samples": 0}], "hedges[0].min_samples = 0"),
    # sweep27: a minimum above the samples kept (the last 50 successes) silently disabled the rule
    ([{"alias": "ethen/fast", "after_percentile": 95, "min_samples": 51}],
     "hedges[0].min_samples = 51: at most 50"),
    ([{"alias": "ethen/fast", "after_ms": 400, "delay": 1}], "hedges[0].delay"),
])
def test_errors_name_the_key_and_value(hedges: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse(hedges)
    assert needle in str(info.value), str(info.value)
