"""Issue 42 items 4 and 12, properties over the routing fuzzer's scenarios (``test_routing_properties``): a
refusal carries its decision (``receipt``: the parsed requirements, every rejection with its reasons: what
the request log keeps) and its message says what to add, one sentence per group of reasons present (checked
against a brute-force table of reason -> group), naming the numbers it is about (the context the request
needs against the largest window among the rejected candidates)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings

from ethen.gateway.errors import ModelNotFoundError, NoHealthyCandidateError, NoSmartRouteCandidateError
from ethen.gateway.routing import RoutingContext, decide
from ethen.gateway.routing import reasons as r
from ethen.gateway.routing.hints import MODELS_HINT, OVERLAY
from ethen.gateway.routing.requirements import parse_requirements
from tests.gateway.routing.test_routing_properties import scenarios

#: reason -> the hint sentence it belongs to (None: an outage, or a wait target, which alone never refuses:
#: candidates over it stay in the chain, least predicted wait first, issue 44)
GROUP = {
    r.PROVIDER_NOT_ALLOWED: "providers", r.MODEL_NOT_ALLOWED: "models", r.PROVIDER_NOT_REQUESTED: "only",
    r.NO_TOOLS: "tools", r.ALIAS_REQUIRES_TOOLS: "tools", r.NO_VISION: "vision",
    r.ALIAS_REQUIRES_VISION: "vision",
    r.NO_STRUCTURED_OUTPUT: "structured", r.CONTEXT_WINDOW_TOO_SMALL: "context",
    r.ALIAS_REQUIRES_CONTEXT: "context", r.MAX_OUTPUT_TOO_SMALL: "max_output",
    r.NO_LIVE_CERTIFICATION: "certification", r.OVER_BUDGET_CEILING: "ceiling",
    r.OVER_PROJECT_BUDGET: "budget", r.PROVIDER_FAILING: None, r.CANDIDATE_FAILING: None,
    r.PREDICTED_WAIT_EXCEEDS_TARGET: None,
}
#: a phrase each group's sentence holds
PHRASE = {
    "providers": "may use only the providers", "models": "may use only the models",
    "only": "providerOptions.gateway.only lists", "tools": "add a tool-capable provider",
    "vision": "support vision", "structured": "structured output", "context": "tokens of context",
    "max_output": "above every model's max output", "certification": "ethen certify",
    "ceiling": "budget_ceiling_usd", "budget": "remaining budget",
}


def test_every_rejection_reason_has_a_group() -> None:
    assert set(GROUP) == set(r.REJECTION_REASONS)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_refusal_keeps_its_decision_and_says_what_to_add(scenario: tuple[dict[str, Any],
                                                                               RoutingContext]) -> None:
    body, ctx = scenario
    try:
        decide(body, ctx)
    except ModelNotFoundError as err:
        assert err.message.endswith(MODELS_HINT)
        assert err.receipt is not None and err.receipt["requirements"] == parse_requirements(body).to_dict()
        assert err.receipt["rejected"] == [] and err.receipt["chain"] == []
        return
    except NoSmartRouteCandidateError as err:
        req = parse_requirements(body)
        receipt = err.receipt
        assert receipt is not None
        assert receipt["requirements"] == req.to_dict() and receipt["requested_model"] == req.model
        assert receipt["rejected"] == [rj.to_dict() for rj in err.rejections]
        assert receipt["rejected_count"] == len(err.rejections) and receipt["chain"] == []
        if isinstance(err, NoHealthyCandidateError):  # an outage: retry later, nothing to add
            return
        groups = {GROUP[reason] for rj in err.rejections for reason in rj.reasons} - {None}
        if "max_output" in groups and req.max_output_tokens is None:
            groups.discard("max_output")
        if "ceiling" in groups and req.budget_ceiling_usd is None:
            groups.discard("ceiling")
        message = err.message
        for g, phrase in PHRASE.items():
            assert (phrase in message) == (g in groups), (g, groups, message)
        assert (OVERLAY in message) == bool(groups & {"tools", "context"})
        if "context" in groups:
            rejected = {rj.candidate_id for rj in err.rejections}
            largest = max(c.info.context_window for c in ctx.pool if c.id in rejected)
            assert f"the largest context window here is {largest}:" in message
            assert f"needs about {req.input_tokens + (req.max_output_tokens or 0)} tokens" in message
        return
