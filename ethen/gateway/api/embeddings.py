"""``POST /embeddings``: routed by concrete model to the routes marked ``endpoint = "embeddings"``.

Choices where the issue is silent:
- **Which routes**: a ``[[routes]]`` entry with ``endpoint = "embeddings"`` (config key, default ``"chat"``).
  Such a route serves only this endpoint (it is not in the chat candidate pool: ``ethen/auto`` never lands on
  an embedding model) and its provider must offer embeddings (``Provider.supports_embeddings``: the
  OpenAI-compatible kind; Anthropic and the mesh have none), else the gateway refuses to start naming
  ``routes[i].endpoint``. Limits and prices come from the catalog like any route; ``max_output_tokens``
  defaults to 1 and ``output_per_mtok`` to 0 (an embedding has no output tokens).
- **Routing**: by concrete model only. Several routes of the same model (on different providers) form a
  fallback chain in config order, with the chat rules: a retryable upstream error tries the next, a
  request-caused 4xx ends the request. An ``ethen/*`` alias is refused with 400
  ``alias_not_supported_for_embeddings`` (the alias policies score chat models; none names an embedding
  route); an unknown model is 404 ``model_not_found``. A project's allowed providers/models apply
  (nothing left: 422 ``no_smart_route_candidate`` listing each route with ``provider_not_allowed`` /
  ``model_not_allowed``, kept in the request log as its receipt).
- **Budgets and usage**: the most prompt tokens the gateway would bill (``PROMPT_FACTOR`` (4) x the
  estimate + ``PROMPT_SLACK_TOKENS`` (1,024), the bound chat uses for a credible report; the estimate is
  UTF-8 bytes / 3 per string, one per token id) x the route's input price is reserved against the
  project's window budget (402 ``budget_exceeded`` when it does not fit, also against the config's
  ``[policy] remaining_budget_usd``); the upstream's ``prompt_tokens`` x the input price is settled, capped
  at the reservation as on chat; an answer without usage settles the estimate.
- **Answer**: the upstream's ``CreateEmbeddingResponse`` as is, plus a short receipt at ``ethen.routing``
  (``requested_model``, ``selected_provider``/``selected_model``, ``attempts``). Upstream failures are
  counted in ``ethen_gateway_upstream_errors_total`` but not fed to the chat router's telemetry (an
  embeddings endpoint's latency says nothing about a chat model's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from ethen.gateway.accounting.accounts import PROMPT_FACTOR, PROMPT_SLACK_TOKENS, Hold
from ethen.gateway.accounting.auth import authorization
from ethen.gateway.api.execute import Attempt
from ethen.gateway.api.record import failed_attempt
from ethen.gateway.api.sse import dumps
from ethen.gateway.catalog import Catalog
from ethen.gateway.config import GatewayConfig, build_candidate
from ethen.gateway.errors import (
    AccountsUnavailableError,
    BudgetExceededError,
    FallbackExhaustedError,
    GatewayConfigError,
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    NoSmartRouteCandidateError,
    UpstreamError,
)
from ethen.gateway.providers.base import Provider, UpstreamCall, Usage
from ethen.gateway.routing import Candidate, ProjectPolicy
from ethen.gateway.routing.decide import ALIAS_PREFIX
from ethen.gateway.routing.filter import Rejection
from ethen.gateway.routing.reasons import MODEL_NOT_ALLOWED, PROVIDER_NOT_ALLOWED
from ethen.gateway.routing.requirements import BYTES_PER_TOKEN
from ethen.store import StoreError

if TYPE_CHECKING:
    from ethen.gateway.api.pipeline import Pipeline

__all__ = ["EmbeddingRoute", "embedding_routes", "embeddings_endpoint", "estimate_input_tokens"]

log = logging.getLogger("ethen.gateway")
MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class EmbeddingRoute:
    candidate: Candidate
    provider: Provider
    upstream_model: str


def embedding_routes(
    cfg: GatewayConfig, providers: Mapping[str, Provider], catalog: Catalog | None = None
) -> dict[str, list[EmbeddingRoute]]:
    """The embeddings routes by model name, in config order. Raises ``GatewayConfigError`` for a route whose
    provider offers no embeddings."""
    cat = catalog if catalog is not None else Catalog({}, use_genai_prices=False)
    out: dict[str, list[EmbeddingRoute]] = {}
    for i, r in enumerate(cfg.routes):
        if r.endpoint != "embeddings" or r.provider not in providers:
            continue
        provider = providers[r.provider]
        if not provider.supports_embeddings:
            raise GatewayConfigError(
                f"routes[{i}].endpoint = 'embeddings': provider {r.provider!r} offers no embeddings "
                "(only kind 'openai_compat' does)"
            )
        info = r.info.model_copy(update={"max_output_tokens": r.info.max_output_tokens or 1})
        prices = r.prices.model_copy(update={"output_per_mtok": r.prices.output_per_mtok or 0.0})
        cand = build_candidate(i, r.model_copy(update={"info": info, "prices": prices}), cat)
        out.setdefault(r.model, []).append(EmbeddingRoute(cand, provider, r.upstream))
    return out


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, code=code, param=param)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def estimate_input_tokens(inp: object) -> int:
    """Validate ``input`` (a string, strings, token ids or arrays of token ids) and estimate its tokens."""
    if isinstance(inp, str):
        if not inp:
            raise _bad("input", "'input' must not be an empty string.")
        return -(-len(inp.encode()) // BYTES_PER_TOKEN)
    if not isinstance(inp, list):
        raise _bad("input", "'input' must be a string or an array.", "invalid_type" if inp is not None
                   else "missing_required_parameter")
    if not inp or len(inp) > MAX_INPUTS:
        raise _bad("input", f"'input' must hold 1 to {MAX_INPUTS} items, got {len(inp)}.")
    if all(isinstance(x, str) for x in inp):
        if any(not x for x in inp):
            raise _bad("input", "'input' must not hold an empty string.")
        return sum(-(-len(x.encode()) // BYTES_PER_TOKEN) for x in inp)
    if all(_is_int(x) for x in inp):
        return len(inp)
    if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in inp):
        return sum(len(x) for x in inp)
    raise _bad("input", "'input' must be a string, an array of strings, an array of token ids or an array of "
               "non-empty arrays of token ids.", "invalid_type")


def embeddings_endpoint(
    pipe: Pipeline, routes: Mapping[str, list[EmbeddingRoute]]
) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /embeddings`` handler of one gateway."""
    gw, acc = pipe.gw, pipe.acc
    names = ", ".join(sorted(routes)) or "none is configured"

    async def embeddings(request: Request) -> Response:
        call = pipe.start(request)
        try:
            access = call.access = await acc.authenticate(authorization(request.headers))
            body = call.body = await pipe.read_body(request)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise _bad("model", "'model' must be a non-empty string.",
                           "missing_required_parameter" if model is None else "invalid_type")
            if model.startswith(ALIAS_PREFIX):
                raise _bad("model", "Embeddings are routed by concrete model only, not by an "
                           f"{ALIAS_PREFIX}* alias; name an embedding model ({names}).",
                           "alias_not_supported_for_embeddings")
            chain = routes.get(model)
            if not chain:
                raise ModelNotFoundError(model)
            tokens = estimate_input_tokens(body.get("input"))
            ctx = await acc.prepare(access, body, gw.context(call.rid))
            pol = ctx.policy
            rejected = tuple(Rejection(r.candidate.id, r.candidate.provider, r.candidate.model, reasons)
                             for r in chain if (reasons := _not_allowed(r.candidate, pol)))
            chain = [r for r in chain if not _not_allowed(r.candidate, pol)]
            if not chain:
                raise _refused(model, tokens, rejected, pol)
            most = PROMPT_FACTOR * tokens + PROMPT_SLACK_TOKENS  # the most prompt tokens billed (as on chat)
            amount = max(most * r.candidate.prices.input_per_mtok / 1e6 for r in chain)
            if pol.remaining_budget_usd is not None and amount > pol.remaining_budget_usd:
                raise BudgetExceededError(f"Not enough budget left for this request's estimated cost "
                                          f"(${amount:.6f}).")
            hold = await _admit(pipe, access, call.rid, amount)
            out, served, usage, attempts, upstream_s = await hold.guard(_run(pipe, chain, body, call.rid))
            await hold.settle(served.candidate, usage if usage is not None else Usage(tokens, 0))
            routing = {
                "requested_model": model,
                "selected_provider": served.candidate.provider,
                "selected_model": served.candidate.model,
                "attempts": [a.to_dict() for a in attempts],
            }
            out["ethen"] = {"routing": routing}
            headers = pipe.served(call, upstream_s, candidate=served.candidate, attempts=attempts,
                                  usage=usage, receipt=routing)  # the request log's record
            return Response(dumps(out), 200, headers, media_type="application/json")
        except GatewayError as err:
            return pipe.failed(call, err)

    return embeddings


def _not_allowed(cand: Candidate, pol: ProjectPolicy) -> tuple[str, ...]:
    """The project-policy rejection reasons of an embeddings route (as chat's filter names them)."""
    out: list[str] = []
    if pol.allowed_providers is not None and cand.provider not in pol.allowed_providers:
        out.append(PROVIDER_NOT_ALLOWED)
    models = pol.allowed_models
    if models is not None and cand.model not in models and cand.id not in models:
        out.append(MODEL_NOT_ALLOWED)
    return tuple(out)


def _refused(model: str, tokens: int, rejected: tuple[Rejection, ...],
             pol: ProjectPolicy) -> NoSmartRouteCandidateError:
    """422: no route of ``model`` is allowed for the project; its rejections, and its decision as the
    request log's receipt (issue 42)."""
    allowed = ", ".join(sorted(pol.allowed_providers or ())) or "none"
    err = NoSmartRouteCandidateError(
        f"no route of {model!r} is allowed for this key's project (see 'rejections'); it may use only the "
        f"providers {allowed}: allow one (the project's allowed_providers / allowed_models) or use another "
        "project's key", rejected)
    err.receipt = {"requested_model": model, "selected_model": None, "selected_provider": None,
                   "candidate_count": 0, "rejected_count": len(rejected), "chain": [],
                   "requirements": {"model": model, "estimated_input_tokens": tokens},
                   "rejected": [rj.to_dict() for rj in rejected]}
    return err


async def _admit(pipe: Pipeline, access: Any, rid: str, amount: float) -> Hold:
    """Reserve ``amount`` against the project's window budget (as ``Accounts.admit`` does for chat)."""
    acc = pipe.acc
    project = access.project
    if project is None or acc.admission is None:
        return Hold(None, access, None, rid, None)
    reservation = None
    if project.budget_usd is not None:
        try:
            reservation = await acc.admission.reserve(project, amount)
        except StoreError as exc:
            log.error("request %s: reserving budget failed: %s", rid, exc.message)
            raise AccountsUnavailableError("The gateway could not reserve the project's budget.") from None
        if reservation is None:
            raise BudgetExceededError(
                f"Project {project.name!r} has not enough budget left in this {project.budget_window}: the "
                f"request may cost up to ${amount:.6f}."
            )
    return Hold(acc.admission, access, None, rid, reservation, amount, acc.on_not_credible, acc.on_capped)


async def _run(
    pipe: Pipeline, chain: list[EmbeddingRoute], body: Mapping[str, Any], rid: str
) -> tuple[dict[str, Any], EmbeddingRoute, Usage | None, list[Attempt], float]:
    payload = {k: v for k, v in body.items() if k not in ("providerOptions", "metadata")}
    attempts: list[Attempt] = []
    upstream_s = 0.0
    last: UpstreamError | None = None
    for route in chain:
        t0 = time.perf_counter()
        try:
            res = await route.provider.embed(UpstreamCall(payload, route.upstream_model, rid))
        except UpstreamError as exc:
            dt = time.perf_counter() - t0
            upstream_s += dt
            attempts.append(failed_attempt(route.candidate.id, dt * 1000, exc))
            pipe.gw.metrics.upstream_errors.labels(route.candidate.provider, exc.error_class).inc()
            log.warning("request %s: embeddings on %s failed: %s", rid, route.candidate.id, exc.code)
            if not exc.retryable:
                raise
            last = exc
            continue
        dt = time.perf_counter() - t0
        attempts.append(Attempt(route.candidate.id, "ok", dt * 1000))
        return res.body, route, res.usage, attempts, upstream_s + dt
    if last is not None and len(attempts) == 1:
        raise last
    summary = "; ".join(f"{a.candidate}: {a.code}" for a in attempts)
    raise FallbackExhaustedError(f"all {len(attempts)} embeddings routes failed ({summary})",
                                 tuple(a.to_dict() for a in attempts))
