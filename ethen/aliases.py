"""The names of the ``ethen/*`` routing aliases: a leaf module (imports nothing of ``ethen``).

The routing core (:data:`ethen.gateway.routing.ALIASES`) gives each name its weights; the store checks a
project's ``default_alias`` against these names without importing the gateway.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ALIAS_NAMES", "AUTO_ALIAS"]

AUTO_ALIAS: Final = "ethen/auto"

#: The eight aliases of the spec, in the spec's order.
ALIAS_NAMES: Final = (
    AUTO_ALIAS,
    "ethen/fast",
    "ethen/best",
    "ethen/cheap",
    "ethen/reasoning",
    "ethen/coding",
    "ethen/vision",
    "ethen/long-context",
)
