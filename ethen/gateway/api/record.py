"""What one request leaves behind: its attempts, its ``ethen.routing`` receipt and its record.

Plain values the request path builds and the observation side (request log, metrics, tracing) reads, kept
in this module so neither side imports the other: :class:`RouteTarget` (where a candidate runs),
:class:`Attempt` (one try, as the receipt shows it), :func:`routing_receipt`, :func:`cost_usd` and
:class:`RequestRecord` (one finished request, handed to
:class:`~ethen.gateway.observation.requestlog.RequestLog`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.errors import UpstreamBadRequestError, UpstreamError
from ethen.gateway.providers.base import Provider, Usage
from ethen.gateway.routing import Candidate, Decision
from ethen.gateway.routing.reasons import FALLBACK_USED, HEDGE_WON

__all__ = ["CLIENT_ERROR", "Attempt", "RequestRecord", "RouteTarget", "cost_usd", "failed_attempt",
           "routing_receipt"]

#: the outcome of an attempt the upstream refused because of the client's request (a 4xx such as a bad
#: sampling value; :class:`~ethen.gateway.errors.UpstreamBadRequestError`): not a provider failure, so the
#: dashboard's success rates, the attempt metric's ``error`` and the telemetry never count it
CLIENT_ERROR = "client_error"


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """Where a candidate is executed: its provider instance and the model name the upstream knows."""

    candidate: Candidate
    provider: Provider
    upstream_model: str


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of one candidate, as shown on the receipt."""

    candidate: str
    outcome: str  # "ok" | "error" | "client_error" (CLIENT_ERROR) | "cancelled" (a hedge's loser)
    latency_ms: float
    error_class: str | None = None
    code: str | None = None
    upstream_status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "candidate": self.candidate,
            "outcome": self.outcome,
            "latency_ms": round(self.latency_ms, 3),  # this attempt's own time, not a telemetry figure
        }
        if self.error_class is not None:
            out["error_class"] = self.error_class
            out["code"] = self.code
            if self.upstream_status is not None:
                out["upstream_status"] = self.upstream_status
        return out


def failed_attempt(candidate: str, latency_ms: float, exc: UpstreamError) -> Attempt:
    """The attempt of a failed upstream call: outcome ``error``, or :data:`CLIENT_ERROR` when the request
    caused it."""
    outcome = CLIENT_ERROR if isinstance(exc, UpstreamBadRequestError) else "error"
    return Attempt(candidate, outcome, latency_ms, exc.error_class, exc.code, exc.upstream_status)


def cost_usd(candidate: Candidate, usage: Usage | None) -> float | None:
    """The answer's price (:func:`ethen.gateway.accounting.pricing.cost_of`), ``None`` without a usage
    report."""
    return cost_of(candidate, usage).total_usd if usage is not None else None


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
    hedge = routing.get("hedge")
    if (isinstance(hedge, Mapping) and hedge.get("fired") and served is not None
            and hedge.get("winner") == served.candidate.id and all(a.outcome != "error" for a in attempts)):
        # a hedge that won is no fallback: nothing failed (issue 27)
        routing["reason_codes"] = [HEDGE_WON if c == FALLBACK_USED else c for c in routing["reason_codes"]]
    return routing


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as the request path knows it (references, not copies; nothing serialized)."""

    at: float  # wall clock (epoch s) at arrival
    request_id: str
    endpoint: str  # chat | responses | embeddings
    stream: bool
    status: int  # HTTP status sent
    outcome: str  # ok | error | stream_error | client_closed
    latency_s: float
    project: str | None = None
    key_id: str | None = None
    requested_model: Any = None  # the body's "model" (any JSON: checked when the row is built)
    decision: Decision | None = None
    attempts: Sequence[Attempt | Mapping[str, Any]] = ()
    served: Candidate | None = None
    extra: Mapping[str, Any] | None = None  # the provider's receipt extras
    receipt: Mapping[str, Any] | None = None  # a receipt built by the endpoint (embeddings)
    usage: Usage | None = None
    ttft_s: float | None = None
    overhead_s: float | None = None
    error_code: str | None = None
    error_provider: str | None = None  # an UpstreamError's provider (its only attempt)
    client_error: bool = False  # that error was caused by the client's request (an upstream 4xx)
    decided_s: float | None = None  # arrival -> decision made
    admitted_s: float | None = None  # arrival -> admitted (the first attempt starts)
    remaining_usd: float | None = None  # the project's remaining budget at admission (memory)
    trace_headers: tuple[str, str | None] | None = None  # the caller's (traceparent, tracestate)
