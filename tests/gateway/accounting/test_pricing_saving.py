"""``Cost.saved_usd`` (issue 45) without a second genai-prices calculation: for every model genai-prices
knows, the saving :func:`~ethen.gateway.accounting.pricing.cost_of` reports equals the oracle written here,
two calculations as the issue defines it (the same usage with its reads billed as input, minus the actual
input price), exactly, tiers and cache writes included."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from genai_prices import Usage as PriceUsage
from genai_prices import data_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.gateway.accounting import pricing
from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, ModelInfo, Prices

_NOW = datetime.now(UTC)
#: (provider id, model id) of every model in genai-prices' snapshot, and whether it prices cache reads now
MODELS = sorted(
    (p.id, m.id, m.get_prices(_NOW).cache_read_mtok is not None)
    for p in data_snapshot.get_snapshot().providers
    for m in p.models
)
WITH_READS = [pm for pm in MODELS if pm[2]]
INFO = ModelInfo(context_window=2_000_000, max_output_tokens=100_000, supports_tools=True,
                 supports_vision=True, quality=0.5, latency_ms=500.0, ttft_ms=200.0)


def _oracle(provider: str, model: str, usage: Usage) -> float | None:
    """The saving as two genai-prices calculations (``None``: genai-prices cannot price this usage)."""
    try:  # a model whose id its own provider's patterns do not match is not found: route prices
        _, found = data_snapshot.get_snapshot().find_provider_model(model, None, provider, None)
    except LookupError:
        return None
    price = found.get_prices(datetime.now(UTC))
    reads = min(usage.cache_read_tokens, usage.prompt_tokens)
    writes = min(usage.cache_write_tokens, usage.prompt_tokens - reads)
    try:
        actual = price.calc_price(PriceUsage(input_tokens=usage.prompt_tokens, cache_read_tokens=reads,
                                             cache_write_tokens=writes,
                                             output_tokens=usage.completion_tokens))
        plain = price.calc_price(PriceUsage(input_tokens=usage.prompt_tokens, cache_write_tokens=writes,
                                            output_tokens=0))
    except (ValueError, LookupError, ArithmeticError):
        return None
    return max(0.0, float(plain["input_price"]) - float(actual["input_price"])) if reads else 0.0


@st.composite
def usages(draw: st.DrawFn) -> Usage:
    prompt = draw(st.one_of(st.integers(0, 5_000), st.integers(0, 2_000_000)))
    reads = draw(st.integers(0, prompt))
    writes = draw(st.integers(0, prompt - reads))
    return Usage(prompt, draw(st.integers(0, 50_000)), cache_read_tokens=reads, cache_write_tokens=writes)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(WITH_READS) | st.sampled_from(MODELS), usages())
def test_saving_equals_the_two_calculation_oracle(model: tuple[str, str, bool], usage: Usage) -> None:
    provider, name, _ = model
    pricing._priced.cache_clear()
    cost = cost_of(Candidate(provider, name, INFO, Prices(1.0, 1.0), price_ref=((provider,), name)), usage)
    want = _oracle(provider, name, usage)
    if want is None:
        assert cost.source == "route prices"
        return
    assert cost.source == "genai-prices"
    assert cost.saved_usd == want  # exactly: the derivation is exact in decimal arithmetic


def test_every_model_with_a_cache_read_price_saves_exactly_as_the_oracle_at_a_tier_boundary() -> None:
    assert len(WITH_READS) > 100  # the snapshot is the real one
    for provider, name, _ in WITH_READS:
        cand = Candidate(provider, name, INFO, Prices(1.0, 1.0), price_ref=((provider,), name))
        for prompt in (1_000, 200_000, 200_001, 1_000_001):
            usage = Usage(prompt, 10, cache_read_tokens=prompt * 3 // 4, cache_write_tokens=prompt // 8)
            want = _oracle(provider, name, usage)
            got = cost_of(cand, usage)
            assert (got.saved_usd if got.source == "genai-prices" else None) == want, (provider, name, prompt)
            no_reads = dataclasses.replace(usage, cache_read_tokens=0)
            assert cost_of(cand, no_reads).saved_usd == 0.0
