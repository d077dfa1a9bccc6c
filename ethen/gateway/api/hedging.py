"""Hedged requests (issue 27): race a second attempt against a slow first one, keep the first to answer.

The pure decision (when and whether) is :func:`ethen.gateway.routing.hedge.plan_hedge`; this module is the
shell that races. Only a request whose requested model has a ``[[hedges]]`` rule comes here
(:meth:`Hedger.rule_for`); every other request takes :class:`~ethen.gateway.api.execute.Executor`'s plain
fallback loop unchanged (no task, no timer).

How a hedged request runs (:meth:`Hedger.run_buffered`, :meth:`Hedger.open_stream`):

- Each attempt is an asyncio task on one candidate of the decision's ranked chain, in chain order (so a
  hedge is capability-safe exactly like a fallback). A stream attempt has "answered" once it has read its
  first *content* chunk (the chunks before it, e.g. the role-only opening chunk, are kept and replayed to the
  client); a buffered one once its whole body arrived.
- While hedges are left (``max_extra``) and a candidate is left in the chain, a timer runs: ``delays[i]`` ms
  (the plan's delay behind the candidate of the attempt sent last) after that attempt started. When it
  fires, the project's budget must cover a second attempt (the plan's check of the remaining
  budget, then a real second reservation, :meth:`~ethen.gateway.accounting.accounts.Accounts.admit_extra`);
  then the same request goes to the next candidate. Otherwise the hedge is skipped and counted
  (``skipped_budget``, ``skipped_no_next_candidate``) and no other hedge is tried for this request.
- The first attempt to answer wins; every other attempt in flight is cancelled: its task is cancelled, which
  closes its upstream connection (the buffered call's HTTP request is aborted, the stream is closed).
- Composition with fallback: an attempt that fails with a retryable error is recorded like any failed
  attempt; if another attempt is still in flight, that one carries on (it is already the next in line); if
  none is, the next candidate of the chain starts at once (plain fallback), and the hedge timer applies to it
  too. A request-caused 4xx (``UpstreamBadRequestError``) ends the request at once: the other attempts are
  cancelled and no hedge fires afterwards. So with ``max_extra = 1`` at most one hedge is sent per request,
  whatever fallbacks happen.
- Budget: the request's own hold pays for the winner (settled by the pipeline as usual). Each fired hedge
  reserves a second hold of the same amount; a cancelled loser is settled on one of them at what its
  upstream reported, else at its estimated *input* cost (the request's estimated input tokens at the loser's
  input price, ledger row flagged ``estimated``: the upstream has read the prompt; what it generated before
  the cancel is unknown). A failed attempt is not billed (as in plain fallback), and unused extra holds are
  released. If the whole request fails, or its path is cancelled, nothing is settled (all holds released); a
  buffered client that hangs up does not cancel the path (as without hedging), so the race ends and settles.
- Telemetry: the cancelled loser is *not* recorded in the telemetry store (it did not fail, we cancelled it;
  no success either). What is known, that its TTFT exceeded the time it ran, is kept as a censored sample
  (the time it ran) for that candidate's ``after_percentile`` delay, so tail samples that hedging cancels
  keep counting above the delay instead of vanishing; its circuit trial (if any) is freed without a verdict.
  The request log shows it as an attempt with outcome ``cancelled``.
- Receipt (``ethen.routing.hedge``, present whenever a rule applies): ``fired`` (a hedge was sent),
  ``after_ms`` (the delay used; ``null`` when no delay applied), ``winner`` (the candidate that answered),
  ``cancelled`` (candidates cancelled), ``reasons`` (the plan's), and ``skipped`` when the delay passed but
  no hedge could be sent (``budget`` / ``no_next_candidate``).
- Metric ``ethen_gateway_hedges_total{outcome}``: ``fired`` (a hedge sent), ``won`` (a hedge answered first),
  ``lost`` (a hedge was cancelled: the earlier attempt answered first), ``failed`` (a hedge failed with an
  error), ``skipped_budget``, ``skipped_no_next_candidate`` (the delay passed, no hedge sent),
  ``skipped_opt_out`` (``x-ethen-hedge: off``), ``skipped_min_samples`` (no candidate had ``min_samples`` TTFT
  samples). Every outcome is exposed at 0 from the start (``GatewayMetrics.hedging``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ethen.gateway.accounting.hold import Hold
from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.api.execute import BufferedRun, Executor, StreamRun, has_content
from ethen.gateway.api.execute import _Run as _ExecRun
from ethen.gateway.api.record import Attempt, RouteTarget
from ethen.gateway.errors import UpstreamError, UpstreamInvalidResponseError
from ethen.gateway.observation.telemetry_store import TelemetryStore
from ethen.gateway.providers.base import Completion, ProviderStream, UpstreamCall, Usage
from ethen.gateway.routing import Decision
from ethen.gateway.routing.hedge import BUDGET, NO_NEXT, HedgeFacts, HedgePlan, HedgeRule, plan_hedge

__all__ = ["ExtraHold", "Hedger", "opted_out"]

log = logging.getLogger("ethen.gateway.api.execute")
#: reserves the budget of one hedge (``None``: the budget cannot cover it)
ExtraHold = Callable[[], Awaitable[Hold | None]]
#: the request header a client opts out with (``x-ethen-hedge: off``)
HEADER = "x-ethen-hedge"
#: one attempt: ``(target, call, its start) -> result`` (a Completion, or an opened stream)
_Attempt = Callable[[RouteTarget, UpstreamCall, float], Awaitable[Any]]


def opted_out(value: str | None) -> bool:
    """Whether the ``x-ethen-hedge`` header's value opts out (``off``, any case; anything else: no)."""
    return value is not None and value.strip().lower() == "off"


@dataclass(slots=True)
class _Opened:
    """A stream attempt that answered: its stream, the chunks read so far (the last one carries content,
    unless the stream ended first) and its TTFT."""

    stream: ProviderStream
    chunks: list[bytes]
    ttft_s: float | None


class _Replay(ProviderStream):
    """The winner's stream: the chunks read while racing (after the first, which the relay sends itself),
    then the rest of the upstream's; the receipt extras carry the hedge's."""

    def __init__(self, inner: ProviderStream, pending: list[bytes], hedge: Mapping[str, Any]) -> None:
        self.inner = inner
        self.pending = deque(pending)
        self.hedge = dict(hedge)

    async def __anext__(self) -> bytes:
        if self.pending:
            return self.pending.popleft()
        return await self.inner.__anext__()

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def usage(self) -> Usage | None:  # type: ignore[override]
        return self.inner.usage

    @property
    def completed(self) -> bool:  # type: ignore[override]
        return self.inner.completed

    @property
    def receipt_extra(self) -> Mapping[str, Any]:  # type: ignore[override]
        return {**self.inner.receipt_extra, "hedge": self.hedge}


@dataclass(slots=True)
class _Live:
    """One attempt in flight."""

    i: int  # its position in the chain
    target: RouteTarget
    t0: float
    trial: tuple[str, ...]
    task: asyncio.Task[Any]
    hedge: bool  # sent as a hedge


def _fallback(lv: _Live) -> bool:
    """Whether the attempt that answered is a fallback (metric ``ethen_gateway_fallbacks_total``, the
    telemetry record's ``fallback``): a later chain candidate started because an earlier one failed. A hedge
    that won is not: it is counted by ``ethen_gateway_hedges_total{outcome="won"}``."""
    return lv.i > 0 and not lv.hedge


@dataclass(slots=True)
class _Race:
    """One hedged request's state."""

    decision: Decision
    plan: HedgePlan
    rid: str
    stream: bool
    run: _ExecRun = field(default_factory=_ExecRun)
    extras: list[Hold] = field(default_factory=list)
    live: list[_Live] = field(default_factory=list)
    cancelled: list[tuple[_Live, float]] = field(default_factory=list)  # (attempt, ms it ran)
    next_i: int = 0
    fired: int = 0
    after_ms: float | None = None
    skipped: str | None = None
    started: float = field(default_factory=time.perf_counter)

    def receipt(self, winner: str) -> dict[str, Any]:
        out: dict[str, Any] = {"fired": self.fired > 0}
        after = self.after_ms if self.after_ms is not None else self.plan.after_ms
        out["after_ms"] = round(after, 3) if after is not None else None  # always there: the 4 keys
        out["winner"] = winner
        out["cancelled"] = [lv.target.candidate.id for lv, _ in self.cancelled]
        out["reasons"] = list(self.plan.reasons)
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


class Hedger:
    """The ``[[hedges]]`` rules of one gateway and the racing shell (module docstring)."""

    def __init__(
        self, rules: Iterable[HedgeRule], executor: Executor, store: TelemetryStore, *, max_censored: int = 50
    ) -> None:
        self.rules = {r.alias: r for r in rules}
        self.executor = executor
        self.store = store
        self.metrics = executor.metrics
        self.metrics.hedging()
        self.max_censored = max_censored
        #: (provider, model) -> (monotonic time, ms ran) of cancelled losers: censored TTFT samples
        self.censored: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def rule_for(self, decision: Decision) -> HedgeRule | None:
        return self.rules.get(decision.requirements.model)

    def ttft_samples(self, provider: str, model: str, now: float | None = None) -> list[float]:
        """Recent TTFT samples (ms) of one candidate: its successful attempts in the telemetry window (a
        stream's TTFT; a buffered answer's latency, its first byte) plus the censored samples of its cancelled
        hedge losers."""
        now = time.monotonic() if now is None else now
        horizon = now - self.store.window_seconds
        out = [
            r.ttft_ms if r.ttft_ms is not None else r.latency_ms
            for r in self.store.records(provider, model)
            if r.success and r.at > horizon
        ]
        out.extend(ms for at, ms in self.censored.get((provider, model), ()) if at > horizon)
        return out

    def plan(self, rule: HedgeRule, decision: Decision, opt_out: bool, remaining_usd: float | None,
             reserve_usd: float) -> HedgePlan:
        """The plan of one request (the pure core, fed with this gateway's telemetry); counts a plan that
        cannot hedge at all."""
        chain = tuple(sc.id for sc in decision.chain)
        samples: dict[str, list[float]] = {}
        if rule.after_percentile is not None:
            now = time.monotonic()
            for sc in decision.chain[:-1]:
                samples[sc.id] = self.ttft_samples(sc.candidate.provider, sc.candidate.model, now)
        plan = plan_hedge(rule, HedgeFacts(chain, samples, opt_out, remaining_usd, reserve_usd))
        if not plan.enabled:
            for reason in ("opt_out", "min_samples"):
                if reason in plan.reasons:
                    self.metrics.hedges.labels(f"skipped_{reason}").inc()
                    break
        return plan

    # --- racing ---------------------------------------------------------------------------------------

    def _start(self, race: _Race, coro: _Attempt,
               payload: Mapping[str, Any], *, hedge: bool) -> _Live | None:
        """Start the next candidate of the chain whose circuit trial slot is free; ``None`` if none is."""
        chain = race.decision.chain
        while race.next_i < len(chain):
            i = race.next_i
            race.next_i += 1
            sc = chain[i]
            trial = self.executor._trial(race.decision, sc)
            if trial is None:
                continue
            target = self.executor.targets[sc.id]
            t0 = time.perf_counter()
            call = UpstreamCall(payload, target.upstream_model, race.rid)
            task = asyncio.ensure_future(coro(target, call, t0))
            lv = _Live(i, target, t0, trial, task, hedge)
            race.live.append(lv)
            return lv
        return None

    def _has_next(self, race: _Race) -> bool:
        return race.next_i < len(race.decision.chain)

    async def _race(self, race: _Race, payload: Mapping[str, Any], extra: ExtraHold,
                    coro: _Attempt) -> tuple[_Live, Any]:
        """Run attempts until one answers; returns it and its result (the others cancelled)."""
        plan = race.plan
        hedges_left = plan.max_extra if plan.enabled else 0
        last: UpstreamError | None = None
        while True:
            if not race.live and self._start(race, coro, payload, hedge=False) is None:
                raise self.executor._exhausted(race.run, last, race.decision)
            timeout = None
            if hedges_left > 0 and self._has_next(race):
                newest = race.live[-1]  # the delay runs behind the attempt sent last
                delay = plan.delays[newest.i]
                if delay is not None:
                    timeout = max(0.0, newest.t0 + delay / 1000 - time.perf_counter())
            done, _ = await asyncio.wait([lv.task for lv in race.live], timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the delay passed without an answer
                hedges_left = await self._fire(race, payload, extra, coro, hedges_left)
                continue
            for lv in sorted((lv for lv in race.live if lv.task in done), key=lambda lv: lv.i):
                race.live.remove(lv)
                exc = lv.task.exception()
                if exc is None:
                    return lv, lv.task.result()
                if not isinstance(exc, UpstreamError):
                    raise exc
                self.executor._failed(race.run, lv.target, lv.t0, exc, lv.i, race.stream, race.decision,
                                      race.rid, lv.trial)
                if lv.hedge:
                    self.metrics.hedges.labels("failed").inc()
                if not exc.retryable:  # a request-caused 4xx ends everything: no hedge after it
                    raise exc
                last = exc

    async def _fire(self, race: _Race, payload: Mapping[str, Any], extra: ExtraHold, coro: _Attempt,
                    hedges_left: int) -> int:
        """The delay passed: send a hedge if the budget covers it; returns the hedges left."""
        delay = race.plan.delays[race.live[-1].i]
        if race.plan.blocked == BUDGET:
            return self._skip(race, BUDGET)
        hold = await extra()
        if hold is None:
            return self._skip(race, BUDGET)
        if self._start(race, coro, payload, hedge=True) is None:  # every later candidate's trial is taken
            await hold.release()
            return self._skip(race, NO_NEXT)
        race.extras.append(hold)
        race.fired += 1
        if race.after_ms is None:
            race.after_ms = delay
        self.metrics.hedges.labels("fired").inc()
        return hedges_left - 1

    def _skip(self, race: _Race, reason: str) -> int:
        race.skipped = reason
        self.metrics.hedges.labels(f"skipped_{reason}").inc()
        return 0

    async def _stop(self, race: _Race) -> list[_Live]:
        """Cancel every attempt still in flight (its upstream connection is closed), wait for them, and free
        their circuit trials with no verdict; returns them."""
        live, race.live = race.live, []
        for lv in live:
            lv.task.cancel()
        for lv in live:
            with contextlib.suppress(BaseException):
                await lv.task
            if lv.trial:
                self.executor.circuits.resolve(lv.trial, None)
        return live

    async def _cancel_rest(self, race: _Race) -> None:
        """Stop the attempts still in flight: each is a cancelled loser (receipt, censored TTFT, metric)."""
        for lv in await self._stop(race):
            ran = (time.perf_counter() - lv.t0) * 1000
            race.cancelled.append((lv, ran))
            race.run.attempts.append(Attempt(lv.target.candidate.id, "cancelled", ran))
            if lv.hedge:
                self.metrics.hedges.labels("lost").inc()

    async def _settle_losers(self, race: _Race) -> None:
        """Settle each cancelled loser on one extra hold; release the unused ones. Censored samples kept."""
        now = time.monotonic()
        extras = list(race.extras)
        for lv, ran in race.cancelled:
            cand = lv.target.candidate
            ring = self.censored.setdefault((cand.provider, cand.model), deque(maxlen=self.max_censored))
            ring.append((now, ran))
            if extras:
                hold = extras.pop()
                await hold.settle_input_soon(cand, None)
        for hold in extras:
            await hold.release()

    async def _abort(self, race: _Race) -> None:
        """The request failed or was cancelled: stop every attempt, settle nothing, release the extras."""
        await self._stop(race)
        for hold in race.extras:
            await hold.release()

    @staticmethod
    def _served(run: _ExecRun, target: RouteTarget, rid: str) -> None:
        failed = [a for a in run.attempts if a.outcome == "error"]
        if failed:
            log.warning("request %s: served by %s after %d failed attempt(s) (first: %s)",
                        rid, target.candidate.id, len(failed), failed[0].candidate)

    def _won(self, race: _Race, lv: _Live) -> None:
        if race.fired and lv.hedge:
            self.metrics.hedges.labels("won").inc()

    # --- buffered -------------------------------------------------------------------------------------

    async def run_buffered(self, decision: Decision, payload: Mapping[str, Any], rid: str, plan: HedgePlan,
                           extra: ExtraHold) -> BufferedRun:
        race = _Race(decision, plan, rid, stream=False)

        async def attempt(target: RouteTarget, call: UpstreamCall, t0: float) -> Completion:
            return await target.provider.complete(call)

        try:
            lv, comp = await self._race(race, payload, extra, attempt)
            await self._cancel_rest(race)
        except BaseException:
            await self._abort(race)
            raise
        await self._settle_losers(race)
        self._won(race, lv)
        dt = time.perf_counter() - lv.t0
        run = race.run
        run.attempts.append(Attempt(lv.target.candidate.id, "ok", dt * 1000))
        self.executor.record(lv.target, dt, True, None, comp.usage, _fallback(lv), stream=False,
                             trial=lv.trial,
                             request_id=rid)
        self._served(run, lv.target, rid)
        out: dict[str, Any] = dict(comp.receipt_extra)
        if comp.usage is not None:
            out["cost"] = cost_of(lv.target.candidate, comp.usage).to_dict()
        out["hedge"] = race.receipt(lv.target.candidate.id)
        return BufferedRun(comp.body, lv.target, run.attempts, time.perf_counter() - race.started, out,
                           comp.usage)

    # --- stream ---------------------------------------------------------------------------------------

    async def open_stream(self, decision: Decision, payload: Mapping[str, Any], rid: str, plan: HedgePlan,
                          extra: ExtraHold) -> StreamRun:
        race = _Race(decision, plan, rid, stream=True)

        async def attempt(target: RouteTarget, call: UpstreamCall, t0: float) -> _Opened:
            stream = await target.provider.stream(call)
            chunks: list[bytes] = []
            try:
                while True:
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        if not chunks:
                            raise UpstreamInvalidResponseError(
                                f"provider {target.candidate.provider!r} ended the stream without any chunk",
                                target.candidate.provider,
                            ) from None
                        return _Opened(stream, chunks, None)  # ended without content: answered all the same
                    chunks.append(chunk)
                    if has_content(chunk):
                        return _Opened(stream, chunks, time.perf_counter() - t0)
            except BaseException:  # failed or cancelled (a lost race): close the upstream connection
                await stream.aclose()
                raise

        try:
            lv, opened = await self._race(race, payload, extra, attempt)
            await self._cancel_rest(race)
        except BaseException:
            await self._abort(race)
            raise
        await self._settle_losers(race)
        self._won(race, lv)
        run = race.run
        now = time.perf_counter()
        run.attempts.append(Attempt(lv.target.candidate.id, "ok", (now - lv.t0) * 1000))
        self._served(run, lv.target, rid)
        stream = _Replay(opened.stream, opened.chunks[1:], race.receipt(lv.target.candidate.id))
        return StreamRun(opened.chunks[0], stream, lv.target, run.attempts, now - race.started, lv.t0,
                         opened.ttft_s, _fallback(lv), self.executor, trial=lv.trial, request_id=rid)
