"""Brute-force oracle for the gateway routing core, written independently of ethen.gateway.routing.filter.

It re-derives the hard requirements from the raw body with its own straightforward code, then checks every
candidate against every rule one by one. The only value it takes from the core is the input-token estimate
(the estimator has its own tests), which it bounds from below by an independent count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ethen.gateway.routing import ALIASES, Candidate, RoutingContext

DEFAULT_OUT = 4096


@dataclass(frozen=True)
class Needs:
    tools: bool
    vision: bool
    structured: bool
    max_out: int | None
    ceiling: float | None
    live: bool
    only: frozenset[str] | None
    gate_tools: bool
    gate_vision: bool
    gate_ctx: int


def needs_of(body: Mapping[str, Any]) -> Needs:
    model = body["model"]
    tools = body.get("tools") is not None or body.get("functions") is not None
    vision = False
    for m in body["messages"]:
        c = m.get("content")
        if isinstance(c, list):
            for p in c:
                if p.get("type") in ("image_url", "input_image"):
                    vision = True
    rf = body.get("response_format")
    structured = rf is not None and rf.get("type") in ("json_object", "json_schema")
    outs = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    routing = (body.get("metadata") or {}).get("routing") or {}
    only = ((body.get("providerOptions") or {}).get("gateway") or {}).get("only")
    gate_tools = model == "ethen/coding"
    gate_vision = model == "ethen/vision"
    gate_ctx = {"ethen/coding": 64_000, "ethen/long-context": 128_000}.get(model, 0)
    return Needs(
        tools=tools,
        vision=vision,
        structured=structured,
        max_out=max(outs) if outs else None,
        ceiling=routing.get("budget_ceiling_usd"),
        live=routing.get("certification_level") == "live",
        only=frozenset(only) if only is not None else None,
        gate_tools=gate_tools,
        gate_vision=gate_vision,
        gate_ctx=gate_ctx,
    )


def lower_bound_tokens(body: Mapping[str, Any]) -> int:
    """A count no sane estimator may go below: text characters / 4 (English averages ~4 chars per token)."""
    chars = 0
    for m in body["messages"]:
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(p.get("text", "")) for p in c if p.get("type") == "text")
    if body.get("tools"):
        chars += len(json.dumps(body["tools"]))
    return chars // 4


def cost_usd(cand: Candidate, input_tokens: int, needs: Needs) -> float:
    out = needs.max_out if needs.max_out is not None else min(DEFAULT_OUT, cand.info.max_output_tokens)
    return input_tokens * cand.prices.input_per_mtok / 1e6 + out * cand.prices.output_per_mtok / 1e6


def pool_for(body: Mapping[str, Any], ctx: RoutingContext) -> tuple[Candidate, ...] | None:
    """The considered pool, or None when the model id is unknown."""
    model = body["model"]
    if model in ALIASES:
        return ctx.pool
    if model.startswith("ethen/"):
        return None
    sub = tuple(c for c in ctx.pool if c.model == model) or tuple(
        c for c in ctx.pool if f"{c.provider}/{c.model}" == model
    )
    return sub or None


def feasible(cand: Candidate, body: Mapping[str, Any], ctx: RoutingContext, input_tokens: int) -> bool:
    return serviceable(cand, body, ctx, input_tokens) and not blocking_circuits(cand, ctx)


def serviceable(cand: Candidate, body: Mapping[str, Any], ctx: RoutingContext, input_tokens: int) -> bool:
    """Every rule except the failing gates (the candidate would serve were its provider healthy)."""
    n = needs_of(body)
    i = cand.info
    pol = ctx.policy
    if pol.allowed_providers is not None and cand.provider not in pol.allowed_providers:
        return False
    if pol.allowed_models is not None and not (
        cand.model in pol.allowed_models or f"{cand.provider}/{cand.model}" in pol.allowed_models
    ):
        return False
    if n.only is not None and cand.provider not in n.only:
        return False
    if (n.tools or n.gate_tools) and not i.supports_tools:
        return False
    if (n.vision or n.gate_vision) and not i.supports_vision:
        return False
    if n.structured and not i.supports_structured_output:
        return False
    if i.context_window < n.gate_ctx:
        return False
    if input_tokens + (n.max_out or 0) > i.context_window:
        return False
    if n.max_out is not None and n.max_out > i.max_output_tokens:
        return False
    if n.live:
        cert = cand.certification
        if cert is None or not (cert.valid_from <= ctx.now < cert.valid_until):
            return False
    c = cost_usd(cand, input_tokens, n)
    if n.ceiling is not None and c > n.ceiling:
        return False
    return not (pol.remaining_budget_usd is not None and c > pol.remaining_budget_usd)


def blocking_circuits(cand: Candidate, ctx: RoutingContext) -> tuple[str, ...]:
    """The failing gates that exclude ``cand``, as circuit keys: its provider (0 successes over >= 3 samples
    summed over the provider's models) and its own ``provider/model`` (0 over >= 3 of its own, or a run of
    >= 3 failures after its last success: ``streak``)."""
    out: list[str] = []
    prov_n = sum(s.samples for (p, _m), s in ctx.telemetry.stats.items() if p == cand.provider)
    prov_s = sum(s.successes for (p, _m), s in ctx.telemetry.stats.items() if p == cand.provider)
    if prov_n >= 3 and prov_s == 0:
        out.append(cand.provider)
    own = ctx.telemetry.stats.get((cand.provider, cand.model))
    if own is not None and ((own.samples >= 3 and own.successes == 0) or own.streak >= 3):
        out.append(f"{cand.provider}/{cand.model}")
    return tuple(out)


def expected_outcome(body: Mapping[str, Any], ctx: RoutingContext, input_tokens: int) -> tuple[str, set[str]]:
    """What decide must do, by brute force: ("route", feasible ids) when some candidate passes every rule;
    else ("trial", ids) for the serviceable candidates whose every blocking circuit is half-open; else
    ("no_healthy", serviceable ids) when some candidate is excluded only by the failing gates; else
    ("none", set())."""
    pool = pool_for(body, ctx) or ()
    ok = {f"{c.provider}/{c.model}" for c in pool if feasible(c, body, ctx, input_tokens)}
    if ok:
        return "route", ok
    blocked = {
        f"{c.provider}/{c.model}": blocking_circuits(c, ctx)
        for c in pool
        if serviceable(c, body, ctx, input_tokens)
    }
    trial = {cid for cid, keys in blocked.items() if all(k in ctx.circuits.half_open for k in keys)}
    if trial:
        return "trial", trial
    return ("no_healthy", set(blocked)) if blocked else ("none", set())


def expected_retry_after(body: Mapping[str, Any], ctx: RoutingContext, input_tokens: int) -> int:
    """Whole seconds (>= 1) until the earliest serviceable candidate's circuits all allow a trial; a circuit
    with no known time counts 2 s."""
    waits = []
    for c in pool_for(body, ctx) or ():
        if serviceable(c, body, ctx, input_tokens):
            keys = blocking_circuits(c, ctx)
            at = [ctx.circuits.retry_at.get(k) for k in keys]
            waits.append(max(2.0 if t is None else (t - ctx.now).total_seconds() for t in at))
    return max(1, math.ceil(min(waits)))


def feasible_ids(body: Mapping[str, Any], ctx: RoutingContext, input_tokens: int) -> set[str]:
    pool = pool_for(body, ctx) or ()
    return {f"{c.provider}/{c.model}" for c in pool if feasible(c, body, ctx, input_tokens)}


def ranked_ok(scores: list[tuple[float, str, str]]) -> bool:
    """Brute force: every earlier entry is >= every later one under (score desc, provider, model)."""
    for a in range(len(scores)):
        for b in range(a + 1, len(scores)):
            sa, pa, ma = scores[a]
            sb, pb, mb = scores[b]
            if sa < sb or (sa == sb and (pa, ma) > (pb, mb)):
                return False
    return True
