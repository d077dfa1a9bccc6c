"""The request path every generation endpoint shares: auth -> parse -> decide -> admit -> executor -> settle.

``POST /chat/completions`` and ``POST /responses`` (:mod:`ethen.gateway.api.responses`) both run through one
:class:`Pipeline`; only the body translation before it and the answer's shape after it differ, so the same
requirements, fallback chain, budgets (reserve and settle), telemetry, metrics and receipt apply to both.

- :meth:`Pipeline.admit` authenticates, reads and parses the body, applies an optional ``translate`` (the
  Responses body becomes a chat-completions body), checks ``stream`` / ``stream_options``, decides and
  reserves the estimated cost. It fills a :class:`Call` as it goes, so a failure still has the model label
  and stream flag the metrics need.
- :meth:`Pipeline.run_buffered` (it renders the answer while the spend's ledger entry commits, and returns
  once committed: durable spend before the answer leaves) and :meth:`Pipeline.open_stream` run the executor
  under the budget hold.
- :meth:`Pipeline.failed` turns a :class:`~ethen.gateway.errors.GatewayError` into the OpenAI error envelope
  and counts it.
- Every finished request (:meth:`Pipeline.served`, :meth:`Pipeline.failed`, and a stream's end through
  :meth:`Pipeline.stream_end`) hands one :class:`~ethen.gateway.observation.requestlog.RequestRecord` to the
  request log (an append to its queue; the writer task does the rest).

Shadow evaluation (issue 27, :mod:`ethen.gateway.api.shadow`): for an alias with ``[[shadows]]`` rules,
:meth:`Pipeline.served` (buffered) and the stream's end hand the served answer to the shadow runner, which
starts the sampled shadow calls in the background; a sampled stream's chunks are kept while relayed (for the
comparison). Nothing of it runs before the client's answer is produced.

The app passes in its body reader, ``stream`` checker, error-response builder and request-id reader (they
live in :mod:`ethen.gateway.api.app`), which keeps this module free of an import cycle with it; of the
gateway's
state the pipeline sees :class:`RequestPath` only (executor, rate limits, metrics, request log, routing
context and model label).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from ethen.gateway.accounting.accounts import Access, Accounts, Hold
from ethen.gateway.accounting.auth import authorization
from ethen.gateway.accounting.hold import max_cost_usd
from ethen.gateway.accounting.pricing import Cost
from ethen.gateway.api.execute import Attempt, BufferedRun, Executor, RouteTarget, StreamRun, upstream_payload
from ethen.gateway.api.hedging import HEADER as HEDGE_HEADER
from ethen.gateway.api.hedging import Hedger, opted_out
from ethen.gateway.api.prompt_memory import PrefixSeen, PromptMemory
from ethen.gateway.api.record import RequestRecord, routing_receipt
from ethen.gateway.api.shadow import Primary, ShadowRequest, ShadowRunner
from ethen.gateway.api.sse import dumps
from ethen.gateway.cache import CacheCall, RecordingStream, ReplayStream, ResponseCache
from ethen.gateway.errors import (
    FallbackExhaustedError,
    GatewayError,
    NoHealthyCandidateError,
    UpstreamBadRequestError,
    UpstreamError,
    http_status,
)
from ethen.gateway.providers.anthropic_native import NativeAnswer, NativeBody
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, Decision, ProjectPolicy
from ethen.gateway.routing.hedge import HedgePlan

if TYPE_CHECKING:
    from ethen.gateway.accounting.ratelimit import RateLimits
    from ethen.gateway.api.relay import StreamRelay
    from ethen.gateway.observation.metrics import GatewayMetrics
    from ethen.gateway.observation.requestlog import RequestLog
    from ethen.gateway.routing import RoutingContext

__all__ = ["Call", "Pipeline", "RequestPath", "routing_receipt"]

log = logging.getLogger("ethen.gateway")

BodyReader = Callable[[Request], Awaitable[dict[str, Any]]]
StreamCheck = Callable[[Mapping[str, Any]], tuple[bool, bool]]
ErrorResponse = Callable[[GatewayError, str], Response]
RequestId = Callable[[Request], str]
Translate = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(slots=True)
class Call:
    """One request on its way through the pipeline (filled step by step)."""

    rid: str
    t0: float  # perf_counter at arrival
    body: dict[str, Any] | None = None  # the chat-completions body (after translation)
    stream: bool = False
    include_usage: bool = False
    decision: Decision | None = None
    payload: dict[str, Any] | None = None  # the body as sent upstream (gateway-only fields stripped)
    hold: Hold | None = None
    label: str = "other"
    wall: float = 0.0  # wall clock at arrival (the request log's time)
    endpoint: str = "chat"
    access: Access | None = None
    decided_s: float | None = None  # arrival -> decision (the request log's route span)
    admitted_s: float | None = None  # arrival -> admitted
    remaining_usd: float | None = None  # the project's remaining budget as admission saw it
    res: BufferedRun | None = None
    trace_headers: tuple[str, str | None] | None = None  # (traceparent, tracestate) when traces are on
    notes: dict[str, Any] = field(default_factory=dict)  # the endpoint's receipt notices (dropped_tools)
    cache: CacheCall | None = None  # the response cache's verdict, key and entry (issue 27)
    hedge: HedgePlan | None = None  # issue 27: set when a [[hedges]] rule applies (ethen.gateway.api.hedging)
    policy: ProjectPolicy | None = None  # the caller's effective policy (a shadow respects its allow-lists)
    shadow_chunks: list[bytes] | None = None  # issue 27: a sampled stream's chunks, once it completed
    prefix: PrefixSeen | None = None  # issue 45: the prompt's hash and who holds it in a prompt cache

    def with_notes(self, extra: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """A provider's receipt extras plus this call's notices (on the answer and in the request log)."""
        return {**(extra or {}), **self.notes} if self.notes else extra

    def receipt(
        self, attempts: list[Attempt], served: RouteTarget | None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        assert self.decision is not None
        return routing_receipt(self.decision, attempts, served, self.with_notes(extra))


def _kept(body: dict[str, Any]) -> bytes:
    """A buffered answer as the cache keeps it: its JSON; a native Anthropic answer (a chat translation
    carrying the upstream's Message) as ``{"ethen_native_answer": [chat, message]}``."""
    if isinstance(body, NativeAnswer):
        return dumps({_NATIVE: [dict(body), body.message]})
    return dumps(body)


#: the receipt's ``cost`` of a cache hit (issue 27: "a hit costs nothing"): no upstream call, no ledger row
_HIT_COST = Cost(0.0, 0.0, 0.0, Usage(0, 0), "cache").to_dict()


def _field(lines: list[str]) -> str | None:
    """A header sent as several field lines is one comma-separated list (RFC 9110 5.3): a ``no-store`` in
    the second ``Cache-Control`` line counts as much as in the first."""
    return ", ".join(lines) if lines else None


def _hit(call: Call) -> bool:
    return call.cache is not None and call.cache.entry is not None


def _answer(raw: bytes) -> dict[str, Any]:
    """The answer :func:`_kept` stored, as the executor returned it."""
    out: dict[str, Any] = json.loads(raw)
    native = out.get(_NATIVE) if len(out) == 1 else None
    if isinstance(native, list) and len(native) == 2:
        return NativeAnswer(native[0], native[1])
    return out


_NATIVE = "ethen_native_answer"


class RequestPath(Protocol):
    """What the request path reads of a gateway (:class:`~ethen.gateway.state.Gateway` is one): the
    endpoints and the pipeline see this, not the whole runtime state."""

    @property
    def executor(self) -> Executor: ...
    @property
    def limits(self) -> RateLimits: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def requestlog(self) -> RequestLog: ...
    @property
    def cache(self) -> ResponseCache | None: ...
    @property
    def hedger(self) -> Hedger | None: ...
    @property
    def shadows(self) -> ShadowRunner | None: ...
    @property
    def prompt_memory(self) -> PromptMemory: ...

    def context(self, request_id: str) -> RoutingContext: ...

    def label(self, body: Mapping[str, Any] | None) -> str: ...


class Pipeline:
    """The shared request path of one gateway (built once by ``gateway_app``)."""

    def __init__(
        self,
        gw: RequestPath,
        acc: Accounts,
        read_body: BodyReader,
        stream_check: StreamCheck,
        error_response: ErrorResponse,
        request_id: RequestId,
    ) -> None:
        self.gw = gw
        self.acc = acc
        self.read_body = read_body
        self.stream_check = stream_check
        self.error_response = error_response
        self.request_id = request_id

    def start(self, request: Request) -> Call:
        """A new call: its arrival time and request id (the client's ``x-request-id`` when valid)."""
        path = request.scope["path"]
        endpoint = "chat" if path.endswith("/chat/completions") else path.rpartition("/")[2]
        call = Call(self.request_id(request), time.perf_counter(), wall=time.time(), endpoint=endpoint)
        if self.gw.requestlog.tracing is not None:  # join the caller's trace (W3C Trace Context)
            parent = request.headers.get("traceparent")
            if parent is not None:
                call.trace_headers = (parent, request.headers.get("tracestate"))
        return call

    async def admit(self, call: Call, request: Request, translate: Translate | None = None) -> Call:
        """Auth, parse (+ ``translate``), stream options, decide, reserve. Raises ``GatewayError``."""
        acc, gw = self.acc, self.gw
        access = call.access = await acc.authenticate(authorization(request.headers))
        body = sent = await self.read_body(request)
        if translate is not None:
            call.body = body  # labels a refused Responses body by its model too
            body = translate(body)
        call.body = body
        call.stream, call.include_usage = self.stream_check(body)
        ctx = await acc.prepare(access, body, gw.context(call.rid))
        project = access.project
        scope = f"project:{project.name}" if project is not None else f"config:{access.name}"
        call.prefix = await gw.prompt_memory.lookup(scope, body)
        if call.prefix is not None and call.prefix.cached:  # issue 45: cache-aware cost
            ctx = dataclasses.replace(ctx, cached=call.prefix.cached)
        call.remaining_usd = ctx.policy.remaining_budget_usd
        call.policy = ctx.policy
        call.decision = acc.decide(body, ctx, access)
        call.decided_s = time.perf_counter() - call.t0
        call.label = gw.label(body)
        call.payload = upstream_payload(body)
        if gw.cache is not None and await self._cached(
            call, request, access, gw.cache, sent if translate is not None else None
        ):
            return call  # a hit: no rate limit, no budget hold (it costs nothing)
        ticket = await gw.limits.admit(access, call.decision.requirements)  # rpm/tpm: accounting.ratelimit
        hold = await acc.admit(access, call.decision, call.rid)  # reserves the estimated cost
        call.hold = gw.limits.wrap(hold, ticket)
        hedger = gw.hedger
        if hedger is not None:  # issue 27: only an alias with a [[hedges]] rule pays for this
            rule = hedger.rule_for(call.decision)
            if rule is not None:
                d = call.decision
                reserve = max(max_cost_usd(sc.candidate, d.requirements) for sc in d.chain)
                opt_out = opted_out(request.headers.get(HEDGE_HEADER))
                call.hedge = hedger.plan(rule, d, opt_out, call.remaining_usd, reserve)
        call.admitted_s = time.perf_counter() - call.t0
        return call

    async def _cached(self, call: Call, request: Request, access: Access, cache: ResponseCache,
                      sent: Mapping[str, Any] | None) -> bool:
        """Consult the response cache (issue 27): set ``call.cache`` and the receipt's ``cache``; on a hit
        (an entry of the same kind whose candidate is still in the decision's chain) give the call a hold
        that settles nothing and return True. ``sent``: the client's body before translation."""
        assert call.body is not None and call.payload is not None and call.decision is not None
        project = access.project
        scope = f"project:{project.name}" if project is not None else f"config:{access.name}"
        headers = request.headers
        cc = call.cache = cache.consult(scope, call.endpoint, call.body, call.payload,
                                        _field(headers.getlist("cache-control")),
                                        _field(headers.getlist("pragma")), sent,
                                        headers.get("anthropic-beta"))
        chain = {sc.id for sc in call.decision.chain}
        stream = call.stream
        entry = await cache.lookup(cc, lambda e: e.stream == stream and e.candidate in chain)
        call.notes["cache"] = cc.receipt()
        if entry is None:
            return False
        call.hold = Hold(None, access, None, call.rid, None)
        call.notes["cost"] = _HIT_COST  # a hit costs nothing: said on the receipt, 0 in the request log
        call.admitted_s = time.perf_counter() - call.t0
        return True

    def _hedged(self, call: Call) -> Hedger | None:
        return self.gw.hedger if call.hedge is not None else None

    def _extra_hold(self, call: Call) -> Callable[[], Awaitable[Hold | None]]:
        assert call.access is not None and call.decision is not None
        access, decision = call.access, call.decision
        return lambda: self.acc.admit_extra(access, decision, call.rid)

    async def run_buffered(
        self, call: Call, render: Callable[[BufferedRun], bytes]
    ) -> tuple[BufferedRun, bytes]:
        """Run the chain buffered and render the answer: ``render`` runs while the spend's ledger entry
        commits, and the commit is awaited before this returns (durable spend before the answer leaves).
        A cache hit renders the stored answer (no upstream call, nothing settled); a cacheable miss stores
        the answer once its spend is settled."""
        assert call.hold is not None and call.decision is not None and call.payload is not None
        cc = call.cache
        if cc is not None and cc.entry is not None:
            target = self.gw.executor.targets[cc.entry.candidate]
            res = call.res = BufferedRun(_answer(cc.entry.body), target, [], 0.0, {}, None)
            return res, render(res)
        hedger = self._hedged(call)
        if hedger is not None and call.hedge is not None:
            extra = self._extra_hold(call)
            work = hedger.run_buffered(call.decision, call.payload, call.rid, call.hedge, extra)
        else:
            work = self.gw.executor.run_buffered(call.decision, call.payload, call.rid)
        res = await call.hold.guard(work)
        call.res = res
        kept = _kept(res.body) if cc is not None and cc.write else None  # before render adds the receipt
        content = await call.hold.settle_rendering(res.target.candidate, res.usage, lambda: render(res))
        if kept is not None and cc is not None and self.gw.cache is not None:
            self.gw.cache.store_body(cc, res.target.candidate.id, kept)
        return res, content

    async def open_stream(self, call: Call) -> StreamRun:
        """Open a stream on the chain (its first chunk read); the caller's relay settles it. A cache hit
        replays the stored chunks; a cacheable miss records its chunks, stored once the upstream completed
        the stream normally."""
        assert call.hold is not None and call.decision is not None and call.payload is not None
        cc, cache = call.cache, self.gw.cache
        if cc is not None and cc.entry is not None:
            e, ex = cc.entry, self.gw.executor
            return StreamRun(e.chunks[0], ReplayStream(e.chunks[1:]), ex.targets[e.candidate], [],
                             0.0, time.perf_counter(), None, False, ex, _finished=True,
                             request_id=call.rid, headers={"x-ethen-cache": cc.header})
        hedger = self._hedged(call)
        if hedger is not None and call.hedge is not None:
            extra = self._extra_hold(call)
            work = hedger.open_stream(call.decision, call.payload, call.rid, call.hedge, extra)
        else:
            work = self.gw.executor.open_stream(call.decision, call.payload, call.rid)
        run = await call.hold.guard(work)
        shadows = self.gw.shadows
        if shadows is not None and shadows.applies(call.decision) and shadows.sampled_any(call.decision,
                                                                                           call.rid):
            def kept(chunks: list[bytes]) -> None:  # issue 27: the primary's text, compared with the shadow's
                call.shadow_chunks = chunks

            run.stream = RecordingStream(run.stream, run.first, kept)
        if cc is not None and cache is not None:
            run.headers["x-ethen-cache"] = cc.header
            if cc.write:
                cid = run.target.candidate.id
                run.stream = RecordingStream(run.stream, run.first,
                                             lambda chunks: cache.store_stream(cc, cid, chunks))
        return run

    def served(
        self,
        call: Call,
        upstream_s: float,
        *,
        candidate: Candidate | None = None,
        attempts: list[Attempt] | None = None,
        usage: Usage | None = None,
        receipt: Mapping[str, Any] | None = None,
    ) -> dict[str, str]:
        """Count and log a buffered 200 and return its headers (request id, overhead). Chat and responses
        ran :meth:`run_buffered` (its result is on ``call``); an endpoint of its own passes what it served."""
        m = self.gw.metrics
        elapsed = time.perf_counter() - call.t0
        overhead = max(0.0, elapsed - upstream_s)
        m.requests.labels(call.label, "false", "200").inc()
        m.latency.labels("false").observe(elapsed)
        m.overhead.observe(overhead)
        res = call.res
        if res is not None:
            candidate, attempts, usage = res.target.candidate, res.attempts, res.usage
        self._log(call, 200, "ok", elapsed, served=candidate, attempts=attempts or (), usage=usage,
                  extra=res.receipt_extra if res is not None else None, receipt=receipt, overhead_s=overhead)
        self._remember(call, candidate, usage)
        out = {"x-request-id": call.rid, "x-ethen-overhead-ms": f"{overhead * 1000:.3f}"}
        if call.cache is not None:
            out["x-ethen-cache"] = call.cache.header
        shadows = self.gw.shadows
        if shadows is not None and res is not None and shadows.applies(call.decision) and not _hit(call):
            ok = [a for a in res.attempts if a.outcome == "ok"]
            latency = ok[-1].latency_ms if ok else res.upstream_s * 1000
            primary = Primary(res.target.candidate, latency, latency, res.usage, "ok", False, body=res.body)
            self._shadow(call, shadows, primary)
        return out

    def _remember(self, call: Call, candidate: Candidate | None, usage: Usage | None) -> None:
        """Who holds this prompt in a prompt cache now (issue 45); a response-cache hit reached no one."""
        if call.prefix is None or call.decision is None or _hit(call):
            return
        tokens = usage.prompt_tokens if usage is not None else call.decision.requirements.input_tokens
        bodies: list[Mapping[str, Any]] = [call.payload] if call.payload is not None else []
        if isinstance(call.body, NativeBody):  # a Messages body passed natively: its cache_control marks
            bodies.append(call.body.messages)
        self.gw.prompt_memory.remember(call.prefix, candidate, tokens, *bodies)

    @staticmethod
    def _shadow(call: Call, shadows: ShadowRunner, primary: Primary) -> None:
        """Start the request's shadow calls (issue 27, ``ethen.gateway.api.shadow``): after its answer."""
        assert call.decision is not None and call.body is not None and call.payload is not None
        shadows.launch(ShadowRequest(call.rid, call.decision, call.body, call.payload,
                                     call.policy or ProjectPolicy()), primary)

    def _log(self, call: Call, status: int, outcome: str, elapsed: float, **kw: Any) -> None:
        if call.notes:
            kw["extra"] = call.with_notes(kw.get("extra"))
        access = call.access
        body = call.body
        principal = access.principal if access is not None else None
        self.gw.requestlog.record(RequestRecord(
            call.wall, call.rid, call.endpoint, call.stream, status, outcome, elapsed,
            project=access.project.name if principal is not None else None,  # type: ignore[union-attr]
            key_id=principal.key_id if principal is not None
            else (f"config:{access.name}" if access is not None else None),
            requested_model=body.get("model") if body is not None else None,
            decision=call.decision, decided_s=call.decided_s, admitted_s=call.admitted_s,
            remaining_usd=call.remaining_usd, trace_headers=call.trace_headers, **kw,
        ))  # fmt: skip

    def stream_end(self, call: Call) -> Callable[[StreamRelay, str, str | None, float], None]:
        """The relay's end-of-stream hook: logs the stream's outcome (``ok``, ``stream_error``,
        ``client_closed``) with its attempts, usage and TTFT."""

        def end(relay: StreamRelay, outcome: str, code: str | None, at: float) -> None:
            run = relay.run
            self._log(call, 200, outcome, at - call.t0, served=run.target.candidate, attempts=run.attempts,
                      usage=run.stream.usage, extra=run.stream.receipt_extra, ttft_s=relay.ttft_s,
                      overhead_s=relay.overhead_s, error_code=code)
            if outcome == "ok":
                self._remember(call, run.target.candidate, run.stream.usage)
            shadows, chunks = self.gw.shadows, call.shadow_chunks
            if shadows is not None and outcome == "ok" and chunks is not None:
                ttft = run.ttft_s * 1000 if run.ttft_s is not None else None
                self._shadow(call, shadows, Primary(run.target.candidate, (at - run.started) * 1000, ttft,
                                                    run.stream.usage, "ok", True, chunks=tuple(chunks)))

        return end

    def failed(self, call: Call, err: GatewayError) -> Response:
        """Count a refused or failed request and answer with its OpenAI error envelope."""
        status = http_status(err)
        label = self.gw.label(call.body) if call.label == "other" else call.label
        self.gw.metrics.requests.labels(label, "true" if call.stream else "false", str(status)).inc()
        if status >= 500 and not isinstance(err, NoHealthyCandidateError):  # circuits log their changes
            log.warning("request %s failed: %s", call.rid, err.code)
        self._log(
            call, status, "error", time.perf_counter() - call.t0, error_code=err.code,
            attempts=err.attempts if isinstance(err, FallbackExhaustedError) else (),
            error_provider=err.provider if isinstance(err, UpstreamError) else None,
            client_error=isinstance(err, UpstreamBadRequestError),
            # refused before a decision existed: the refusal's own receipt (requirements, rejections)
            receipt=err.receipt if call.decision is None else None,
        )  # fmt: skip
        return self.error_response(err, call.rid)
