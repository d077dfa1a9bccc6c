"""Requests to paths the gateway does not serve (issue 26): Claude Code's ``HEAD /``, a client with a wrong
base URL. The answer stays a 404 with the OpenAI error envelope; what this adds is that they are seen:

- a WARNING on logger ``ethen.gateway`` naming the method, the path (cut to 200 characters, ``%r``-quoted so a
  path cannot forge log lines), the client's address and user agent; at most one line per (path, client) per
  ``window_s`` (60 s), so a client polling a wrong URL does not flood the log;
- ``ethen_gateway_unknown_path_requests_total{method}``, counted on every such request. The raw path is never
  a label (any client could create unbounded series with it); ``method`` is one of the HTTP methods, else
  ``other``.

Memory is bounded: the throttle remembers at most ``max_keys`` (path, client) pairs, forgetting the oldest
first (a forgotten pair may log again early, never more than once per request).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

__all__ = ["UnknownPaths"]

log = logging.getLogger("ethen.gateway")

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
_MAX_PATH = 200


class UnknownPaths:
    """Logs (throttled) and counts requests to unknown paths."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        window_s: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counter = Counter(
            "ethen_gateway_unknown_path_requests",
            "Requests to a path the gateway does not serve (answered 404), by method.",
            ["method"],
            registry=registry,
        )
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self._logged: OrderedDict[tuple[str, str], float] = OrderedDict()  # (path, client) -> last log time

    def seen(self, method: str, path: str, client: str, user_agent: str | None) -> bool:
        """Count one request; log it unless this (path, client) was logged within the window. Returns
        whether it logged."""
        self.counter.labels(method if method in _METHODS else "other").inc()
        now = self.clock()
        logged = self._logged
        while logged:  # forget the expired pairs (oldest first)
            first = next(iter(logged.values()))
            if now - first < self.window_s:
                break
            logged.popitem(last=False)
        key = (path[:_MAX_PATH], client)
        if key in logged:
            return False
        logged[key] = now
        if len(logged) > self.max_keys:
            logged.popitem(last=False)
        log.warning("unknown path: %s %r from %s (user agent %r): 404", method[:16], key[0], client,
                    (user_agent or "")[:200])
        return True
