"""Bad input never crashes decide(): any JSON-like body routes or raises a GatewayError (naming the field)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from ethen.gateway.errors import GatewayError, InvalidRequestError
from ethen.gateway.routing import (
    Candidate,
    Decision,
    ModelInfo,
    Prices,
    ProjectPolicy,
    RoutingContext,
    TelemetrySnapshot,
    decide,
)

CTX = RoutingContext(
    (
        Candidate("a", "m", ModelInfo(128_000, 8192, True, True, True), Prices(0.1, 0.4)),
        Candidate("b", "m", ModelInfo(8192, 1024), Prices(0, 0)),
    ),
    ProjectPolicy(),
    TelemetrySnapshot(),
    (),
    datetime(2026, 11, 29, tzinfo=UTC),
    "r",
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    # integers JSON allows but a float cannot hold (float() overflows)
    | st.sampled_from([2**53, 10**309, -(10**309)]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
keys = st.sampled_from([
    "model", "messages", "tools", "functions", "response_format", "max_tokens", "max_completion_tokens",
    "metadata", "providerOptions", "stream",
])
good_parts = {
    "model": st.sampled_from(["ethen/auto", "ethen/coding", "m", "a/m", "ethen/x"]),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"])}, optional={"content": json_values | st.text()}
        ),
        max_size=3,
    ),
    "metadata": st.fixed_dictionaries(
        {
            "routing": st.dictionaries(
                st.sampled_from(["budget_ceiling_usd", "latency_target", "certification_level", "other"]),
                json_values,
                max_size=3,
            )
        }
    ),
}


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 19)) == 0:
        return draw(json_values)
    body: dict[str, Any] = {}
    if draw(st.integers(0, 4)):  # mostly a valid model and messages, so deeper fields get reached
        body["model"] = draw(good_parts["model"])
        body["messages"] = [{"role": "user", "content": "hi"}]
    for key in draw(st.lists(keys, unique=True, max_size=6)):
        strategy = good_parts.get(key)
        body[key] = draw(strategy if strategy is not None and draw(st.booleans()) else json_values)
    return body


@settings(max_examples=1000, deadline=None)
@given(bodies())
def test_any_body_routes_or_raises_a_gateway_error(body: Any) -> None:
    try:
        out = decide(body, CTX)
    except InvalidRequestError as exc:
        assert exc.param is not None and exc.message
        event(f"invalid: {exc.param.split('[')[0].split('.')[0] or 'body'}")
    except GatewayError as exc:
        assert exc.code in {"model_not_found", "no_smart_route_candidate"}
        event(exc.code)
    else:
        assert isinstance(out, Decision) and out.chain
        event("routed")
