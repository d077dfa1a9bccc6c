"""Model catalog: builds the routing core's ``ModelInfo`` / ``Prices`` from maintained machine-readable
sources.

Impure (reads installed data files); the routing core never imports it. See :mod:`.loader` for sources,
lookup rules, quality priors and overrides.
"""

from .loader import (
    BUILTIN_MODELS,
    COST_MAP_SOURCES,
    Catalog,
    CatalogEntry,
    find_cost_map,
    load_cost_map,
    quality_prior,
)

__all__ = [
    "BUILTIN_MODELS",
    "COST_MAP_SOURCES",
    "Catalog",
    "CatalogEntry",
    "find_cost_map",
    "load_cost_map",
    "quality_prior",
]
