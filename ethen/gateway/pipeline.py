"""The request path every generation endpoint shares: auth -> parse -> decide -> admit -> executor -> settle.

``POST /chat/completions`` and ``POST /responses`` (:mod:`ethen.gateway.responses`) both run through one
:class:`Pipeline`; only the body translation before it and the answer's shape after it differ, so the same
requirements, fallback chain, budgets (reserve and settle), telemetry, metrics and receipt apply to both.

- :meth:`Pipeline.admit` authenticates, reads and parses the body, applies an optional ``translate`` (the
  Responses body becomes a chat-completions body), checks ``stream`` / ``stream_options``, decides and
  reserves the estimated cost. It fills a :class:`Call` as it goes, so a failure still has the model label
  and stream flag the metrics need.
- :meth:`Pipeline.run_buffered` (settled before it returns: durable spend before the answer leaves) and
  :meth:`Pipeline.open_stream` run the executor under the budget hold.
- :meth:`Pipeline.failed` turns a :class:`~ethen.gateway.errors.GatewayError` into the OpenAI error envelope
  and counts it.

The app passes in its body reader, ``stream`` checker, error-response builder and request-id reader (they
live in :mod:`ethen.gateway.app`), which keeps this module free of an import cycle with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from ethen.admin.accounts import Accounts, Hold
from ethen.gateway.errors import GatewayError, NoHealthyCandidateError, http_status
from ethen.gateway.execute import Attempt, BufferedRun, RouteTarget, StreamRun, upstream_payload
from ethen.gateway.routing import Decision

if TYPE_CHECKING:
    from ethen.gateway.app import Gateway

__all__ = ["Call", "Pipeline", "routing_receipt"]

log = logging.getLogger("ethen.gateway")

BodyReader = Callable[[Request], Awaitable[dict[str, Any]]]
StreamCheck = Callable[[Mapping[str, Any]], tuple[bool, bool]]
ErrorResponse = Callable[[GatewayError, str], Response]
RequestId = Callable[[Request], str]
Translate = Callable[[dict[str, Any]], dict[str, Any]]


def routing_receipt(
    decision: Decision,
    attempts: list[Attempt],
    served: RouteTarget | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``ethen.routing`` receipt: the decision's, with the attempts and the candidate that answered."""
    routing = decision.receipt.to_dict(served.candidate.id if served is not None else None)
    if served is not None:
        routing["served_model"] = served.candidate.model
        routing["served_provider"] = served.candidate.provider
    routing["attempts"] = [a.to_dict() for a in attempts]
    for k, v in (extra or {}).items():
        routing.setdefault(k, v)
    return routing


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

    def receipt(
        self, attempts: list[Attempt], served: RouteTarget | None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        assert self.decision is not None
        return routing_receipt(self.decision, attempts, served, extra)


class Pipeline:
    """The shared request path of one gateway (built once by ``create_app``)."""

    def __init__(
        self,
        gw: Gateway,
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
        return Call(self.request_id(request), time.perf_counter())

    async def admit(self, call: Call, request: Request, translate: Translate | None = None) -> Call:
        """Auth, parse (+ ``translate``), stream options, decide, reserve. Raises ``GatewayError``."""
        acc, gw = self.acc, self.gw
        access = await acc.authenticate(request.headers.get("authorization"))
        body = await self.read_body(request)
        if translate is not None:
            call.body = body  # labels a refused Responses body by its model too
            body = translate(body)
        call.body = body
        call.stream, call.include_usage = self.stream_check(body)
        call.decision = acc.decide(body, await acc.prepare(access, body, gw.context(call.rid)), access)
        call.label = gw.label(body)
        call.payload = upstream_payload(body)
        ticket = await gw.limits.admit(access, call.decision.requirements)  # rpm/tpm: ethen.gateway.ratelimit
        hold = await acc.admit(access, call.decision, call.rid)  # reserves the estimated cost
        call.hold = gw.limits.wrap(hold, ticket)
        return call

    async def run_buffered(self, call: Call) -> BufferedRun:
        """Run the chain buffered; the spend is settled before this returns."""
        assert call.hold is not None and call.decision is not None and call.payload is not None
        res = await call.hold.guard(self.gw.executor.run_buffered(call.decision, call.payload, call.rid))
        await call.hold.settle(res.target.candidate, res.usage)
        return res

    async def open_stream(self, call: Call) -> StreamRun:
        """Open a stream on the chain (its first chunk read); the caller's relay settles it."""
        assert call.hold is not None and call.decision is not None and call.payload is not None
        return await call.hold.guard(self.gw.executor.open_stream(call.decision, call.payload, call.rid))

    def served(self, call: Call, upstream_s: float) -> dict[str, str]:
        """Count a buffered 200 and return its headers (request id, overhead)."""
        m = self.gw.metrics
        elapsed = time.perf_counter() - call.t0
        overhead = max(0.0, elapsed - upstream_s)
        m.requests.labels(call.label, "false", "200").inc()
        m.latency.labels("false").observe(elapsed)
        m.overhead.observe(overhead)
        return {"x-request-id": call.rid, "x-ethen-overhead-ms": f"{overhead * 1000:.3f}"}

    def failed(self, call: Call, err: GatewayError) -> Response:
        """Count a refused or failed request and answer with its OpenAI error envelope."""
        status = http_status(err)
        label = self.gw.label(call.body) if call.label == "other" else call.label
        self.gw.metrics.requests.labels(label, "true" if call.stream else "false", str(status)).inc()
        if status >= 500 and not isinstance(err, NoHealthyCandidateError):  # circuits log their changes
            log.warning("request %s failed: %s", call.rid, err.code)
        return self.error_response(err, call.rid)
