"""Shadow evaluation's admin API (issue 27), under ``/api/admin/v1`` behind the admin key (or a dashboard
session, with its CSRF token for the write)::

    GET  /shadows?alias=&candidate=&limit=
        per configured ``[[shadows]]`` rule passing the filters: the rule and the summary of its newest
        :data:`SUMMARY_ROWS` pairs (:mod:`ethen.admin.shadows_data`: n, success rate, latency ratio of
        medians, cost ratio of means, agreement rates), whether it may be promoted and why, the shadows
        this process did not send since it started, by outcome and gate (``skipped_gate:no_tool_support``,
        ``dropped_in_flight``, ``skipped_budget``...); and the newest
        ``limit`` pairs (1-500, 50) passing the filters, newest first
    POST /shadows/promote {alias, candidate, percent?}
        409 ``promotion_refused`` when the rule's pairs do not meet its ``min_samples`` /
        ``min_success_rate`` (the message says which); else installs a canary for the alias in this running
        gateway (``percent``: one of 0, 1, 5, 20, 50, 100; default 5; an existing canary of that alias and
        candidate is replaced) and answers what it did. The canary lives in this process only: add it to the
        config's ``[[canaries]]`` to keep it (``ethen shadows promote --config FILE`` does).

Bad input is a 400 with ``invalid_value`` / ``invalid_type`` / ``missing_required_parameter`` naming the
field; a pair that has no rule is a 404 ``not_found``. The routes exist when the gateway has ``[[shadows]]``
(which requires a ``[store]``) and an admin key.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ethen.admin.http import ADMIN_PREFIX, query_int
from ethen.admin.shadows_data import summarize
from ethen.gateway.accounting.accounts import AccountsUnavailableError
from ethen.gateway.errors import (
    AuthenticationError,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    PromotionRefusedError,
    http_status,
)
from ethen.gateway.routing import ALIASES, CANARY_PERCENTS, CanaryTarget
from ethen.gateway.routing.shadow import ShadowRule, promotion_verdict
from ethen.store import StoreError
from ethen.store.shadows import ShadowQuery, list_pairs

if TYPE_CHECKING:
    from ethen.admin.sessions import AdminAuth
    from ethen.gateway.api.shadow import ShadowRunner
    from ethen.gateway.state import Gateway

__all__ = ["DEFAULT_PERCENT", "SUMMARY_ROWS", "shadow_routes"]

SUMMARY_ROWS = 10_000
DEFAULT_PERCENT = 5
_CANDIDATE = re.compile(r"^[^/\s]{1,100}/\S{1,200}$")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status, media_type="application/json",
                    headers={"cache-control": "no-store"})


def _alias(value: Any, param: str = "alias") -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param!r} must be a string.", code="invalid_type", param=param)
    if value not in ALIASES:
        known = ", ".join(sorted(ALIASES))
        raise InvalidRequestError(f"{param} = {value!r}: unknown alias (known: {known}).",
                                  code="invalid_value", param=param)
    return value


def _candidate(value: Any, param: str = "candidate") -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param!r} must be a string.", code="invalid_type", param=param)
    if not _CANDIDATE.match(value):
        raise InvalidRequestError(f"{param} = {value!r}: not a provider/model candidate id.",
                                  code="invalid_value", param=param)
    return value


def _rule_view(rule: ShadowRule) -> dict[str, Any]:
    return {"alias": rule.alias, "candidate": rule.candidate, "percent": rule.percent,
            "project": rule.project, "max_in_flight": rule.max_in_flight,
            "min_success_rate": rule.min_success_rate, "min_samples": rule.min_samples}


async def _summary(gw: Gateway, rule: ShadowRule) -> dict[str, Any]:
    store = gw.accounts.store
    if store is None:
        raise AccountsUnavailableError("The gateway's store is not open.")
    rows = await list_pairs(store, ShadowQuery(rule.alias, rule.candidate, SUMMARY_ROWS))
    summary = summarize(rows)
    ok, why = promotion_verdict(summary["n"], summary["success_rate"], rule)
    skipped = gw.shadows.skipped.get(rule.key, {}) if gw.shadows is not None else {}
    return {**_rule_view(rule), "summary": summary, "promotable": ok, "promotion": why,
            "canary": next((c.percent for c in gw.canaries
                            if c.alias == rule.alias and c.candidate == rule.candidate), None),
            "skipped": dict(sorted(skipped.items()))}


async def _listing(gw: Gateway, runner: ShadowRunner | None, request: Request) -> dict[str, Any]:
    qp = request.query_params
    alias = _alias(qp["alias"]) if "alias" in qp else None
    candidate = _candidate(qp["candidate"]) if "candidate" in qp else None
    limit = query_int(request, "limit", 50, 1, 500)
    rules = [r for r in (runner.rules if runner is not None else ())
             if (alias is None or r.alias == alias) and (candidate is None or r.candidate == candidate)]
    store = gw.accounts.store
    if store is None:
        raise AccountsUnavailableError("The gateway's store is not open.")
    pairs = await list_pairs(store, ShadowQuery(alias, candidate, limit))
    return {"object": "list", "data": [await _summary(gw, r) for r in rules], "pairs": pairs}


async def _promote(gw: Gateway, runner: ShadowRunner | None, request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_type")
    for k in body:
        if k not in ("alias", "candidate", "percent"):
            raise InvalidRequestError(f"Unknown field {k!r} (allowed: alias, candidate, percent).",
                                      code="invalid_value", param=k)
    for k in ("alias", "candidate"):
        if k not in body:
            raise InvalidRequestError(f"{k!r} is required.", code="missing_required_parameter", param=k)
    alias, candidate = _alias(body["alias"]), _candidate(body["candidate"])
    percent = body.get("percent", DEFAULT_PERCENT)
    if isinstance(percent, float) and percent.is_integer():  # JSON 5.0 is the number 5
        percent = int(percent)
    if isinstance(percent, bool) or not isinstance(percent, int):
        raise InvalidRequestError(f"percent = {percent!r}: must be one of {list(CANARY_PERCENTS)}.",
                                  code="invalid_type", param="percent")
    if percent not in CANARY_PERCENTS:
        raise InvalidRequestError(f"percent = {percent!r}: must be one of {list(CANARY_PERCENTS)}.",
                                  code="invalid_value", param="percent")
    rule = runner.rule(alias, candidate) if runner is not None else None
    if rule is None:
        raise NotFoundError(f"no [[shadows]] rule for alias {alias!r} and candidate {candidate!r}")
    view = await _summary(gw, rule)
    if not view["promotable"]:
        raise PromotionRefusedError(
            f"shadow {candidate!r} of {alias!r} cannot be promoted: {view['promotion']}")
    target = CanaryTarget(alias, candidate, percent, rule.min_success_rate, rule.min_samples)
    before = [c for c in gw.canaries if c.alias == alias and c.candidate == candidate]
    gw.canaries = (*(c for c in gw.canaries if not (c.alias == alias and c.candidate == candidate)), target)
    return {
        "promoted": True,
        "reason": view["promotion"],
        "canary": {"alias": alias, "candidate": candidate, "percent": percent,
                   "min_success_rate": rule.min_success_rate, "min_samples": rule.min_samples},
        "replaced": {"percent": before[0].percent} if before else None,
        "summary": view["summary"],
        "persisted": False,
        "note": "installed in this gateway process only; add it to [[canaries]] to keep it after a restart",
    }


def shadow_routes(gw: Gateway, auth: AdminAuth | None) -> list[Route]:
    """``GET /shadows`` and ``POST /shadows/promote`` (none without an admin key, i.e. without ``[store]``).
    A gateway with a store but no ``[[shadows]]`` rule serves them too: an empty listing (with the pairs its
    store still holds) and a 404 ``not_found`` promotion, not a 404 for the path."""
    runner = gw.shadows
    if auth is None:
        return []

    async def guard(request: Request, build: Any) -> Response:
        if not auth.allows(request):
            err = AuthenticationError("A valid admin key is required: 'Authorization: Bearer <admin key>' "
                                      "(or a dashboard session, with its x-csrf-token for a write).")
            return _json(err.to_dict(), http_status(err))
        try:
            return _json(await build(gw, runner, request))
        except GatewayError as err:
            return _json(err.to_dict(), http_status(err))
        except StoreError:
            down = AccountsUnavailableError("The gateway's store is unavailable.")
            return _json(down.to_dict(), http_status(down))

    async def listing(request: Request) -> Response:
        return await guard(request, _listing)

    async def promote(request: Request) -> Response:
        return await guard(request, _promote)

    return [Route(f"{ADMIN_PREFIX}/shadows", listing, methods=["GET"]),
            Route(f"{ADMIN_PREFIX}/shadows/promote", promote, methods=["POST"])]
