"""Fallback execution over a decision's chain, with attempts, telemetry feedback and streaming rules.

- The decision's ranked chain is the fallback chain; every candidate in it already meets the hard requirements
  (the core built it), so falling back can never land on an incompatible model.
- On a retryable :class:`~ethen.gateway.errors.UpstreamError` (connection error, timeout, 429, 5xx, and
  401/403/404 which point at the operator's provider set-up) the next candidate is tried. A request-caused 4xx
  (:class:`~ethen.gateway.errors.UpstreamBadRequestError`) ends the request with that error.
- Streaming: an attempt "succeeds" once its first chunk has been read; until then a failure falls back. The
  first chunk is what reaches the client first, so after it a failure can only end the stream with an error
  event (done by the caller, ``app.py``, through :class:`StreamRun`).
- When the chain is exhausted: a single attempt re-raises its own error; several raise
  :class:`~ethen.gateway.errors.FallbackExhaustedError` listing them.
- Telemetry: each attempt is recorded in the
:class:`~ethen.gateway.observation.telemetry_store.TelemetryStore`
  (latency, TTFT, success, error class, tokens, cost from the candidate's prices, fallback, stream
  completion).
  A request-caused 4xx is *not* recorded as a provider failure: three bad client requests must not exclude a
  healthy provider; nor is a full mesh's refusal (``mesh_saturated``: ``UpstreamError.health_evidence``). A
  client that disconnects mid-stream is recorded as a success with ``stream_completed=False``.
- Gateway-only fields are stripped before the body goes upstream: ``metadata.routing`` (the rest of
  ``metadata`` is kept; ``metadata`` is dropped when nothing is left) and ``providerOptions``.
- Circuits (:mod:`ethen.gateway.circuit`): a decision whose chain is half-open trials (``Decision.trials``)
  takes each candidate's trial slot before calling it and skips it when another trial of the same circuit is
  in flight (none left: 503 ``no_healthy_candidate``); the attempt's outcome ends the trial. With ``probe``
  on, a background task sends a 1-token probe (``Provider.probe``) through each half-open circuit, so a
  provider with healthy alternatives is routed to again too; probes are recorded like attempts.
- Logs (WARNING, logger ``ethen.gateway.api.execute``, one line each, never a message body or credential: the
  request id, the candidate, the error code/class/upstream status): every failed attempt (with what happens
  next: the fallback candidate, or none), a fallback that answered, a probe that failed.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.api.record import Attempt, RouteTarget, cost_usd, failed_attempt
from ethen.gateway.circuit import CircuitBoard, Prober
from ethen.gateway.errors import (
    FallbackExhaustedError,
    NoHealthyCandidateError,
    UpstreamError,
    UpstreamInvalidResponseError,
)
from ethen.gateway.observation.metrics import GatewayMetrics
from ethen.gateway.observation.telemetry_store import AttemptRecord, TelemetryStore
from ethen.gateway.providers.base import ProviderStream, UpstreamCall, Usage
from ethen.gateway.routing import Candidate, Decision, ScoredCandidate

__all__ = [
    "Attempt",
    "BufferedRun",
    "Executor",
    "RouteTarget",
    "StreamRun",
    "chunk_meta",
    "cost_usd",
    "has_content",
    "upstream_payload",
]

log = logging.getLogger("ethen.gateway.api.execute")


def upstream_payload(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body without the gateway-only fields."""
    out = dict(body)
    out.pop("providerOptions", None)
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "routing" in meta:
        rest = {k: v for k, v in meta.items() if k != "routing"}
        if rest:
            out["metadata"] = rest
        else:
            del out["metadata"]
    return out


@dataclass(slots=True)
class _Run:
    attempts: list[Attempt] = field(default_factory=list)
    upstream_s: float = 0.0


@dataclass(slots=True)
class BufferedRun:
    body: dict[str, Any]
    target: RouteTarget
    attempts: list[Attempt]
    upstream_s: float
    receipt_extra: Mapping[str, Any]
    usage: Usage | None = None  # the serving attempt's usage (for spend settlement)


@dataclass(slots=True)
class StreamRun:
    """A stream whose first chunk has been read. The caller sends ``first``, then iterates ``stream`` and
    finally calls :meth:`finish` exactly once."""

    first: bytes
    stream: ProviderStream
    target: RouteTarget
    attempts: list[Attempt]
    upstream_s: float  # upstream time up to the first chunk
    started: float  # perf_counter when the serving attempt started
    ttft_s: float | None  # serving attempt's start to its first content chunk (None until one arrives)
    fallback: bool
    _executor: Executor
    _finished: bool = False
    trial: tuple[str, ...] = ()  # circuit keys this attempt is a trial of (ended by finish)
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # extra answer headers (x-ethen-cache)

    def finish(self, error: UpstreamError | None, *, client_gone: bool = False) -> None:
        """Record the serving attempt's final outcome (once)."""
        if self._finished:
            return
        self._finished = True
        latency = time.perf_counter() - self.started
        ok = error is None
        if error is not None:
            self.attempts[-1] = failed_attempt(self.target.candidate.id, latency * 1000, error)
        else:
            self.attempts[-1] = Attempt(self.target.candidate.id, "ok", latency * 1000)
        self._executor.record(
            self.target,
            latency,
            ok,
            error,
            self.stream.usage,
            self.fallback,
            stream=True,
            ttft_s=self.ttft_s,
            completed=self.stream.completed and not client_gone,
            trial=self.trial,
            request_id=self.request_id,
        )


class Executor:
    """Runs decisions against providers. ``targets`` maps candidate ids to where they execute."""

    def __init__(
        self,
        targets: Mapping[str, RouteTarget],
        store: TelemetryStore,
        metrics: GatewayMetrics,
        circuits: CircuitBoard | None = None,
        *,
        probe: bool = True,
    ):
        self.targets = dict(targets)
        self.store = store
        self.metrics = metrics
        self.circuits = circuits if circuits is not None else CircuitBoard()
        self.probe = probe
        self.prober = Prober(self.circuits, store.snapshot, self._probe_target, self._probe)
        if probe:
            self.circuits.on_open = self.prober.wake

    def record(
        self,
        target: RouteTarget,
        latency_s: float,
        ok: bool,
        error: UpstreamError | None,
        usage: Usage | None,
        fallback: bool,
        *,
        stream: bool,
        ttft_s: float | None = None,
        completed: bool | None = None,
        trial: tuple[str, ...] = (),
        request_id: str = "",
    ) -> None:
        cand = target.candidate
        if fallback:
            self.metrics.fallbacks.labels(cand.provider).inc()
        if error is not None:
            self.metrics.upstream_errors.labels(cand.provider, error.error_class).inc()
            if not error.health_evidence:  # request-caused, or a full mesh (mesh_saturated)
                if trial:  # not evidence about the provider's health; the trial slot is free again
                    self.circuits.resolve(trial, None)
                return
        at = time.monotonic()
        self.store.record(
            AttemptRecord(
                provider=cand.provider,
                model=cand.model,
                at=at,
                latency_ms=latency_s * 1000,
                success=ok,
                ttft_ms=ttft_s * 1000 if ttft_s is not None else None,
                error_class=error.error_class if error is not None else None,
                prompt_tokens=usage.prompt_tokens if usage else None,
                completion_tokens=usage.completion_tokens if usage else None,
                cost_usd=cost_usd(cand, usage),
                fallback=fallback,
                stream=stream,
                stream_completed=completed,
            )
        )
        if trial:
            detail = f"{error.code}, {error.error_class}" if error is not None else ""
            self.circuits.resolve(trial, ok, detail=detail, request_id=request_id)
            if ok:  # the outage is over: its failures stop counting (telemetry_store.forget_failures)
                self._forget_outage(cand, trial, at)
        if trial or not ok:  # a failure may trip a gate, a trial's success lifts one: open/close now
            self.circuits.sync(self.store.snapshot())

    def _forget_outage(self, cand: Candidate, trial: tuple[str, ...], at: float) -> None:
        """After a successful trial: the failures of the tried candidate, and for a provider circuit those of
        each of its models without an open circuit of its own, recorded before the trial, stop counting."""
        models = {cand.model}
        if cand.provider in trial:
            own = self.circuits.circuits
            models.update(m for m in self.store.models_of(cand.provider) if f"{cand.provider}/{m}" not in own)
        for m in models:
            self.store.forget_failures(cand.provider, m, at - 1e-9)

    def _failed(
        self,
        run: _Run,
        target: RouteTarget,
        t0: float,
        exc: UpstreamError,
        i: int,
        stream: bool,
        decision: Decision,
        request_id: str,
        trial: tuple[str, ...],
    ) -> None:
        dt = time.perf_counter() - t0
        run.upstream_s += dt
        run.attempts.append(failed_attempt(target.candidate.id, dt * 1000, exc))
        self.record(
            target, dt, False, exc, None, i > 0, stream=stream, completed=False if stream else None,
            trial=trial, request_id=request_id,
        )  # fmt: skip
        if not exc.retryable:
            then = "not retried (the request caused it)"
        elif i + 1 < len(decision.chain):
            then = f"falling back to {decision.chain[i + 1].id}"
        else:
            then = "no candidate left"
        status = f", upstream status {exc.upstream_status}" if exc.upstream_status is not None else ""
        log.warning(
            "request %s: attempt %d on %s failed: %s (%s%s); %s",
            request_id, i + 1, target.candidate.id, exc.code, exc.error_class, status, then,
        )  # fmt: skip

    def _trial(self, decision: Decision, sc: ScoredCandidate) -> tuple[str, ...] | None:
        """The circuit keys ``sc`` is a trial of (``()`` if none); ``None`` when its trial slot is taken."""
        keys = decision.trials.get(sc.id, ()) if decision.trials else ()
        if keys and not self.circuits.acquire(keys):
            return None
        return keys

    def _served(self, run: _Run, target: RouteTarget, request_id: str) -> None:
        if len(run.attempts) > 1:
            log.warning(
                "request %s: served by fallback %s after %d failed attempt(s) (first: %s)",
                request_id, target.candidate.id, len(run.attempts) - 1, run.attempts[0].candidate,
            )  # fmt: skip

    def _exhausted(self, run: _Run, last: UpstreamError | None, decision: Decision) -> Exception:
        if not run.attempts:  # every candidate was a trial whose circuit already has one in flight
            return NoHealthyCandidateError(
                f"every candidate that can serve {decision.requirements.model!r} is excluded by recent "
                "failures of its provider, and a trial request is already under way; retry in 1 s",
                decision.rejected,
                1,
            )
        if last is not None and len(run.attempts) == 1:
            return last
        summary = "; ".join(f"{a.candidate}: {a.code}" for a in run.attempts)
        return FallbackExhaustedError(
            f"all {len(run.attempts)} candidates of the fallback chain failed ({summary})",
            tuple(a.to_dict() for a in run.attempts),
        )

    async def run_buffered(
        self, decision: Decision, payload: Mapping[str, Any], request_id: str
    ) -> BufferedRun:
        run = _Run()
        last: UpstreamError | None = None
        for i, sc in enumerate(decision.chain):
            trial = self._trial(decision, sc)
            if trial is None:
                continue
            target = self.targets[sc.id]
            call = UpstreamCall(payload, target.upstream_model, request_id)
            t0 = time.perf_counter()
            try:
                comp = await target.provider.complete(call)
            except UpstreamError as exc:
                self._failed(run, target, t0, exc, i, False, decision, request_id, trial)
                if not exc.retryable:
                    raise
                last = exc
                continue
            except BaseException:  # cancelled (client gone): no evidence, free the trial slot
                if trial:
                    self.circuits.resolve(trial, None)
                raise
            dt = time.perf_counter() - t0
            run.upstream_s += dt
            run.attempts.append(Attempt(sc.id, "ok", dt * 1000))
            self.record(
                target, dt, True, None, comp.usage, i > 0, stream=False, trial=trial, request_id=request_id
            )
            self._served(run, target, request_id)
            extra = comp.receipt_extra
            if comp.usage is not None:  # the price breakdown rides on the receipt
                extra = {**extra, "cost": cost_of(target.candidate, comp.usage).to_dict()}
            return BufferedRun(
                comp.body, target, run.attempts, run.upstream_s, extra, comp.usage
            )
        raise self._exhausted(run, last, decision)

    async def open_stream(self, decision: Decision, payload: Mapping[str, Any], request_id: str) -> StreamRun:
        run = _Run()
        last: UpstreamError | None = None
        for i, sc in enumerate(decision.chain):
            trial = self._trial(decision, sc)
            if trial is None:
                continue
            target = self.targets[sc.id]
            call = UpstreamCall(payload, target.upstream_model, request_id)
            t0 = time.perf_counter()
            stream: ProviderStream | None = None
            try:
                stream = await target.provider.stream(call)
                try:
                    first = await stream.__anext__()
                except StopAsyncIteration:
                    raise UpstreamInvalidResponseError(
                        f"provider {target.candidate.provider!r} ended the stream without any chunk",
                        target.candidate.provider,
                    ) from None
            except UpstreamError as exc:
                if stream is not None:
                    await stream.aclose()
                self._failed(run, target, t0, exc, i, True, decision, request_id, trial)
                if not exc.retryable:
                    raise
                last = exc
                continue
            except BaseException:  # cancelled (client gone): no evidence, free the trial slot
                if trial:
                    self.circuits.resolve(trial, None)
                raise
            ttft = time.perf_counter() - t0
            run.upstream_s += ttft
            run.attempts.append(Attempt(sc.id, "ok", ttft * 1000))
            self._served(run, target, request_id)
            return StreamRun(
                first, stream, target, run.attempts, run.upstream_s, t0, ttft if has_content(first) else None,
                i > 0, self, trial=trial,
                request_id=request_id,
            )  # fmt: skip
        raise self._exhausted(run, last, decision)

    # --- active probes through half-open circuits (scheduled by circuit.Prober) ----------------------

    def _probe_target(self, key: str) -> str | None:
        """The candidate to probe circuit ``key`` with: that candidate, or for a provider the first of its
        candidates (by id) whose own circuit is closed, else its first."""
        if "/" in key:
            return key if key in self.targets else None
        mine = sorted(cid for cid, t in self.targets.items() if t.candidate.provider == key)
        healthy = [cid for cid in mine if cid not in self.circuits.circuits]
        pick = healthy or mine
        return pick[0] if pick else None

    async def _probe(self, candidate_id: str, keys: tuple[str, ...]) -> None:
        target = self.targets[candidate_id]
        rid = f"probe-{uuid.uuid4().hex[:16]}"
        t0 = time.perf_counter()
        try:
            await target.provider.probe(target.upstream_model, rid)
        except UpstreamError as exc:
            self.record(
                target, time.perf_counter() - t0, False, exc, None, False, stream=False, trial=keys,
                request_id=rid,
            )  # fmt: skip
            return
        except BaseException as exc:  # cancelled at shutdown, or a provider bug: no evidence either way
            self.circuits.resolve(keys, None)
            if not isinstance(exc, Exception):
                raise
            log.warning("probe %s of %s failed unexpectedly: %s", rid, candidate_id, type(exc).__name__)
            return
        dt = time.perf_counter() - t0
        self.record(target, dt, True, None, None, False, stream=False, trial=keys, request_id=rid)

    async def aclose(self) -> None:
        """Stop the probes (gateway shutdown)."""
        await self.prober.aclose()


#: a stream chunk carrying content: a non-empty ``content`` / ``refusal`` string or a ``tool_calls`` entry
#: (a role-only opening chunk, ``"content": ""``, does not match)
_CONTENT = re.compile(rb'"(?:content|refusal)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*\{')


def has_content(payload: bytes) -> bool:
    """Whether a stream chunk carries content (time to first token is timed to the first such chunk)."""
    return _CONTENT.search(payload) is not None


def chunk_meta(first: bytes) -> dict[str, Any]:
    """``id``/``created``/``model`` of a stream's first chunk (for the gateway's terminal chunk)."""
    try:
        obj = json.loads(first)
    except ValueError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    return {
        "id": obj.get("id") if isinstance(obj.get("id"), str) else "chatcmpl-ethen",
        "created": obj.get("created") if isinstance(obj.get("created"), int) else int(time.time()),
        "model": obj.get("model") if isinstance(obj.get("model"), str) else "",
    }
