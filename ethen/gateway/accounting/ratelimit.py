"""Rate limits: requests and tokens per window, per key and per project, exact across gateway instances.

Set in two places. The gateway config (``[rate_limits]``, :class:`~ethen.gateway.config.RateLimitsConfig`):
``rpm`` / ``tpm`` on a config key (``[[api_keys]]``), on a store project by name
(``[rate_limits.projects.NAME]``) and on a store key by its id (``[rate_limits.keys.KEY_ID]``). And the store
(issue 11): a project's policy and a key's row carry ``rpm`` / ``tpm``, set through the admin API and CLI
(``ethen projects create|set --rpm --tpm``, ``ethen keys create|set``). They arrive with the request's
principal (:class:`~ethen.store.Principal`, cached by :mod:`ethen.store.admission`, whose change counter
drops the cache on every instance within about a second of a change): no extra lookup per request.
**The store's value overrides the config file's**, field by field (a project with ``rpm`` in the store and
``tpm`` only in the file is limited by both; clearing the store's ``rpm`` falls back to the file's): the admin
API is the live control, the file the default. A request of a store key counts against its key's limits
*and* its project's; every limit must admit it. A changed limit keeps the window's log (lowering ``rpm`` below
what the window already admitted refuses until enough of it has passed).

Algorithm (choice): a **sliding-window log**, exact for every window-long span (a fixed window lets twice the
limit through around a boundary). Each limit keeps its admitted requests with their time and cost (1 for
``rpm``, the request's estimated tokens for ``tpm``) and the running sum of the costs in the window; a request
is admitted when ``sum + cost <= limit`` for every limit it counts against, and then recorded in all of them,
atomically. ``window_s`` (60 s: "per minute") is configurable; a shorter one suits tests. Memory and work are
O(requests admitted in the window) per limit.

- **With ``[shared]`` Redis**: one Lua script per request (``EVALSHA``; Redis runs it atomically) over a
  sorted set and a counter per limit, timed by Redis' own clock (``TIME``), so every instance sees one log:
  "60 per minute across three instances" admits at most 60 in any 60 s. Keys expire one window after their
  last use.
  One Redis, not a cluster (a request's limits are several keys of one script).
- **Without Redis**: the same log in process memory; each instance limits on its own (N instances admit up to
  N x the limit). Documented in the README.
- **Tokens**: a request is admitted on its *estimated* tokens: the routing estimate of its input plus ``n`` x
  ``max_tokens`` (input only when ``max_tokens`` is unset), and corrected once it is served to the usage the
  upstream reported (a request that was not served counts 0 tokens; one without a usage report keeps its
  estimate). The correction is sent off the request path; it may take a window over its limit by what the
  estimate missed, which then holds back the next requests. A request estimated above the ``tpm`` limit
  itself is refused (no wait would admit it).
- **Over a limit**: 429 ``rate_limit_exceeded`` (type ``requests`` or ``tokens``, as OpenAI's), with
  ``Retry-After`` = whole seconds until enough of the window has passed for this request; no upstream call,
  no budget reserved. A refused request is not counted.
- **Redis unreachable**: a request with a limit is refused with 503 ``rate_limiter_unavailable``
  (``Retry-After: 1``: fail closed, never unlimited); a request without any limit never touches Redis. Redis
  back: the next request is checked again (no restart).
- What counts: requests that reach admission (authenticated, a valid body with a route), checked after
  ``decide`` and before the budget reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ethen.gateway.accounting.accounts import Access, Hold
from ethen.gateway.config import GatewayConfig, RateLimitConfig
from ethen.gateway.errors import (
    RateLimiterUnavailableError,
    RateLimitExceededError,
    SharedStateUnavailableError,
)
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, Requirements

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ethen.gateway.redis_state import SharedState

__all__ = ["Limit", "RateLimits", "Ticket", "estimated_tokens"]

T = TypeVar("T")

#: KEYS: (log, sum) per limit; ARGV: window ms, member id, then (limit, cost) per limit.
#: Returns {1} when admitted, else {0, index of the refusing limit (1-based), ms until it would admit, used}.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = tonumber(ARGV[1])
local n = #KEYS / 2
for i = 1, n do
  local z, s = KEYS[2 * i - 1], KEYS[2 * i]
  local limit, cost = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - win)
  if #old > 0 then
    local freed = 0
    for _, m in ipairs(old) do freed = freed + tonumber(string.match(m, ':(%d+)$')) end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - win)
    redis.call('DECRBY', s, freed)
  end
  local used = tonumber(redis.call('GET', s) or '0')
  if used + cost > limit then
    if cost > limit then return {0, i, win, used} end
    local need, freed = used + cost - limit, 0
    local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
    for j = 1, #entries, 2 do
      freed = freed + tonumber(string.match(entries[j], ':(%d+)$'))
      if freed >= need then return {0, i, tonumber(entries[j + 1]) + win - now, used} end
    end
    return {0, i, win, used}
  end
end
for i = 1, n do
  local z, s = KEYS[2 * i - 1], KEYS[2 * i]
  local cost = tonumber(ARGV[2 + 2 * i])
  redis.call('ZADD', z, now, ARGV[2] .. ':' .. cost)
  redis.call('INCRBY', s, cost)
  redis.call('PEXPIRE', z, win + 1000)
  redis.call('PEXPIRE', s, win + 1000)
end
return {1}
"""

#: KEYS: log, sum; ARGV: member id, old cost, new cost. Replaces the entry's cost while it is in the window.
CORRECT_LUA = """
local old = ARGV[1] .. ':' .. ARGV[2]
local score = redis.call('ZSCORE', KEYS[1], old)
if not score then return 0 end
redis.call('ZREM', KEYS[1], old)
redis.call('ZADD', KEYS[1], score, ARGV[1] .. ':' .. ARGV[3])
redis.call('INCRBY', KEYS[2], tonumber(ARGV[3]) - tonumber(ARGV[2]))
return 1
"""


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit a request counts against: ``bucket`` names its counters (``key:cfg:NAME``, ``key:ID``,
    ``project:NAME``), ``who`` names it in the error message."""

    bucket: str
    kind: str  # "rpm" | "tpm"
    limit: int
    who: str


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: its entry id and the token limits (with the estimate) to correct later."""

    member: str
    tokens: tuple[Limit, ...]
    estimate: int


def estimated_tokens(req: Requirements) -> int:
    """The tokens a request is admitted on: estimated input + ``n`` x ``max_tokens`` (input only if unset)."""
    out = req.choices * req.max_output_tokens if req.max_output_tokens is not None else 0
    return req.input_tokens + out


def _limits(bucket: str, who: str, c: RateLimitConfig | None) -> tuple[Limit, ...]:
    if c is None:
        return ()
    out = []
    if c.rpm is not None:
        out.append(Limit(bucket, "rpm", c.rpm, who))
    if c.tpm is not None:
        out.append(Limit(bucket, "tpm", c.tpm, who))
    return tuple(out)


def _merged(
    configured: tuple[Limit, ...], bucket: str, who: str, rpm: int | None, tpm: int | None
) -> tuple[Limit, ...]:
    """The store's ``rpm`` / ``tpm`` over the config file's limits of the same bucket (the store wins)."""
    out = []
    for kind, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None:
            out.append(Limit(bucket, kind, value, who))
        else:
            out.extend(lim for lim in configured if lim.kind == kind)
    return tuple(out)


class _MemoryLog:
    """The sliding-window log of one limit in process memory (no Redis)."""

    __slots__ = ("by_member", "entries", "used")

    def __init__(self) -> None:
        self.entries: deque[list[Any]] = deque()  # [time, cost, member], oldest first
        self.by_member: dict[str, list[Any]] = {}
        self.used = 0

    def expire(self, now: float, window: float) -> None:
        while self.entries and self.entries[0][0] <= now - window:
            _, cost, member = self.entries.popleft()
            self.used -= cost
            self.by_member.pop(member, None)

    def wait(self, cost: int, limit: int, now: float, window: float) -> float:
        """Seconds until ``cost`` more fits (0: it fits now)."""
        if self.used + cost <= limit:
            return 0.0
        need, freed = self.used + cost - limit, 0
        for t, c, _ in self.entries:
            freed += c
            if freed >= need:
                return float(t + window - now)
        return window


class RateLimits:
    """The rate limits of one gateway process (module docstring). ``shared``: Redis, else process memory."""

    def __init__(self, cfg: GatewayConfig, shared: SharedState | None = None) -> None:
        rl = cfg.rate_limits
        self.window_s = rl.window_s
        self.shared = shared
        self._config_keys = {
            k.name: _limits(f"key:cfg:{k.name}", f"key {k.name!r}", RateLimitConfig(rpm=k.rpm, tpm=k.tpm))
            for k in cfg.api_keys
            if k.rpm is not None or k.tpm is not None
        }
        self._projects = {n: _limits(f"project:{n}", f"project {n!r}", c) for n, c in rl.projects.items()}
        self._keys = {i: _limits(f"key:{i}", f"key {i!r}", c) for i, c in rl.keys.items()}
        self.enabled = bool(self._config_keys or self._projects or self._keys)
        self._memory: dict[str, _MemoryLog] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._admit: Any = None
        self._correct: Any = None
        if shared is not None:
            self._admit = shared.client.register_script(ADMIT_LUA)
            self._correct = shared.client.register_script(CORRECT_LUA)

    def limits_for(self, access: Access) -> tuple[Limit, ...]:
        p = access.principal
        if p is None:
            return self._config_keys.get(access.name, ())
        key, project = self._keys.get(p.key_id, ()), self._projects.get(p.project.name, ())
        if p.rpm is not None or p.tpm is not None:
            key = _merged(key, f"key:{p.key_id}", f"key {p.key_id!r}", p.rpm, p.tpm)
        pp = p.project
        if pp.rpm is not None or pp.tpm is not None:
            project = _merged(project, f"project:{pp.name}", f"project {pp.name!r}", pp.rpm, pp.tpm)
        return key + project

    async def admit(self, access: Access, req: Requirements) -> Ticket | None:
        """Count the request against its limits, or raise :class:`RateLimitExceededError` (429) /
        :class:`RateLimiterUnavailableError` (503). ``None`` when it has no limit (no I/O then)."""
        if not self.enabled and access.principal is None:
            return None
        limits = self.limits_for(access)
        if not limits:
            return None
        est = estimated_tokens(req)
        costs = [1 if lim.kind == "rpm" else est for lim in limits]
        member = uuid.uuid4().hex[:16]
        if self.shared is None:
            refused = self._admit_memory(limits, costs, member)
        else:
            refused = await self._admit_redis(limits, costs, member)
        if refused is not None:
            i, wait_s = refused
            raise self._exceeded(limits[i], costs[i], wait_s)
        return Ticket(member, tuple(lim for lim in limits if lim.kind == "tpm"), est)

    def _exceeded(self, lim: Limit, cost: int, wait_s: float) -> RateLimitExceededError:
        per = "minute" if self.window_s == 60 else f"{self.window_s:g} s"
        what = "requests" if lim.kind == "rpm" else "tokens"
        retry = max(1, math.ceil(wait_s))
        if lim.kind == "tpm" and cost > lim.limit:
            msg = (f"Request too large for {lim.who}: its estimated {cost} tokens exceed the limit of "
                   f"{lim.limit} tokens per {per}. Reduce the input or max_tokens.")
        else:
            msg = (f"Rate limit reached for {lim.who} on {what} per {per}: limit {lim.limit}. "
                   f"Please try again in {retry} s.")
        return RateLimitExceededError(msg, retry, type=what)

    def _admit_memory(
        self, limits: tuple[Limit, ...], costs: list[int], member: str
    ) -> tuple[int, float] | None:
        now, win = time.monotonic(), self.window_s
        logs = []
        for i, lim in enumerate(limits):
            log = self._memory.get(f"{lim.bucket}:{lim.kind}")
            if log is None:
                log = self._memory[f"{lim.bucket}:{lim.kind}"] = _MemoryLog()
            log.expire(now, win)
            if costs[i] > lim.limit:
                return i, win
            wait = log.wait(costs[i], lim.limit, now, win)
            if wait > 0:
                return i, wait
            logs.append(log)
        for log, cost in zip(logs, costs, strict=True):
            entry = [now, cost, member]
            log.entries.append(entry)
            log.by_member[member] = entry
            log.used += cost
        return None

    async def _admit_redis(
        self, limits: tuple[Limit, ...], costs: list[int], member: str
    ) -> tuple[int, float] | None:
        assert self.shared is not None
        keys: list[str] = []
        args: list[Any] = [int(self.window_s * 1000), member]
        for lim, cost in zip(limits, costs, strict=True):
            base = self.shared.key("rl", lim.bucket, lim.kind)
            keys += [base, f"{base}:sum"]
            args += [lim.limit, cost]
        try:
            out = await self.shared.call(lambda r: self._admit(keys=keys, args=args, client=r))
        except SharedStateUnavailableError:
            raise RateLimiterUnavailableError(
                "The gateway cannot check this key's rate limit right now (its shared state is unreachable); "
                "the request was not served. Retry shortly."
            ) from None
        if int(out[0]) == 1:
            return None
        return int(out[1]) - 1, int(out[2]) / 1000

    # --- correcting the token count after the request ----------------------------------------------------

    def correct(self, ticket: Ticket, tokens: int) -> None:
        """Replace the ticket's estimated tokens with ``tokens`` (the usage; 0 if it was not served). With
        Redis the update is sent by a background task (never awaited on the request path)."""
        if not ticket.tokens or tokens == ticket.estimate:
            return
        tokens = max(0, tokens)
        if self.shared is None:
            for lim in ticket.tokens:
                log = self._memory.get(f"{lim.bucket}:{lim.kind}")
                entry = log.by_member.get(ticket.member) if log is not None else None
                if log is not None and entry is not None:
                    log.used += tokens - entry[1]
                    entry[1] = tokens
            return
        task = asyncio.get_running_loop().create_task(self._correct_redis(ticket, tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _correct_redis(self, ticket: Ticket, tokens: int) -> None:
        assert self.shared is not None
        for lim in ticket.tokens:
            base = self.shared.key("rl", lim.bucket, lim.kind)
            keys, args = [base, f"{base}:sum"], [ticket.member, ticket.estimate, tokens]

            def fix(r: Redis, k: list[str] = keys, a: list[Any] = args) -> Awaitable[Any]:
                return self._correct(keys=k, args=a, client=r)  # type: ignore[no-any-return]

            with contextlib.suppress(SharedStateUnavailableError):  # Redis away: the estimate stands
                await self.shared.call(fix)

    def wrap(self, hold: Hold, ticket: Ticket | None) -> Hold:
        """``hold``, correcting the ticket's tokens when it settles (usage) or releases (0)."""
        if ticket is None or not ticket.tokens:
            return hold
        return _CorrectingHold(hold, self, ticket)

    async def aclose(self) -> None:
        """Wait (briefly) for the corrections in flight."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)


class _CorrectingHold(Hold):
    """A budget :class:`~ethen.gateway.accounting.accounts.Hold` that also corrects the rate limiter's token
    count (the served usage, or 0 when released). Delegates every public method to the wrapped hold."""

    def __init__(self, inner: Hold, limits: RateLimits, ticket: Ticket) -> None:
        self._inner = inner
        self._limits = limits
        self._ticket = ticket
        self._corrected = False

    def _fix(self, tokens: int) -> None:
        if not self._corrected:
            self._corrected = True
            self._limits.correct(self._ticket, tokens)

    @property
    def queued(self) -> bool:
        return self._inner.queued

    async def guard(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except BaseException:
            await self.release()
            raise

    async def settle(self, candidate: Candidate, usage: Usage | None) -> None:
        await self.settle_soon(candidate, usage)

    def settle_soon(self, candidate: Candidate, usage: Usage | None) -> Awaitable[None]:
        committed = self._inner.settle_soon(candidate, usage)

        async def wait() -> None:
            try:
                await committed
            finally:
                self._fix(_used(usage, self._ticket))

        return wait()

    async def settle_or_log(self, candidate: Candidate, usage: Usage | None) -> bool:
        try:
            return await self._inner.settle_or_log(candidate, usage)
        finally:
            self._fix(_used(usage, self._ticket))

    async def release(self) -> None:
        try:
            await self._inner.release()
        finally:
            self._fix(0)


def _used(usage: Usage | None, ticket: Ticket) -> int:
    return ticket.estimate if usage is None else usage.prompt_tokens + usage.completion_tokens
