"""Bearer-key authentication for the gateway.

Keys come from config as SHA-256 hex digests (``[[api_keys]] sha256 = ...``); the presented key is hashed and
looked up, so the process never holds a client key in clear beyond the request that carries it. A key must
start with ``ethen`` (the issue's prefix); anything else, a missing header, or a scheme other than ``Bearer``
is a 401 ``invalid_api_key``. Error messages never echo the presented key. The key may also come in an
``x-api-key`` header (Anthropic's clients): :func:`authorization` reads it as a bearer key when there is no
``Authorization`` header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from ethen.gateway.config import ApiKeyConfig
from ethen.gateway.errors import AuthenticationError

__all__ = ["KEY_PREFIX", "KeyRing", "authorization", "hash_key"]

KEY_PREFIX = "ethen"
_MAX_KEY_LEN = 512


def authorization(headers: Mapping[str, str]) -> str | None:
    """The ``Authorization`` header, or ``Bearer <x-api-key>`` when only ``x-api-key`` is sent."""
    value = headers.get("authorization")
    if value is None and (key := headers.get("x-api-key")):
        return f"Bearer {key}"
    return value


def hash_key(key: str) -> str:
    """The digest stored in config for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The configured keys, by digest."""

    def __init__(self, keys: Iterable[ApiKeyConfig]) -> None:
        self._names = {k.sha256: k.name for k in keys}

    def authenticate(self, authorization: str | None) -> str:
        """The key's name for an ``Authorization`` header value; else :class:`AuthenticationError`."""
        if not authorization:
            raise AuthenticationError(
                "You didn't provide an API key. Pass it as 'Authorization: Bearer ethen...'."
            )
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationError("The Authorization header must be 'Bearer <API key>'.")
        if not key.startswith(KEY_PREFIX) or len(key) > _MAX_KEY_LEN:
            raise AuthenticationError(f"Incorrect API key provided: gateway keys start with {KEY_PREFIX!r}.")
        name = self._names.get(hash_key(key))
        if name is None:
            raise AuthenticationError("Incorrect API key provided.")
        return name
