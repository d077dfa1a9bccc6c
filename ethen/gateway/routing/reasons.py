"""The reason-code vocabulary, in one place.

Two kinds of codes:

* :data:`REJECTION_REASONS` - why a candidate was filtered out (on ``Rejection.reasons``; a rejected candidate
  never reaches scoring). A candidate collects every reason that applies, in the order of this table.
* :data:`SELECTION_REASONS` - why the selected candidate is primary (on ``Receipt.reason_codes``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

__all__ = [
    "ALIAS_REQUIRES_CONTEXT",
    "ALIAS_REQUIRES_TOOLS",
    "ALIAS_REQUIRES_VISION",
    "CANARY_PROMOTED",
    "CANDIDATE_FAILING",
    "CIRCUIT_HALF_OPEN_TRIAL",
    "CONCRETE_MODEL",
    "CONTEXT_WINDOW_TOO_SMALL",
    "FALLBACK_USED",
    "HEDGE_WON",
    "HIGHEST_SCORE",
    "HIGH_RECENT_RELIABILITY",
    "MAX_OUTPUT_TOO_SMALL",
    "MODEL_NOT_ALLOWED",
    "NO_LIVE_CERTIFICATION",
    "NO_STRUCTURED_OUTPUT",
    "NO_TOOLS",
    "NO_VISION",
    "OVER_BUDGET_CEILING",
    "OVER_PROJECT_BUDGET",
    "PREDICTED_WAIT_EXCEEDS_TARGET",
    "PRIOR_ONLY",
    "PROVIDER_FAILING",
    "PROVIDER_NOT_ALLOWED",
    "PROVIDER_NOT_REQUESTED",
    "REJECTION_REASONS",
    "SELECTION_REASONS",
    "SUPPORTS_REQUIRED_CAPABILITIES",
    "TELEMETRY_INFORMED",
    "WAIT_TARGET_UNMET",
    "WITHIN_BUDGET",
]

# --- rejection reasons -------------------------------------------------------------------------------------
PROVIDER_NOT_ALLOWED: Final = "provider_not_allowed"
MODEL_NOT_ALLOWED: Final = "model_not_allowed"
PROVIDER_NOT_REQUESTED: Final = "provider_not_requested"
ALIAS_REQUIRES_TOOLS: Final = "alias_requires_tools"
ALIAS_REQUIRES_VISION: Final = "alias_requires_vision"
ALIAS_REQUIRES_CONTEXT: Final = "alias_requires_context"
NO_TOOLS: Final = "no_tool_support"
NO_VISION: Final = "no_vision_support"
NO_STRUCTURED_OUTPUT: Final = "no_structured_output_support"
CONTEXT_WINDOW_TOO_SMALL: Final = "context_window_too_small"
MAX_OUTPUT_TOO_SMALL: Final = "max_output_too_small"
NO_LIVE_CERTIFICATION: Final = "no_live_certification"
OVER_BUDGET_CEILING: Final = "over_budget_ceiling"
OVER_PROJECT_BUDGET: Final = "over_project_budget"
PROVIDER_FAILING: Final = "provider_failing"
CANDIDATE_FAILING: Final = "candidate_failing"
PREDICTED_WAIT_EXCEEDS_TARGET: Final = "predicted_wait_exceeds_target"

REJECTION_REASONS: Final = MappingProxyType(
    {
        PROVIDER_NOT_ALLOWED: "the project policy does not allow this provider",
        MODEL_NOT_ALLOWED: "the project policy does not allow this model",
        PROVIDER_NOT_REQUESTED: "providerOptions.gateway.only does not list this provider",
        ALIAS_REQUIRES_TOOLS: "the alias gate requires tool support",
        ALIAS_REQUIRES_VISION: "the alias gate requires vision support",
        ALIAS_REQUIRES_CONTEXT: "the alias gate requires a larger context window",
        NO_TOOLS: "the request has tools and the model does not support tool calls",
        NO_VISION: "the request has image parts and the model does not support vision",
        NO_STRUCTURED_OUTPUT: (
            "the request has response_format and the model does not support structured output"
        ),
        CONTEXT_WINDOW_TOO_SMALL: (
            "the estimated input (plus requested output) does not fit the context window"
        ),
        MAX_OUTPUT_TOO_SMALL: "the requested max output exceeds the model's max output tokens",
        NO_LIVE_CERTIFICATION: "certification_level 'live' and no live certification valid now",
        OVER_BUDGET_CEILING: "estimated request cost exceeds metadata.routing.budget_ceiling_usd",
        OVER_PROJECT_BUDGET: "estimated request cost exceeds the project's remaining window budget",
        PROVIDER_FAILING: "the provider had 0% success over >= 3 recent samples",
        CANDIDATE_FAILING: "this provider/model had 0% success over >= 3 recent samples",
        PREDICTED_WAIT_EXCEEDS_TARGET: "the predicted wait for a first token (queue plus own prefill) "
        "exceeds the wait target ([[wait_targets]] max_wait_ms, or a tighter metadata.routing.max_wait_ms)",
    }
)

# --- selection reasons (receipt) ---------------------------------------------------------------------------
SUPPORTS_REQUIRED_CAPABILITIES: Final = "supports_required_capabilities"
WITHIN_BUDGET: Final = "within_budget"
HIGH_RECENT_RELIABILITY: Final = "high_recent_reliability"
TELEMETRY_INFORMED: Final = "telemetry_informed"
PRIOR_ONLY: Final = "prior_only"
HIGHEST_SCORE: Final = "highest_score"
CANARY_PROMOTED: Final = "canary_promoted"
CONCRETE_MODEL: Final = "concrete_model"
FALLBACK_USED: Final = "fallback_used"
CIRCUIT_HALF_OPEN_TRIAL: Final = "circuit_half_open_trial"
HEDGE_WON: Final = "hedge_won"
WAIT_TARGET_UNMET: Final = "wait_target_unmet"

SELECTION_REASONS: Final = MappingProxyType(
    {
        SUPPORTS_REQUIRED_CAPABILITIES: "meets every hard requirement of the request and the alias gates",
        WITHIN_BUDGET: "estimated cost is within the budget ceiling / remaining project budget (when set)",
        HIGH_RECENT_RELIABILITY: "recent telemetry shows >= 3 samples and a smoothed success rate >= 0.9",
        TELEMETRY_INFORMED: "recent telemetry adjusted reliability/latency of the selected candidate",
        PRIOR_ONLY: "no recent telemetry for the selected candidate: catalog priors only",
        HIGHEST_SCORE: "highest weighted score under the alias profile",
        CANARY_PROMOTED: "a canary target was promoted to rank 1 for this request",
        CONCRETE_MODEL: "a concrete model id was requested; the pool is its providers",
        FALLBACK_USED: "the primary failed; the next candidate of the fallback chain answered (receipt of an "
        "executed request: selected_* name the candidate that answered, primary_* the decision's rank 1)",
        HEDGE_WON: "a hedge (the same request sent to the next candidate after the hedge delay, issue 27) "
        "answered first, no attempt before it failed: in place of fallback_used (selected_* name the hedge, "
        "primary_* the decision's rank 1)",
        WAIT_TARGET_UNMET: "every candidate otherwise feasible exceeds the wait target: the chain is those "
        "candidates, the least predicted wait first (a full mesh still refuses: 503 mesh_saturated)",
        CIRCUIT_HALF_OPEN_TRIAL: "no candidate passed the failing-provider gate; the selected one is a trial "
        "request through a half-open circuit (its cool-down elapsed), so a recovered provider is used again",
    }
)
