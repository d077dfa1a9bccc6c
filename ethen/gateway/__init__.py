"""Ethen gateway: OpenAI-compatible gateway with ``ethen/*`` smart routing.

Kept light: import the sub-packages you need (``ethen.gateway.routing`` is the pure core,
``ethen.gateway.catalog`` the catalog loader, ``ethen.gateway.errors`` the exception tree).
"""

__all__: list[str] = []
