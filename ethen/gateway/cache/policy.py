"""The response cache's pure core: which requests it serves and stores, and under which key.

No I/O, no clock: the shell (:mod:`ethen.gateway.cache.shell`) passes in the request's body, the
``Cache-Control`` / ``Pragma`` headers and the caller's scope.

- :func:`directive`: the request's ``Cache-Control`` as RFC 9111 reads it for a cache: ``no-store`` (neither
  read nor write: the answer may not be kept), else ``no-cache`` (a stored answer may not be served without
  revalidation; the gateway cannot revalidate an LLM answer, so it is a miss that refreshes the entry), else
  none. ``Pragma: no-cache`` counts as ``no-cache`` when there is no ``Cache-Control`` (RFC 9111 5.4).
- :func:`verdict`: ``(read, write, reason)``. A request is cacheable when the cache is enabled, its model is
  opted in (``aliases`` / ``routes``; neither list given: every model) and it is deterministic
  (``temperature`` 0 or an integer ``seed``) unless ``cache_nondeterministic``. ``reason`` names why a request
  bypasses the cache: ``no-store``, ``no-cache``, ``not_opted_in``, ``nondeterministic``.
- :func:`cache_key`: sha256 of the canonical JSON (sorted keys, no spaces, UTF-8) of the scope (the
  caller's project, or ``config:<key name>`` for a config key), the endpoint, and the request as sent
  upstream, minus the fields that cannot change the answer (:data:`IGNORED`: ``user``, ``metadata``,
  ``stream_options``; the usage chunk ``include_usage`` asks for is built by the gateway, never stored).
  An endpoint that translates its body (Responses, Messages, legacy completions) adds ``client``: the body
  as the client sent it (minus :data:`IGNORED` and ``providerOptions``) and the ``anthropic-beta`` header,
  since a native Anthropic provider sends the client's Messages body and that header as they came.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["IGNORED", "CachePolicy", "cache_key", "canonical", "deterministic", "directive", "verdict"]

#: body fields that do not change the answer (left out of the key)
IGNORED = frozenset({"user", "metadata", "stream_options"})


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """What ``[cache]`` says about which requests to cache. ``models``: the opted-in alias and route names
    (``None``: all)."""

    enabled: bool = True
    nondeterministic: bool = False
    models: frozenset[str] | None = None

    @classmethod
    def of(cls, enabled: bool, nondeterministic: bool, aliases: Iterable[str] | None,
           routes: Iterable[str] | None) -> CachePolicy:
        listed = None
        if aliases is not None or routes is not None:
            listed = frozenset((*(aliases or ()), *(routes or ())))
        return cls(enabled, nondeterministic, listed)


def directive(cache_control: str | None, pragma: str | None = None) -> str | None:
    """``"no-store"``, ``"no-cache"`` or ``None`` for a request's ``Cache-Control`` (and ``Pragma``)."""
    if cache_control is None:
        if pragma is not None and any(p.strip().lower() == "no-cache" for p in pragma.split(",")):
            return "no-cache"
        return None
    found: str | None = None
    for part in cache_control.split(","):
        name = part.partition("=")[0].strip().lower()
        if name == "no-store":
            return "no-store"
        if name == "no-cache":
            found = "no-cache"
    return found


def deterministic(body: Mapping[str, Any]) -> bool:
    """``temperature`` 0 (a number, not a bool) or an integer ``seed``."""
    t = body.get("temperature")
    s = body.get("seed")
    zero = isinstance(t, int | float) and not isinstance(t, bool) and t == 0
    seeded = isinstance(s, int) and not isinstance(s, bool)
    return zero or seeded


def verdict(
    policy: CachePolicy, body: Mapping[str, Any], directive_: str | None
) -> tuple[bool, bool, str | None]:
    """``(read, write, reason)`` for one request (module docstring); ``reason`` is ``None`` when both."""
    if directive_ == "no-store":
        return False, False, "no-store"
    model = body.get("model")
    if policy.models is not None and (not isinstance(model, str) or model not in policy.models):
        return False, False, "not_opted_in"
    if not policy.nondeterministic and not deterministic(body):
        return False, False, "nondeterministic"
    if directive_ == "no-cache":
        return False, True, "no-cache"
    return True, True, None


def canonical(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8 (not ASCII-escaped)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=True).encode("utf-8", "surrogatepass")


def cache_key(scope: str, endpoint: str, payload: Mapping[str, Any],
              client: Mapping[str, Any] | None = None) -> str:
    """The entry's key: hex sha256 of ``[scope, endpoint, payload minus IGNORED]`` in canonical JSON, with
    ``client`` (the untranslated body and answer-changing headers) appended when given."""
    request = {k: v for k, v in payload.items() if k not in IGNORED}
    material: list[Any] = [scope, endpoint, request]
    if client is not None:
        material.append(client)
    return hashlib.sha256(canonical(material)).hexdigest()
