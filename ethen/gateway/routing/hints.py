"""What to add so a refused request can be served (issue 42): the sentences a 422 ``no_smart_route_candidate``
(and a 404 for an unknown model) ends with. Pure: the request's requirements, the pool considered, the
rejections and the project policy in; text out (no I/O).

One sentence per reason that ruled a candidate out, in :data:`~.reasons.REJECTION_REASONS` order, said
concretely: the tokens of context the request needs against the largest window there is, the max output
allowed, the cheapest estimate against the budget ceiling, the providers the project may use, and for a
missing capability (tools, a long context) the overlay of cloud providers to start the gateway with
(:data:`OVERLAY`). Reasons that are an outage (``provider_failing`` / ``candidate_failing``) add nothing:
their answer is a 503 with ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from . import reasons as r
from .candidates import Candidate, ProjectPolicy
from .filter import Rejection, estimate_cost_usd
from .requirements import Requirements

__all__ = ["MODELS_HINT", "OVERLAY", "model_map_hint", "refusal_hints"]

#: the gateway config overlay with tool-capable, long-context cloud providers (``ethen up --config``)
OVERLAY: Final = "examples/cloud-tools.toml"
_WITH_OVERLAY = f"e.g. start it with `ethen up --config {OVERLAY}` (cloud providers; set their API keys)"
#: the end of a 404 for an unknown model on the OpenAI-style endpoints
MODELS_HINT: Final = "GET /v1/models lists the models and ethen/* aliases this gateway serves."


def model_map_hint(model: str) -> str:
    """The end of a 404 for a model name the Messages API does not know (Claude Code's own model names)."""
    family = model.split("-", 1)[0] if "-" in model else model
    return (f"Add a [model_map] entry to the gateway config that maps it to a route or an alias, e.g. "
            f'[model_map] "{family}-*" = "ethen/auto" (or set ANTHROPIC_MODEL=ethen/auto); tool-using '
            f"clients also need a tool-capable provider with a long context: {_WITH_OVERLAY}. {MODELS_HINT}")


def _names(values: Iterable[str]) -> str:
    return ", ".join(sorted(values)) or "none"


def refusal_hints(
    req: Requirements,
    pool: tuple[Candidate, ...],
    rejections: tuple[Rejection, ...],
    policy: ProjectPolicy,
) -> tuple[str, ...]:
    """What to add or change so the request is served: one sentence per reason present (module docstring)."""
    present = {reason for rj in rejections for reason in rj.reasons}
    rejected = {rj.candidate_id for rj in rejections}
    cands = [c for c in pool if c.id in rejected] or list(pool)
    out: list[str] = []
    if r.PROVIDER_NOT_ALLOWED in present:
        out.append(f"This key's project may use only the providers {_names(policy.allowed_providers or ())}: "
                   "allow one that can serve the request (the project's allowed_providers: PATCH "
                   "/api/admin/v1/projects/<name>) or use another project's key.")
    if r.MODEL_NOT_ALLOWED in present:
        out.append(f"This key's project may use only the models {_names(policy.allowed_models or ())}: allow "
                   "one that can serve the request (the project's allowed_models) or ask for an allowed one.")
    if r.PROVIDER_NOT_REQUESTED in present:
        out.append(f"providerOptions.gateway.only lists {_names(req.only_providers or ())}: add a provider "
                   "that can serve the request or drop the restriction.")
    if present & {r.NO_TOOLS, r.ALIAS_REQUIRES_TOOLS}:
        out.append("The request uses tools (or its alias requires them): add a tool-capable provider, "
                   f"{_WITH_OVERLAY}.")
    if present & {r.NO_VISION, r.ALIAS_REQUIRES_VISION}:
        out.append("The request has images (or its alias requires vision): add a provider whose models "
                   "support vision.")
    if r.NO_STRUCTURED_OUTPUT in present:
        out.append("The request sets response_format: add a provider with structured output, or drop it.")
    if present & {r.CONTEXT_WINDOW_TOO_SMALL, r.ALIAS_REQUIRES_CONTEXT}:
        need = req.input_tokens + (req.max_output_tokens or 0)
        largest = max((c.info.context_window for c in cands), default=0)
        out.append(f"The request needs about {need} tokens of context (estimated input {req.input_tokens}"
                   f"{f' + max output {req.max_output_tokens}' if req.max_output_tokens else ''}; an alias "
                   f"may require more) and the largest context window here is {largest}: add a provider "
                   f"with a longer context, {_WITH_OVERLAY}, or send less.")
    if r.MAX_OUTPUT_TOO_SMALL in present and req.max_output_tokens is not None:
        most = max((c.info.max_output_tokens for c in cands), default=0)
        out.append(f"max_tokens {req.max_output_tokens} is above every model's max output here (at most "
                   f"{most}): lower it, or add a model with a larger max output.")
    if r.NO_LIVE_CERTIFICATION in present:
        out.append("No candidate has a valid live certification: run `ethen certify`, or drop "
                   "metadata.routing.certification_level.")
    if r.OVER_BUDGET_CEILING in present and req.budget_ceiling_usd is not None:
        cheapest = min((estimate_cost_usd(req, c) for c in cands), default=0.0)
        out.append(f"metadata.routing.budget_ceiling_usd {req.budget_ceiling_usd:g} is below the cheapest "
                   f"estimate here (${cheapest:.6f}): raise it, or lower max_tokens.")
    if r.OVER_PROJECT_BUDGET in present:
        out.append("The project's remaining budget is below the estimate: raise it (`ethen projects "
                   "set-budget`) or wait for the next window.")
    return tuple(out)
