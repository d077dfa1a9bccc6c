"""State several gateway instances share through Redis (``[shared] redis_url``): the one Redis boundary.

Several ``ethen gateway`` processes (on one host with ``--workers N``, or on several hosts) serve one config
and one database. Budgets, keys and project policy stay exact through the database
(``ethen.store.admission``); Redis carries the *hot* state that would otherwise be per process:

- **Telemetry** (:class:`TelemetryBus`): every attempt outcome a process records
  (:meth:`~ethen.gateway.observation.telemetry_store.TelemetryStore.record`: latency, TTFT, success, tokens,
  cost) and
  every "forget the outage's failures" of a circuit closing after a successful trial is appended to a
  Redis stream (``<key_prefix>:telemetry``, capped at ~20,000 entries), batched: the request path only
  appends to a list; a background task sends what gathered every 50 ms in one ``XADD``. Each instance reads
  the stream (a blocking ``XREAD`` on its own connection) and records the other instances' outcomes into its
  own store, converted to its own clock. So the spec's failing gate (0 successes over >= 3 recent samples,
  or a candidate's last 3 outcomes failed: runs are counted by finish time, so records arriving late from
  other instances land in place) that trips on one instance trips on all of them within ~0.1 s, the circuits
  (:mod:`ethen.gateway.circuit`, which follow the telemetry) open and close everywhere (a success recorded
  anywhere lifts the gate everywhere), and canary acceptance (computed from the telemetry snapshot)
  counts every instance's samples. An instance that starts reads the last telemetry window (300 s) from
  the stream first, so a restarted instance does not route blind.
- **Rate limits** (:mod:`ethen.gateway.accounting.ratelimit`): atomic Lua scripts over Redis keys, exact
across
  instances.

Redis unreachable (connection refused, timeout, any redis-py error): :class:`SharedState` maps the error to
:class:`~ethen.gateway.errors.SharedStateUnavailableError` at this one boundary and logs one WARNING per
outage (and one when Redis answers again). Then budgets and keys are unaffected (database); a request of a
key or project *with* a rate limit is refused with 503 ``rate_limiter_unavailable`` (fail closed), keys
without a limit are served; telemetry degrades to local (outcomes made during the outage are not shared).
Redis back: the next call reconnects (no restart), the reader resumes from the last entry it read.

Choices where the issue is silent: a stream rather than pub/sub (a reader that was away catches up, and a
new instance reads the recent window); Redis server time is not used for telemetry (records carry their
wall-clock finish time: keep hosts on NTP); one Redis, not a cluster (the rate-limit scripts touch several
keys of one request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from ethen.gateway.accounting.ratelimit import RateLimits
from ethen.gateway.config import GatewayConfig, shared_redis_url
from ethen.gateway.errors import SharedStateUnavailableError
from ethen.gateway.observation.telemetry_store import AttemptRecord, TelemetryStore
from ethen.gateway.redis_state import SharedState

if TYPE_CHECKING:
    from ethen.gateway.circuit import CircuitBoard

__all__ = ["SharedRuntime", "SharedState", "TelemetryBus"]

log = logging.getLogger("ethen.gateway.shared")


def _wall(at_monotonic: float, now_mono: float, now_wall: float) -> float:
    return now_wall - (now_mono - at_monotonic)


class TelemetryBus:
    """Publishes this process's telemetry to a Redis stream and records the other instances' (module
    docstring). ``on_remote`` runs after each batch of remote outcomes is recorded (the app syncs its
    circuits with the new snapshot there)."""

    def __init__(
        self,
        shared: SharedState,
        store: TelemetryStore,
        on_remote: Callable[[], None] | None = None,
        *,
        batch_s: float = 0.05,
        maxlen: int = 20_000,
        max_pending: int = 10_000,
    ) -> None:
        self.shared = shared
        self.store = store
        self.on_remote = on_remote
        self.batch_s = batch_s
        self.maxlen = maxlen
        self.max_pending = max_pending
        self.stream = shared.key("telemetry")
        self._pending: list[list[Any]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.published = self.received = self.dropped = 0
        self._bad_logged = False

    # --- the request path: append only ------------------------------------------------------------------

    def publish(self, rec: AttemptRecord) -> None:
        """Queue one local outcome (no I/O here: the flusher sends it within ``batch_s``)."""
        wall = _wall(rec.at, time.monotonic(), time.time())
        self._queue([
            "a", rec.provider, rec.model, round(wall, 4), round(rec.latency_ms, 3), rec.success,
            rec.ttft_ms, rec.error_class, rec.prompt_tokens, rec.completion_tokens, rec.cost_usd,
            rec.fallback, rec.stream, rec.stream_completed,
        ])  # fmt: skip

    def publish_forget(self, provider: str, model: str, before: float, since: float | None) -> None:
        """Queue a "forget the outage's failures": those that finished after ``since`` (the last success
        before the outage; ``None``: none) and at or before ``before``."""
        mono, wall = time.monotonic(), time.time()
        start = None if since is None else round(_wall(since, mono, wall), 4)
        self._queue(["f", provider, model, round(_wall(before, mono, wall), 4), start])

    def _queue(self, item: list[Any]) -> None:
        if len(self._pending) >= self.max_pending:  # Redis slow or away: keep the newest
            del self._pending[: len(self._pending) // 2]
        self._pending.append(item)
        self._wake.set()

    # --- background tasks -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flusher(), name="ethen-telemetry-publish"),
            loop.create_task(self._reader(), name="ethen-telemetry-read"),
        ]

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks = []
        if self._pending:  # the last outcomes, best effort (bounded by the call's timeout)
            with contextlib.suppress(SharedStateUnavailableError):
                await self._send()

    async def _send(self) -> None:
        batch, self._pending = self._pending, []
        fields = {"i": self.shared.instance_id, "r": json.dumps(batch, separators=(",", ":"))}
        try:
            await self.shared.call(
                lambda r: r.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            )
        except SharedStateUnavailableError:
            self.dropped += len(batch)  # outcomes made while Redis is away stay local
            raise
        self.published += len(batch)

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.batch_s)  # gather a batch
            self._wake.clear()
            if not self._pending:
                continue
            try:
                await self._send()
            except SharedStateUnavailableError:
                await asyncio.sleep(0.5)

    async def _reader(self) -> None:
        # start a telemetry window back: a (re)started instance learns the recent outcomes at once
        last = f"{max(0, int((time.time() - self.store.window_seconds) * 1000))}-0"
        pause = 0.25
        while True:
            try:
                got = await self.shared.call(self._read_from(last), blocking=True)
            except SharedStateUnavailableError:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            pause = 0.25
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    self._ingest(fields)
                if entries and self.on_remote is not None:
                    self.on_remote()

    def _read_from(self, last: str) -> Callable[[Redis], Awaitable[Any]]:
        def read(r: Redis) -> Awaitable[Any]:
            return r.xread({self.stream: last}, count=1000, block=1000)

        return read

    def _ingest(self, fields: Mapping[bytes, bytes]) -> None:
        sender = fields.get(b"i", b"").decode()
        if sender == self.shared.instance_id:
            return
        now_mono, now_wall = time.monotonic(), time.time()
        try:
            items = json.loads(fields[b"r"])
            for it in items:
                # a remote finish time, on this process's monotonic clock (never in its future)
                at = now_mono - max(0.0, now_wall - float(it[3]))
                if it[0] == "a":
                    self.store.record_remote(AttemptRecord(
                        provider=str(it[1]), model=str(it[2]), at=at, latency_ms=float(it[4]),
                        success=bool(it[5]), ttft_ms=it[6], error_class=it[7], prompt_tokens=it[8],
                        completion_tokens=it[9], cost_usd=it[10], fallback=bool(it[11]), stream=bool(it[12]),
                        stream_completed=it[13],
                    ))  # fmt: skip
                elif it[0] == "f":  # an entry of an older version has no start: every failure before
                    start = it[4] if len(it) > 4 else None
                    since = None if start is None else now_mono - max(0.0, now_wall - float(start))
                    self.store.forget_remote(str(it[1]), str(it[2]), at, since)
                self.received += 1
        except (KeyError, IndexError, TypeError, ValueError):
            if not self._bad_logged:  # another version of the gateway, or something else writing the stream
                log.warning("ignoring a malformed telemetry entry on %s (from %r)", self.stream, sender)
                self._bad_logged = True


class SharedRuntime:
    """What the app starts and stops: the Redis connection and telemetry bus (with ``[shared]``) and the rate
    limiter (Redis-backed with ``[shared]``, per-process memory without)."""

    def __init__(self, state: SharedState | None, bus: TelemetryBus | None, limits: RateLimits) -> None:
        self.state = state
        self.bus = bus
        self.limits = limits

    @classmethod
    def for_gateway(
        cls,
        circuits: CircuitBoard,
        store: TelemetryStore,
        cfg: GatewayConfig,
        env: Mapping[str, str] | None = None,
    ) -> SharedRuntime:
        url = shared_redis_url(cfg, env)
        state = bus = None
        if url is not None:
            assert cfg.shared is not None
            state = SharedState(url, key_prefix=cfg.shared.key_prefix, timeout_s=cfg.shared.timeout_s)

            def sync_circuits() -> None:  # remote outcomes may trip or lift a gate: open/close circuits now
                circuits.sync(store.snapshot())

            bus = TelemetryBus(state, store, sync_circuits)
            store.on_record = bus.publish
            store.on_forget = bus.publish_forget
        return cls(state, bus, RateLimits(cfg, state))

    async def start(self) -> None:
        if self.state is None:
            return
        try:
            await self.state.call(lambda r: r.ping())
            log.info("shared state: redis reachable, instance %s", self.state.instance_id)
        except SharedStateUnavailableError:
            pass  # logged; the gateway serves (degraded) and recovers when Redis answers
        if self.bus is not None:
            await self.bus.start()

    async def aclose(self) -> None:
        await self.limits.aclose()
        if self.bus is not None:
            await self.bus.aclose()
        if self.state is not None:
            await self.state.aclose()
