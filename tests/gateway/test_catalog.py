"""Catalog loader: real genai-prices + the installed LiteLLM cost map, fixture maps, overrides, built-ins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ethen.gateway.catalog import BUILTIN_MODELS, Catalog, find_cost_map, load_cost_map, quality_prior
from ethen.gateway.errors import CatalogError, GatewayConfigError
from ethen.gateway.routing import Candidate

FIXTURE = {
    "sample_spec": {"max_input_tokens": "doc"},
    "acme/brainy-1": {
        "litellm_provider": "acme", "max_input_tokens": 200000, "max_output_tokens": 32000,
        "input_cost_per_token": 2e-06, "output_cost_per_token": 8e-06, "supports_function_calling": True,
        "supports_vision": True, "supports_response_schema": True, "supports_reasoning": True,
    },
    "tiny-2": {
        "litellm_provider": "acme", "max_input_tokens": 8192, "max_tokens": 1024,
        "input_cost_per_token": 1e-07, "output_cost_per_token": 2e-07,
    },
}


@pytest.fixture
def fixture_catalog(tmp_path: Path) -> Catalog:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(FIXTURE))
    return Catalog(load_cost_map(path), use_genai_prices=False)


def test_fixture_map_capabilities_and_prices(fixture_catalog: Catalog) -> None:
    e = fixture_catalog.entry("acme", "brainy-1")
    assert (e.info.context_window, e.info.max_output_tokens) == (200000, 32000)
    assert e.info.supports_tools and e.info.supports_vision and e.info.supports_structured_output
    assert e.info.supports_reasoning
    assert (e.prices.input_per_mtok, e.prices.output_per_mtok) == pytest.approx((2.0, 8.0))
    assert e.sources["context_window"] == "cost-map:acme/brainy-1" and e.sources["quality"] == "heuristic"
    # a bare key whose litellm_provider matches; max_tokens as the max-output fallback
    t = fixture_catalog.entry("acme", "tiny-2")
    assert (t.info.context_window, t.info.max_output_tokens, t.info.supports_tools) == (8192, 1024, False)
    assert isinstance(t.candidate(), Candidate) and t.candidate().id == "acme/tiny-2"


def test_lookup_model_differs_from_gateway_model(fixture_catalog: Catalog) -> None:
    e = fixture_catalog.entry("acme", "my-alias", lookup_model="brainy-1")
    assert e.model == "my-alias" and e.info.context_window == 200000


def test_overrides_win_for_any_field(fixture_catalog: Catalog) -> None:
    overrides = {"quality": 0.42, "supports_tools": True, "output_per_mtok": 9.0, "ttft_ms": 123.0}
    e = fixture_catalog.entry("acme", "tiny-2", overrides=overrides)
    got = (e.info.quality, e.info.supports_tools, e.prices.output_per_mtok, e.info.ttft_ms)
    assert got == (0.42, True, 9.0, 123.0)
    assert e.sources["quality"] == "override" and e.sources["output_per_mtok"] == "override"


def test_bad_overrides_name_the_key(fixture_catalog: Catalog) -> None:
    with pytest.raises(CatalogError) as info:
        fixture_catalog.entry("acme", "tiny-2", overrides={"qualty": 0.5})
    assert info.value.param == "qualty" and "qualty" in info.value.message
    with pytest.raises(CatalogError) as info:
        fixture_catalog.entry("acme", "tiny-2", overrides={"quality": 1.5})
    assert info.value.param == "quality"
    assert isinstance(info.value, GatewayConfigError)


def test_unknown_model_needs_overrides(fixture_catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match="context_window"):
        fixture_catalog.entry("acme", "mystery")
    full = {"context_window": 4096, "max_output_tokens": 512, "input_per_mtok": 0.0, "output_per_mtok": 0}
    e = fixture_catalog.entry("acme", "mystery", overrides=full)
    assert e.info.context_window == 4096 and e.info.latency_ms == 2000.0
    assert e.sources["latency_ms"] == "default"


def test_builtin_mesh_model(fixture_catalog: Catalog) -> None:
    e = fixture_catalog.entry("mesh", "smollm2-135m-instruct")
    assert (e.info.context_window, e.info.supports_tools, e.info.supports_vision) == (8192, False, False)
    assert (e.prices.input_per_mtok, e.prices.output_per_mtok) == (0.0, 0.0)
    assert ("mesh", "smollm2-135m-instruct") in BUILTIN_MODELS


def test_quality_prior_is_monotone_in_price_and_bounded() -> None:
    assert quality_prior(0, 0, False) == pytest.approx(0.30)
    assert quality_prior(0.1, 0.4, False) < quality_prior(3, 15, False) <= quality_prior(3, 15, True) <= 0.95
    assert quality_prior(1000, 1000, True) == 0.95


def test_missing_or_broken_map_is_a_catalog_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_cost_map(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(CatalogError, match="not a JSON object"):
        load_cost_map(bad)


def test_installed_sources_real_data() -> None:
    """The real data sources that run.sh installs: the cost map (tokencostauto) and genai-prices."""
    path = find_cost_map()
    assert path is not None and path.is_file(), "run.sh installs tokencostauto (--no-deps) for the cost map"
    catalog = Catalog.load()
    e = catalog.entry("openai", "gpt-4o-mini")
    assert e.sources["input_per_mtok"] == "genai-prices"
    assert e.sources["context_window"].startswith("cost-map:")
    assert e.info.context_window >= 128_000 and e.info.supports_tools and e.info.supports_vision
    assert 0 < e.prices.input_per_mtok < e.prices.output_per_mtok


def test_tiered_prices_use_the_highest_tier() -> None:
    from genai_prices import data_snapshot

    _p, info = data_snapshot.get_snapshot().find_provider_model("claude-sonnet-4-5", None, "anthropic", None)
    if not hasattr(info.prices, "input_mtok") or not hasattr(info.prices.input_mtok, "tiers"):
        pytest.skip("genai-prices has no tiered price for this model in this version")
    e = Catalog.load().entry("anthropic", "claude-sonnet-4-5")
    tiers = [float(t.price) for t in info.prices.input_mtok.tiers]
    assert e.prices.input_per_mtok == max([float(info.prices.input_mtok.base), *tiers])
