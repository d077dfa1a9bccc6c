"""The gateway's HTTP service: a Starlette app factory around the pure routing core.

Endpoints under ``/api/gateway/v1``, and the same under ``/v1`` (a client whose base URL ends in ``/v1``):
``POST /chat/completions`` (buffered and SSE), ``POST /responses`` (:mod:`ethen.gateway.api.responses`),
``POST /embeddings`` (:mod:`ethen.gateway.api.embeddings`), ``POST /messages`` and ``/messages/count_tokens``
(Anthropic's Messages API: :mod:`ethen.gateway.api.messages_http`), ``GET /models``, ``POST
/routing/explain``,
``GET /healthz``, ``GET /metrics``. Chat completions and responses share one request path
(:mod:`ethen.gateway.api.pipeline`).

Request path (kept lean: no pydantic models, one JSON parse, one serialization): auth (one SHA-256) -> parse
body -> ``decide`` with a cached telemetry snapshot -> :class:`~ethen.gateway.api.execute.Executor` ->
response
with the receipt at ``ethen.routing`` and ``x-ethen-overhead-ms`` (total time in the gateway minus time spent
in upstream calls).

Choices where the issue is silent:
- ``/healthz`` and ``/metrics`` need no key (probes and scrapers); ``/models`` and ``/routing/explain`` do.
- ``/healthz``: 200 ``{"status":"ok"}``; with a provider reporting problems (``Provider.health()``: the mesh
  when no live chain of workers covers every layer) ``{"status":"degraded","serving":...,"reasons":[...]}``,
  status 200 while another routed provider can serve, 503 when none can (a Kubernetes readiness probe or a
  load balancer then stops sending traffic here; do not use it as a liveness probe, a restart would not bring
  the workers back). It reads provider state only (no upstream call, no RPC).
- The request id is the client's ``x-request-id`` when it is 1-128 characters of ``[A-Za-z0-9._-]`` (it also
  feeds the canary bucket, which the client could pick anyway by retrying), otherwise a fresh uuid4; it is
  sent back in ``x-request-id``.
- The receipt's ``selected_*`` fields (and its score, components and cost estimate) are the candidate that
  answered: when a fallback served the request they name it, ``primary_model`` / ``primary_provider`` name
  the decision's rank 1, ``reason_codes`` gains ``fallback_used`` and ``attempts`` lists every try
  (``served_model`` / ``served_provider`` repeat the answering candidate).
- For a stream, ``x-ethen-overhead-ms`` is measured when the headers go out (at the first chunk); the terminal
  chunk's receipt carries ``overhead_ms`` for the whole stream.
- The stream's terminal chunk (the last before ``[DONE]``) carries the receipt at ``ethen.routing``. Without
  ``stream_options.include_usage`` it is the upstream's last chunk with a ``finish_reason``, held back until
  the upstream ends (so every chunk a client sees has a choice, as OpenAI's do); with it, it is the usage
  chunk (``choices: []``, as OpenAI sends it). An upstream that sends no finish chunk last gets a
  ``choices: []`` terminal chunk.
- A stream that breaks after its first chunk ends with ``event: error`` carrying the OpenAI error envelope
  (plus ``ethen.routing``) and no ``[DONE]``.
- A provider's ``receipt_extra`` keys are merged into ``ethen.routing`` (never overwriting the core's keys).
- ``NaN`` / ``Infinity`` literals (which Python's json reads but JSON does not have) and numbers beyond the
  double range (``1e400``) are refused with 400 ``invalid_value`` naming the field, wherever they are: never
  forwarded to an upstream as invalid JSON.
- A lone UTF-16 surrogate escape (``"\\ud800"`` without its pair: valid JSON text, but no Unicode string) is
  refused with 400 ``invalid_value`` naming the field (it cannot be re-encoded as UTF-8 for the upstream).
  Only a body whose raw bytes hold a ``\\uD800``-``\\uDFFF`` escape is walked (a memchr for ``\\``, then one
  regex scan of the bytes).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ethen.gateway.accounting.auth import authorization
from ethen.gateway.api.body import MAX_BODY_BYTES, parse_body, read_body, stream_options
from ethen.gateway.api.chat import chat_endpoint
from ethen.gateway.api.completions import completions_endpoint
from ethen.gateway.api.embeddings import embedding_routes, embeddings_endpoint
from ethen.gateway.api.messages_http import messages_endpoints
from ethen.gateway.api.pipeline import Pipeline
from ethen.gateway.api.responses_http import responses_endpoint
from ethen.gateway.api.sse import dumps
from ethen.gateway.api.unknown_paths import UnknownPaths
from ethen.gateway.catalog import Catalog
from ethen.gateway.config import (
    GatewayConfig,
)
from ethen.gateway.errors import (
    GatewayError,
    http_status,
)
from ethen.gateway.observation.metrics import CONTENT_TYPE_LATEST
from ethen.gateway.observation.telemetry_store import TelemetryStore
from ethen.gateway.providers import build_providers
from ethen.gateway.providers.anthropic_native import NativeAnthropicProvider
from ethen.gateway.providers.base import Provider
from ethen.gateway.state import Gateway

__all__ = ["MAX_BODY_BYTES", "PREFIX", "Gateway", "Surface", "build_providers", "gateway_app"]

PREFIX = "/api/gateway/v1"
V1_PREFIX = "/v1"  # the same endpoints again, for clients configured with a base URL ending in /v1
log = logging.getLogger("ethen.gateway")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_JSON = "application/json"


def _error_response(err: GatewayError, request_id: str) -> Response:
    headers = {"x-request-id": request_id}
    retry_after = getattr(err, "retry_after_s", None)  # 503 no_healthy_candidate: when a trial may go
    if isinstance(retry_after, int):
        headers["retry-after"] = str(retry_after)
    return Response(dumps(err.to_dict()), http_status(err), headers, media_type=_JSON)


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid and _REQUEST_ID.match(rid):
        return rid
    return uuid.uuid4().hex


class Surface(Protocol):
    """Routes mounted after the gateway's own (the operator's: :mod:`ethen.admin.surface`), started in the
    lifespan after the accounts and closed before them."""

    routes: Sequence[BaseRoute]

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def gateway_app(
    cfg: GatewayConfig,
    *,
    env: Mapping[str, str] | None = None,
    catalog: Catalog | None = None,
    providers: Mapping[str, Provider] | None = None,
    store: TelemetryStore | None = None,
    surface: Callable[[Gateway], Surface] | None = None,
) -> Starlette:
    """Build the gateway app. ``providers`` defaults to one per ``[[providers]]`` entry (``build_providers``,
    secrets from ``env``); each is started in the lifespan start-up and closed at shutdown.
    ``catalog`` (model intelligence + prices) defaults to none: routes then carry their own limits/prices.
    ``surface`` builds more routes from the built :class:`Gateway` (the composition module,
    :func:`ethen.app.create_app`, passes the admin's); without it the app serves the gateway API only."""
    gw = Gateway(cfg, providers=providers or build_providers(cfg, env), catalog=catalog, store=store, env=env)
    acc, shared, m = gw.accounts, gw.shared, gw.metrics

    async def read_json(request: Request) -> dict[str, Any]:
        return parse_body(await read_body(request))

    # the shared request path of /chat/completions, /responses and /embeddings (ethen.gateway.api.pipeline)
    pipe = Pipeline(gw, acc, read_json, stream_options, _error_response, _request_id)
    embeddings = embedding_routes(cfg, gw.providers, catalog)  # refuses a provider without embeddings

    async def explain(request: Request) -> Response:
        rid = _request_id(request)
        try:
            access = await acc.authenticate(authorization(request.headers))
            body = parse_body(await read_body(request))
            stream_options(body)  # a body chat would refuse is refused here too
            decision = acc.decide(body, await acc.prepare(access, body, gw.context(rid)), access)
        except GatewayError as err:
            return _error_response(err, rid)
        return Response(dumps(decision.to_dict()), 200, {"x-request-id": rid}, media_type=_JSON)

    async def models(request: Request) -> Response:
        rid = _request_id(request)
        try:
            access = await acc.authenticate(authorization(request.headers))
        except GatewayError as err:
            return _error_response(err, rid)
        return Response(acc.models_for(access, gw.models_body, gw.pool), 200, media_type=_JSON)

    async def healthz(request: Request) -> Response:
        """200 ``{"status":"ok"}``; ``{"status":"degraded","reasons":[...]}`` when a provider reports problems
        (the mesh: layers no live worker chain covers): 200 while some routed provider can still serve, 503
        when none can (a readiness probe / load balancer then takes this instance out). Reads provider state
        only: no upstream call, no RPC."""
        problems = {name: p.health() for name, p in gw.providers.items()}
        reasons = [r for rs in problems.values() for r in rs]
        if not reasons:
            return Response(b'{"status":"ok"}', 200, media_type=_JSON)
        serving = any(not problems.get(c.provider) for c in gw.pool)
        body = {"status": "degraded", "serving": serving, "reasons": reasons}
        return Response(dumps(body), 200 if serving else 503, media_type=_JSON)

    async def metrics(request: Request) -> Response:
        return Response(m.render(), 200, media_type=CONTENT_TYPE_LATEST)

    unknown = UnknownPaths(m.registry)  # unknown paths: a throttled WARNING and a counter (issue 26)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404 and "endpoint" not in request.scope:  # no route matched
            client = request.client.host if request.client is not None else "-"
            unknown.seen(request.method, request.url.path, client, request.headers.get("user-agent"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request_error")
        err = GatewayError(
            f"{request.method} {request.url.path}: {'not found' if status == 404 else 'method not allowed'}"
            if status in (404, 405)
            else "bad request",
            code=code,
            type="invalid_request_error",
        )
        return Response(dumps(err.to_dict()), status, media_type=_JSON)

    async def server_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnect):  # the client went away before its request was read: no error
            log.info("client disconnected on %s before its request was read", request.url.path)
            return Response(None, 400)  # nobody reads it
        log.error("unhandled error on %s: %s", request.url.path, type(exc).__name__, exc_info=exc)
        err = GatewayError("The gateway had an internal error.", code="internal_error", type="server_error")
        return Response(dumps(err.to_dict()), 500, media_type=_JSON)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Everything loaded so far (catalog, price tables, modules) lives for the whole process: move it out
        # of the collector's generations so full collections do not rescan it on the request path.
        gc.collect()
        gc.freeze()
        try:
            await acc.start()  # opens/migrates the store, releases dangling reservations
            if gw.shadows is not None:  # a [[shadows]] rule's project is missing: a config error now
                await gw.shadows.check_projects(acc.store)
            if extra is not None:  # the operator's surfaces (ethen.admin): dashboard sessions
                await extra.start()
            gw.requestlog.start()  # the request log's writer (store or memory ring)
            await shared.start()  # Redis unreachable: logged, served degraded (ethen.gateway.shared)
            for provider in gw.providers.values():
                await provider.start()  # the mesh loads its orchestrator (logger ethen.gateway.startup)
            yield
        finally:
            if gw.shadows is not None:  # running shadow calls finish and record while the store is open
                await gw.shadows.aclose()
            if gw.cache is not None:  # its Redis writes under way finish before the connection closes
                await gw.cache.aclose()
            await shared.aclose()
            await gw.requestlog.aclose()  # writes what is queued while the store is still open
            if extra is not None:
                await extra.aclose()
            await acc.aclose()
            await gw.aclose()

    known = frozenset(gw.known_models | {c.id for c in gw.pool})  # names /messages serves (and routes)
    native = [name for name, p in gw.providers.items() if isinstance(p, NativeAnthropicProvider)]
    endpoints = [
        ("/chat/completions", chat_endpoint(pipe), "POST"),  # ethen.gateway.api.chat
        ("/responses", responses_endpoint(pipe, cfg.compat.drop_unsupported_tools), "POST"),
        ("/completions", completions_endpoint(pipe), "POST"),  # legacy: ethen.gateway.api.completions
        ("/embeddings", embeddings_endpoint(pipe, embeddings), "POST"),
        *((path, fn, "POST") for path, fn in messages_endpoints(pipe, cfg.model_map, known, native).items()),
        ("/routing/explain", explain, "POST"),
        ("/models", models, "GET"),
        ("/healthz", healthz, "GET"),
        ("/metrics", metrics, "GET"),
    ]
    extra = surface(gw) if surface is not None else None
    app = Starlette(
        routes=[
            # every gateway endpoint under PREFIX and under /v1 (clients whose base URL ends in /v1)
            *(Route(f"{prefix}{path}", fn, methods=[method])
              for prefix in (PREFIX, V1_PREFIX) for path, fn, method in endpoints),
            *(extra.routes if extra is not None else ()),  # the admin API, /ui (ethen.admin.surface)
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app
