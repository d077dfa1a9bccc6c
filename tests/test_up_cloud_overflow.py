"""``ethen up --config examples/cloud-overflow.toml`` (issue 44): the overlay validates as ``ethen up`` would
serve it, its ``[[wait_targets]]`` reach the gateway (merged by ``ethen up``'s own code, appended to the
generated config's like ``[[providers]]`` and ``[[routes]]``), and a bad or duplicate target names the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ethen.gateway.config import GatewayConfig
from ethen.gateway.config.overlay import MERGED_SECTIONS, load_overlay, merge_overlay, parse_overlay
from ethen.gateway.errors import GatewayConfigError
from ethen.up_config import gateway_document

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "examples" / "cloud-overflow.toml"
WORKERS = {"gpu": "127.0.0.1:9"}


def test_the_shipped_overlay_validates_with_its_wait_target() -> None:
    cfg = load_overlay(OVERLAY)
    assert isinstance(cfg, GatewayConfig)
    assert [(w.alias, w.max_wait_ms) for w in cfg.wait_targets] == [("ethen/cheap", 1000.0)]
    assert [p.id for p in cfg.providers] == ["mesh", "openai"]
    assert {(r.provider, r.model) for r in cfg.routes} >= {("openai", "gpt-4.1-nano")}


def test_ethen_up_merges_wait_targets_like_the_other_appended_sections() -> None:
    user = tomllib.loads(OVERLAY.read_text(encoding="utf-8"))
    doc = gateway_document("127.0.0.1", 0, "k" * 40, WORKERS, user)
    assert doc["wait_targets"] == [{"alias": "ethen/cheap", "max_wait_ms": 1000}]
    assert "wait_targets" in MERGED_SECTIONS
    base = {**doc, "wait_targets": [{"alias": "ethen/fast", "max_wait_ms": 500}]}
    merged = merge_overlay(base, {"wait_targets": [{"alias": "ethen/cheap", "max_wait_ms": 800}]})
    assert merged["wait_targets"] == [{"alias": "ethen/fast", "max_wait_ms": 500},
                                      {"alias": "ethen/cheap", "max_wait_ms": 800}]


@pytest.mark.parametrize(("targets", "needle"), [
    ([{"alias": "ethen/nope", "max_wait_ms": 10}], "wait_targets[0].alias = 'ethen/nope': unknown alias"),
    ([{"alias": "ethen/cheap", "max_wait_ms": 10}, {"alias": "ethen/cheap", "max_wait_ms": 20}],
     "wait_targets[1].alias = 'ethen/cheap': duplicate (also wait_targets[0])"),
    ([{"alias": "ethen/cheap", "max_wait_ms": 0}], "max_wait_ms"),
    ([{"alias": "ethen/cheap"}], "max_wait_ms"),
    ([{"alias": "ethen/cheap", "max_wait_ms": 10, "extra": 1}], "extra"),
])
def test_a_bad_wait_target_names_the_key(targets: list[dict[str, object]], needle: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse_overlay({"wait_targets": targets}, source="overflow.toml")
    assert needle in str(info.value)
    assert "overflow.toml" in str(info.value)
