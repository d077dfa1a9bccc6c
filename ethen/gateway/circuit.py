"""Circuit breakers over the telemetry's failing gates, so a recovered provider is routed to again in seconds.

The spec's gate (0 successes over >= 3 recent samples, per provider and per provider/model; and per
provider/model a run of 3 failures after its last success, whatever came before: issue 42; see
``ethen.gateway.routing.telemetry``) would exclude a provider for the whole 300 s telemetry window, with no
request left to show that it recovered. :class:`CircuitBoard` mirrors the gates of each telemetry snapshot
(:meth:`CircuitBoard.sync`): one circuit per tripped gate key, a provider id (``provider_failing``) or a
candidate id ``provider/model`` (``candidate_failing``).

* **open**: the gate trips. The first trial is allowed after ``cooldown_s`` (default 2 s).
* **half-open**: the cool-down elapsed; one trial may go through (at most one in flight per key). A trial is
  either a live request the routing core admitted because no healthy candidate passes (the client named
  that exact model, or every candidate is failing: ``ethen.gateway.routing.circuits``), or an active
  probe the executor sends (a 1-token chat completion through ``Provider.probe``, like LiteLLM's health
  checks), so a provider that has healthy alternatives recovers too.
* a trial that fails re-opens the circuit with the cool-down doubled (capped at ``max_cooldown_s``, default
  10 s); a trial that succeeds records a success sample, which lifts the gate by the spec's own rule
  (successes > 0), and the next sync **closes** the circuit. A circuit also closes when its failures leave
  the window. The cool-down starts again at ``cooldown_s`` for a circuit that opens again after closing.

Choices where the issue is silent: the board follows the telemetry (it never decides a gate itself), so a
process restart or a snapshot built elsewhere cannot disagree with it; probes are recorded in the telemetry
like attempts (a probe's success is the evidence that lifts the gate); transitions (open, trial failed,
closed) are logged once each at WARNING on ``ethen.gateway.circuit`` -- that is the exclusion log, never one
line per excluded request. Time is ``time.monotonic()`` (injectable); the view handed to the core converts
trial times to the request's wall clock.

Several instances (``[shared]`` Redis, :mod:`ethen.gateway.shared`): each process keeps its own board, but
its telemetry holds every instance's outcomes, so a gate tripped by failures seen on one instance opens the
circuit on all of them, and a successful trial anywhere (its success sample, and its "forget the outage's
failures", are shared too) lifts the gate and closes the circuit everywhere at their next sync (the telemetry
reader syncs on every batch it receives). Cool-downs, trial slots and probes stay per process (simple: at
most one trial per circuit per instance; N instances may probe a failing provider N times per cool-down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from ethen.gateway.routing import EMPTY_CIRCUITS, CircuitView, TelemetrySnapshot
from ethen.gateway.routing.policy import FAILING_MIN_SAMPLES, FAILING_STREAK

__all__ = ["CircuitBoard", "Prober"]

log = logging.getLogger("ethen.gateway.circuit")
_HISTORY = 1000  # transitions kept for the dashboard's circuit-state-over-time chart
_WHY = {  # the gates (ethen.gateway.routing.telemetry), as the open log line states them
    "provider_failing": f"0 successes over >= {FAILING_MIN_SAMPLES} recent samples",
    "candidate_failing": f"its last {FAILING_STREAK} recent outcomes failed",
}


@dataclass(slots=True)
class _Circuit:
    reason: str  # provider_failing | candidate_failing
    cooldown_s: float
    trial_at: float  # monotonic time from which a trial may go
    in_flight: bool = False
    recovered: bool = False  # a trial succeeded (the close log says so)


class CircuitBoard:
    """The circuits of one gateway process. ``on_open`` is called (no arguments) when a circuit opens or a
    trial slot becomes free, so the executor can (re)start its probe loop."""

    def __init__(
        self,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(f"need 0 < cooldown_s <= max_cooldown_s, got {cooldown_s}, {max_cooldown_s}")
        self.cooldown_s = float(cooldown_s)
        self.max_cooldown_s = float(max_cooldown_s)
        self.clock = clock
        self.on_open: Callable[[], None] | None = None
        self.circuits: dict[str, _Circuit] = {}
        #: the last transitions, oldest first: (``clock()`` time, key, opened?) (the dashboard's history)
        self.history: deque[tuple[float, str, bool]] = deque(maxlen=_HISTORY)
        self._synced: TelemetrySnapshot | None = None
        self._keys: frozenset[str] = frozenset()
        self._view = EMPTY_CIRCUITS
        self._view_valid_until = -1.0  # monotonic; the cached view is stale from then on

    # --- following the telemetry ------------------------------------------------------------------------

    def sync(self, snapshot: TelemetrySnapshot) -> None:
        """Open a circuit for each newly tripped gate, close those whose gate lifted. O(1) when the snapshot
        is the one already synced (the request path calls this with the cached snapshot)."""
        if snapshot is self._synced:
            return
        self._synced = snapshot
        want = snapshot.failing_providers
        if snapshot.failing_candidates:
            want = want | {f"{p}/{m}" for p, m in snapshot.failing_candidates}
        if want == self._keys:
            return
        now = self.clock()
        opened = False
        for key in want - self._keys:
            reason = "candidate_failing" if "/" in key else "provider_failing"
            self.circuits[key] = _Circuit(reason, self.cooldown_s, now + self.cooldown_s)
            self.history.append((now, key, True))
            opened = True
            log.warning(
                "circuit open: %s excluded from routing (%s: %s); first trial in %.1f s",
                key, reason, _WHY[reason], self.cooldown_s,
            )  # fmt: skip
        for key in self._keys - want:
            c = self.circuits.pop(key)
            self.history.append((now, key, False))
            why = ("a trial succeeded" if c.recovered
                   else "a success was recorded, or its failures left the telemetry window")
            log.warning("circuit closed: %s is routed to again (%s)", key, why)
        self._keys = frozenset(want)
        self._view_valid_until = -1.0
        if opened and self.on_open is not None:
            self.on_open()

    # --- what the routing core sees ---------------------------------------------------------------------

    def view(self, wall_now: datetime) -> CircuitView:
        """Half-open keys and each open circuit's next trial time (on the wall clock of ``wall_now``). Cached
        until the next circuit's cool-down ends or a transition happens."""
        if not self.circuits:
            return EMPTY_CIRCUITS
        now = self.clock()
        if now < self._view_valid_until:
            return self._view
        half_open: list[str] = []
        retry_at: dict[str, datetime] = {}
        valid_until = float("inf")
        for key, c in self.circuits.items():
            if c.in_flight:
                retry_at[key] = wall_now  # a trial is under way: its outcome is seconds away
            elif c.trial_at <= now:
                half_open.append(key)
            else:
                retry_at[key] = wall_now + timedelta(seconds=c.trial_at - now)
                valid_until = min(valid_until, c.trial_at)
        self._view = CircuitView(frozenset(half_open), MappingProxyType(retry_at))
        self._view_valid_until = valid_until
        return self._view

    # --- trials -----------------------------------------------------------------------------------------

    def blocking(self, provider: str, model: str) -> tuple[str, ...]:
        """The open circuits that exclude ``provider/model`` (what a trial of it tries)."""
        return tuple(k for k in (provider, f"{provider}/{model}") if k in self.circuits)

    def ready(self) -> list[str]:
        """Half-open keys with no trial in flight, in a stable order."""
        now = self.clock()
        return sorted(k for k, c in self.circuits.items() if not c.in_flight and c.trial_at <= now)

    def next_trial_in(self) -> float:
        """Seconds until the next open circuit's cool-down ends (0 if one is ready; inf if none is open)."""
        now = self.clock()
        waits = [c.trial_at - now for c in self.circuits.values() if not c.in_flight]
        return max(0.0, min(waits)) if waits else float("inf")

    def acquire(self, keys: Iterable[str]) -> bool:
        """Take the trial slot of every key (all half-open, none in flight), or none of them."""
        now = self.clock()
        cs = [self.circuits.get(k) for k in keys]
        if not cs or any(c is None or c.in_flight or c.trial_at > now for c in cs):
            return False
        for c in cs:
            assert c is not None
            c.in_flight = True
        self._view_valid_until = -1.0
        return True

    def resolve(
        self, keys: Iterable[str], ok: bool | None, *, detail: str = "", request_id: str = ""
    ) -> None:
        """End a trial. ``ok=True``: it succeeded (its success sample closes the circuit at the next sync);
        ``False``: re-open with the cool-down doubled (capped); ``None``: no evidence either way (the request
        itself was refused, or it was cancelled): the slot is free again."""
        now = self.clock()
        freed = False
        for key in keys:
            c = self.circuits.get(key)
            if c is None or not c.in_flight:
                continue
            c.in_flight = False
            freed = True
            if ok is True:
                c.recovered = True
            elif ok is False:
                c.cooldown_s = min(c.cooldown_s * 2, self.max_cooldown_s)
                c.trial_at = now + c.cooldown_s
                log.warning(
                    "circuit %s: trial failed (request %s: %s); next trial in %.1f s",
                    key, request_id or "-", detail or "error", c.cooldown_s,
                )  # fmt: skip
        self._view_valid_until = -1.0
        if freed and self.on_open is not None:
            self.on_open()


class Prober:
    """Active probes through half-open circuits: while any circuit is open, a background task syncs the
    board with the telemetry, takes the trial slot of every ready circuit and runs ``probe(candidate_id,
    keys)`` for the candidate ``target(key)`` names (the executor's; it records the outcome, which ends the
    trial), then sleeps until the next cool-down ends (0.25-1 s: circuits whose failures age out close too).
    At most one trial is in flight per key (probes and live trials share the slot).

    A probe is bounded by ``timeout_s`` (issue 23: before, a probe sent to a hanging upstream held the trial
    slot for the provider's whole request timeout, up to ``total_s`` = 300 s, and with a healthy alternative
    no live request ever takes a trial, so a recovered primary stayed out until its failures left the
    window): past it the trial fails (the cool-down doubles, capped) and the probe is cancelled, so a
    recovered primary gets a probe within ``timeout_s + max_cooldown_s`` of its recovery."""

    def __init__(
        self,
        board: CircuitBoard,
        snapshot: Callable[[], TelemetrySnapshot],
        target: Callable[[str], str | None],
        probe: Callable[[str, tuple[str, ...]], Coroutine[Any, Any, None]],
        *,
        timeout_s: float = 3.0,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"need timeout_s > 0, got {timeout_s}")
        self.board = board
        self.snapshot = snapshot
        self.target = target
        self.probe = probe
        self.timeout_s = float(timeout_s)
        self._loop_task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A circuit opened or a trial slot is free: wake the loop, starting it if needed (no-op outside a
        running event loop)."""
        self._wake.set()
        if self._loop_task is not None and not self._loop_task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._loop_task = loop.create_task(self._run(), name="ethen-circuit-probes")

    async def _run(self) -> None:
        board = self.board
        while board.circuits:
            self._wake.clear()
            board.sync(self.snapshot())
            for key in board.ready():
                cid = self.target(key)
                if cid is None:
                    continue
                provider, _, model = cid.partition("/")
                keys = board.blocking(provider, model)
                if keys and board.acquire(keys):
                    task = asyncio.get_running_loop().create_task(self._bounded(cid, keys))
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)
            # a ready circuit whose probe target is blocked by another circuit stays ready: poll it at 4 Hz
            wait = max(0.25, min(1.0, board.next_trial_in()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _bounded(self, cid: str, keys: tuple[str, ...]) -> None:
        """``probe(cid, keys)``, failed as a trial and cancelled once it took ``timeout_s``."""
        task = asyncio.get_running_loop().create_task(self.probe(cid, keys))
        try:
            done, _ = await asyncio.wait((task,), timeout=self.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return
        # failed before the cancellation: the probe's own handler then finds no trial left to free
        self.board.resolve(keys, False, detail=f"probe of {cid} timed out after {self.timeout_s:g} s")
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def aclose(self) -> None:
        """Cancel the loop and any probe in flight (gateway shutdown)."""
        tasks = [t for t in (self._loop_task, *self._probes) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
