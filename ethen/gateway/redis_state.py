"""The one Redis boundary of a gateway process: :class:`SharedState` (see :mod:`ethen.gateway.shared` for
what several instances share through it). Any redis-py or socket error of a call becomes
:class:`~ethen.gateway.errors.SharedStateUnavailableError` here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from ethen.gateway.errors import GatewayConfigError, SharedStateUnavailableError

__all__ = ["SharedState"]

log = logging.getLogger("ethen.gateway.shared")
T = TypeVar("T")
#: Redis errors, socket errors and timeouts: everything a call to Redis may raise when it is unreachable.
_REDIS_ERRORS = (RedisError, OSError, TimeoutError)


class SharedState:
    """The Redis connection of one gateway process. :meth:`call` is the boundary: any redis-py (or socket)
    error becomes :class:`SharedStateUnavailableError`. ``blocking=True`` calls (the telemetry reader's
    ``XREAD BLOCK``) use a second client whose read timeout covers the block."""

    def __init__(self, url: str, *, key_prefix: str = "ethen", timeout_s: float = 0.5) -> None:
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.instance_id = uuid.uuid4().hex[:12]
        # one retry on a fresh connection: a pooled connection broken by a Redis restart fails once, then
        # the retry reconnects (no failed request after Redis comes back)
        opts: dict[str, Any] = {
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 1),
            "health_check_interval": 0,
        }
        try:
            self.client: Redis = Redis.from_url(url, socket_timeout=timeout_s, **opts)
            self.reader: Redis = Redis.from_url(url, socket_timeout=timeout_s + 2.0, **opts)
        except ValueError as exc:  # a malformed URL (redis-py names the problem, not the password)
            raise GatewayConfigError(f"shared.redis_url: {exc}") from None
        self.available: bool | None = None  # unknown until the first call

    def key(self, *parts: str) -> str:
        return ":".join((self.key_prefix, *parts))

    async def call(self, op: Callable[[Redis], Awaitable[T]], *, blocking: bool = False) -> T:
        try:
            async with asyncio.timeout(self.timeout_s * 3 + (3.0 if blocking else 0.0)):
                out = await op(self.reader if blocking else self.client)
        except _REDIS_ERRORS as exc:
            self._down(exc)
            raise SharedStateUnavailableError("The gateway's shared state (Redis) is unreachable.") from None
        if self.available is not True:
            if self.available is False:
                log.warning("redis is reachable again: rate limits are checked and telemetry is shared again")
            self.available = True
        return out

    def _down(self, exc: BaseException) -> None:
        if self.available is not False:
            log.warning(
                "redis is unreachable (%s): requests of keys with a rate limit get 503 "
                "rate_limiter_unavailable, others are served; telemetry stays local until it is back",
                type(exc).__name__,
            )
        self.available = False

    async def aclose(self) -> None:
        for c in (self.client, self.reader):
            with contextlib.suppress(*_REDIS_ERRORS):
                await c.aclose()
