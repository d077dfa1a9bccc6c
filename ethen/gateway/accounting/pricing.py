"""What an answer cost: genai-prices' own calculation from the usage's cache, reasoning and tier fields.

A prompt-cached agent loop reads most of its input from the provider's cache (Anthropic bills reads at 0.1x
input and writes at 1.25x; OpenAI's cached input 0.1-0.5x; Gemini's and Claude's long prompts have tiers), so
prompt x input price + completion x output price bills it several times over. :func:`cost_of` prices a usage
with ``genai_prices`` (``ModelPrice.calc_price`` of the model's prices at the current time, with
``input_tokens``, ``cache_read_tokens``, ``cache_write_tokens``, ``output_tokens``); a candidate genai-prices
does not know (``Candidate.price_ref`` is ``None`` or names no model it has: a local model, an operator's own
route) is priced as before, by its route's prices (``source = "route prices"``).

Which model: ``Candidate.price_ref`` (set by ``ethen.gateway.config.build``): the route's ``catalog_model`` /
upstream model, looked up under the route's ``catalog_provider``, its provider id and the genai-prices id of
its provider kind (``anthropic``, ``google`` for ``gemini``, ``azure``), the first that knows it. The lookup
is cached per model; a price calculation is cached per (model, usage) (the executor's telemetry, the budget
settlement and the request log price the same usage).

Savings (issue 45): ``Cost.saved_usd`` is what the cache reads saved against paying them at the input
price: the same calculation with the reads counted as plain input, minus the actual input price (so
reads x (input price - cache-read price), with genai-prices' tiers); 0 under route prices (they have no
cache-read price: a read is billed as input) and so 0 on the mesh (its input price is its cache-read price).
It is worked out from the one calculation (:func:`_uncached_input`: the reads at the input and cache-read
prices of the request's tier, exact in decimal arithmetic), a second calculation only for a model without
both prices; a response without cache reads saves 0 with no further work.

Reservations do not use this: they stay the naive upper bound (all input at the full input price, the
catalog's highest tier), and a settlement never exceeds its reservation
(:mod:`ethen.gateway.accounting.hold`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import lru_cache
from typing import Any

from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate

__all__ = ["Cost", "cost_of"]


@dataclass(frozen=True, slots=True)
class Cost:
    """One answer's price and its parts (USD). ``source``: ``"genai-prices"`` or ``"route prices"``."""

    total_usd: float
    input_usd: float  # every input token, cache reads and writes included
    output_usd: float
    usage: Usage
    source: str
    model: str | None = None  # genai-prices' model id (None: route prices)
    provider: str | None = None  # genai-prices' provider id
    saved_usd: float = 0.0  # what the cache reads saved (see the module docstring)

    def to_dict(self) -> dict[str, Any]:
        """The breakdown on the receipt and in the request log."""
        u = self.usage
        return {
            "total_usd": self.total_usd, "input_usd": self.input_usd, "output_usd": self.output_usd,
            "input_tokens": u.prompt_tokens, "cache_read_tokens": u.cache_read_tokens,
            "cache_write_tokens": u.cache_write_tokens, "output_tokens": u.completion_tokens,
            "reasoning_tokens": u.reasoning_tokens, "source": self.source,
            "priced_model": self.model, "priced_provider": self.provider, "saved_usd": self.saved_usd,
        }


@lru_cache(maxsize=512)
def _model(providers: tuple[str, ...], model_ref: str) -> Any:
    """genai-prices' ``(provider, model)`` for the first provider that knows ``model_ref``, else ``None``."""
    from genai_prices import data_snapshot

    snapshot = data_snapshot.get_snapshot()
    for provider in providers:
        try:
            return snapshot.find_provider_model(model_ref, None, provider, None)
        except LookupError:
            continue
    return None


@lru_cache(maxsize=4096)
def _priced(ref: tuple[tuple[str, ...], str], usage: Usage) -> tuple[float, float, float, str, str] | None:
    """(input, output, saved) USD, genai-prices' model and provider ids; ``None`` when it cannot price."""
    found = _model(*ref)
    if found is None:
        return None
    from genai_prices import Usage as PriceUsage

    provider, model = found
    price = model.get_prices(datetime.now(UTC))
    cache_read = min(usage.cache_read_tokens, usage.prompt_tokens)
    cache_write = min(usage.cache_write_tokens, usage.prompt_tokens - cache_read)
    try:
        calc = price.calc_price(PriceUsage(input_tokens=usage.prompt_tokens, cache_read_tokens=cache_read,
                                           cache_write_tokens=cache_write,
                                           output_tokens=usage.completion_tokens))
        uncached = _uncached_input(price, calc["input_price"], cache_read, usage.prompt_tokens, cache_write)
    except (ValueError, LookupError, ArithmeticError):  # a table genai-prices cannot apply: route prices
        return None
    inp = float(calc["input_price"])
    saved = max(0.0, float(uncached) - inp) if uncached is not None else 0.0
    return inp, float(calc["output_price"]), saved, str(model.id), str(provider.id)


def _uncached_input(price: Any, input_usd: Decimal, reads: int, input_tokens: int, writes: int
                    ) -> Decimal | None:
    """The input price with the cache reads billed as input (``None`` without reads). With both an input and
    a cache-read price, that is the actual input price plus the reads at the input price minus the reads at
    the cache-read price (each at the tier of the request's ``input_tokens``, the tier genai-prices applies to
    both: what ``calc_price`` of the uncached usage gives, exactly, in decimal arithmetic, without a second
    calculation); otherwise genai-prices' calculation of the uncached usage."""
    if not reads:
        return None
    from genai_prices.types import calc_unit_price

    read_price, input_price = price.cache_read_mtok, price.input_mtok
    if read_price is not None and input_price is not None:
        return (input_usd + calc_unit_price(input_price, reads, input_tokens, _PER_MTOK)
                - calc_unit_price(read_price, reads, input_tokens, _PER_MTOK))
    from genai_prices import Usage as PriceUsage

    plain = PriceUsage(input_tokens=input_tokens, cache_write_tokens=writes, output_tokens=0)
    return Decimal(price.calc_price(plain)["input_price"])


_PER_MTOK = 1_000_000


def cost_of(candidate: Candidate, usage: Usage) -> Cost:
    """The price of ``usage`` served by ``candidate`` (genai-prices when it knows the model)."""
    priced = _priced(candidate.price_ref, usage) if candidate.price_ref is not None else None
    if priced is not None:
        inp, out, saved, model, provider = priced
        return Cost(inp + out, inp, out, usage, "genai-prices", model, provider, saved)
    p = candidate.prices
    inp, out = usage.prompt_tokens * p.input_per_mtok / 1e6, usage.completion_tokens * p.output_per_mtok / 1e6
    return Cost(inp + out, inp, out, usage, "route prices")
