"""OpenTelemetry traces of gateway requests, per the GenAI semantic conventions (issue 14).

Off by default: without ``[otel] endpoint`` no tracer exists and nothing here runs. When configured, spans are
built by the request log's writer task (:mod:`ethen.gateway.observation.requestlog`) from each finished
request's record,
with the times the request path measured, and exported over OTLP/HTTP in batches; so even then the request
path makes no tracer call.

Spans of one request (one trace):
- ``{operation} {requested model}`` (kind SERVER), arrival to the last byte: ``gen_ai.operation.name``
  (``chat``, or ``embeddings``; ``/responses`` is ``chat`` with ``ethen.endpoint = responses``),
  ``gen_ai.request.model`` (the requested alias or model), ``gen_ai.response.model`` and
  ``gen_ai.provider.name`` (the candidate that answered), ``gen_ai.usage.input_tokens`` /
  ``gen_ai.usage.output_tokens``, and the receipt's key facts: ``ethen.request_id``, ``ethen.project``,
  ``ethen.routing.selected`` / ``primary`` / ``alias_profile`` / ``candidate_count`` / ``rejected_count`` /
  ``reason_codes``, ``ethen.fallback_used``, ``ethen.canary.hit``, ``ethen.cost_usd``, ``ethen.ttft_ms``,
  ``http.response.status_code``; on failure ``error.type`` (the error code) and an ERROR status.
- ``ethen.route`` (INTERNAL): arrival to the routing decision (auth, parse, decide).
- one ``{operation} {model}`` (kind CLIENT) per attempt, in order from admission, each as long as the
  attempt's own latency, with ``gen_ai.provider.name``, ``gen_ai.request.model``, ``ethen.attempt.outcome``
  and ``error.type``.
- under the attempt the mesh served, one ``ethen.mesh.stage {node}`` (kind CLIENT) per stage of its route
  (and of a route it failed over from): from the stage's first call to its last, with ``ethen.mesh.node``,
  ``ethen.mesh.layers``, ``ethen.mesh.calls``, ``ethen.mesh.rows``, ``ethen.mesh.call_ms`` (the calls' wall
  time at the orchestrator) and ``ethen.mesh.worker_ms`` (the worker's queue + compute: the rest is wire).
  A stage is one span over its whole activity, not one span per token (a 200-token answer would make 600).

A request that carries a W3C ``traceparent`` (and ``tracestate``) header joins the caller's trace: the
request span is the child of the caller's span (an invalid header starts a new trace, as the W3C spec asks).
The headers are read only when tracing is configured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from ethen.gateway.api.record import RequestRecord
    from ethen.gateway.config import OtelConfig

__all__ = ["Tracing", "tracing_for"]

_NS = 1_000_000_000
_W3C = TraceContextTextMapPropagator()


def _operation(endpoint: str) -> str:
    return "embeddings" if endpoint == "embeddings" else "chat"


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}


class Tracing:
    """A tracer provider of its own (not the global one) and :meth:`emit`. ``exporter`` with ``batch=False``
    exports each span as it ends (tests: the SDK's ``InMemorySpanExporter``)."""

    def __init__(self, exporter: SpanExporter, *, service_name: str = "ethen-gateway", batch: bool = True):
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("ethen.gateway")

    def emit(self, rec: RequestRecord, row: Mapping[str, Any]) -> None:
        """The spans of one finished request (called by the request log's writer)."""
        op = _operation(rec.endpoint)
        start = int(rec.at * _NS)
        end = start + int(rec.latency_s * _NS)
        receipt = row.get("receipt") or {}
        attrs = _clean({
            "gen_ai.operation.name": op,
            "gen_ai.request.model": row["requested_model"],
            "gen_ai.response.model": row["selected_model"],
            "gen_ai.provider.name": row["selected_provider"],
            "gen_ai.usage.input_tokens": row["prompt_tokens"],
            "gen_ai.usage.output_tokens": row["completion_tokens"],
            "http.response.status_code": rec.status,
            "ethen.endpoint": rec.endpoint,
            "ethen.request_id": rec.request_id,
            "ethen.project": rec.project,
            "ethen.stream": rec.stream,
            "ethen.outcome": rec.outcome,
            "ethen.routing.selected": f"{row['selected_provider']}/{row['selected_model']}"
            if row["selected_model"] else None,
            "ethen.routing.primary": f"{row['primary_provider']}/{row['primary_model']}"
            if row["primary_model"] else None,
            "ethen.routing.alias_profile": receipt.get("alias_profile"),
            "ethen.routing.candidate_count": receipt.get("candidate_count"),
            "ethen.routing.rejected_count": receipt.get("rejected_count"),
            "ethen.routing.reason_codes": _strings(receipt.get("reason_codes")),
            "ethen.fallback_used": row["fallback_used"],
            "ethen.canary.hit": row["canary_hit"],
            "ethen.cost_usd": row["cost_nano"] / 1e9 if row["cost_nano"] is not None else None,
            "ethen.ttft_ms": row["ttft_ms"],
            "error.type": rec.error_code,
        })
        name = f"{op} {row['requested_model']}" if row["requested_model"] else op
        parent = None
        if rec.trace_headers is not None:
            traceparent, tracestate = rec.trace_headers
            carrier = {"traceparent": traceparent} if tracestate is None else \
                {"traceparent": traceparent, "tracestate": tracestate}
            parent = _W3C.extract(carrier)
        root = self.tracer.start_span(name, parent, kind=SpanKind.SERVER, attributes=attrs, start_time=start)
        if rec.outcome != "ok":
            root.set_status(Status(StatusCode.ERROR, rec.error_code or rec.outcome))
        ctx = set_span_in_context(root)
        if rec.decided_s is not None:
            span = self.tracer.start_span("ethen.route", ctx, attributes=_clean({
                "ethen.routing.chain": _strings(receipt.get("chain")),
                "ethen.routing.selected": attrs.get("ethen.routing.primary"),
            }), start_time=start)
            span.end(start + int(rec.decided_s * _NS))
        at = start + int((rec.admitted_s or rec.decided_s or 0.0) * _NS)
        for a in row["attempts"]:
            dur = int(float(a.get("latency_ms") or 0.0) * 1_000_000)
            span = self.tracer.start_span(f"{op} {a['model']}", ctx, kind=SpanKind.CLIENT, attributes=_clean({
                "gen_ai.operation.name": op,
                "gen_ai.provider.name": a["provider"],
                "gen_ai.request.model": a["model"],
                "ethen.attempt.outcome": a.get("outcome"),
                "error.type": a.get("code"),
                "http.response.status_code": a.get("status"),
            }), start_time=at)
            if a.get("outcome") != "ok":
                span.set_status(Status(StatusCode.ERROR, str(a.get("code"))))
            elif isinstance(mesh := receipt.get("mesh"), Mapping):
                self._stages(mesh.get("stages"), set_span_in_context(span))
            span.end(at + dur)
            at += dur
        root.end(end)

    def _stages(self, stages: Any, ctx: Any) -> None:
        """One span per mesh stage of the attempt that served (the mesh provider's receipt ``stages``): from
        its first call's start to its last call's end; the calls, rows, the orchestrator's wall time of the
        calls and the worker's own queue + compute time as attributes (their difference is the wire)."""
        if not isinstance(stages, list):
            return
        for st in stages:
            if not isinstance(st, Mapping) or not isinstance(st.get("layers"), list):
                continue
            first, last = st["layers"]
            span = self.tracer.start_span(f"ethen.mesh.stage {st['node']}", ctx, kind=SpanKind.CLIENT,
                                          attributes=_clean({
                "ethen.mesh.node": st["node"],
                "ethen.mesh.layers": f"{first}-{last}",
                "ethen.mesh.calls": st.get("calls"),
                "ethen.mesh.rows": st.get("rows"),
                "ethen.mesh.call_ms": st.get("call_ms"),
                "ethen.mesh.worker_ms": st.get("worker_ms"),
            }), start_time=int(float(st["start"]) * _NS))  # fmt: skip
            span.end(int(float(st["end"]) * _NS))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processor


def _strings(v: Any) -> Sequence[str] | None:
    return [str(x) for x in v] if isinstance(v, list) else None


def tracing_for(cfg: OtelConfig) -> Tracing | None:
    """The configured tracing (OTLP/HTTP to ``[otel] endpoint``), or ``None`` when it is unset."""
    if cfg.endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return Tracing(OTLPSpanExporter(endpoint=cfg.endpoint), service_name=cfg.service_name)
