"""The admin HTTP API under ``/api/admin/v1``, behind the admin key (``[store] admin_key_sha256``).

Endpoints (JSON in and out, OpenAI-style error envelopes)::

    GET    /projects                      list projects
    POST   /projects                      create {name, allowed_providers, allowed_models, budget_usd,
                                          budget_window, default_alias, rpm, tpm}
    GET    /projects/{name}               the project and its current window spend
    PATCH  /projects/{name}               change policy fields (null clears a restriction, budget or limit)
    GET    /projects/{name}/keys          the project's keys (public data only)
    POST   /projects/{name}/keys          create a key {name, rpm, tpm}: the full key is in this answer only
    PATCH  /keys/{key_id}                 change a key's own rate limits {rpm, tpm} (null clears one)
    DELETE /keys/{key_id}                 revoke a key
    GET    /usage?project=&since=&until=  settled usage per project, key, model (ISO-8601 times, UTC if naive)
    GET    /certifications                live-certification receipts
    GET    /requests?project=&model=&status=&since=&until=&limit=&cursor=
                                          the request log, newest first (``ethen.store.requests``): ``limit``
                                          1-500 (50), ``next_cursor`` for the next page (keyset, stable)
    GET    /requests/{request_id}         one logged request with its full receipt
    GET    /health                        circuits (open / half-open), mesh nodes, the request log's queue

``rpm`` / ``tpm`` (requests / tokens per ``[rate_limits] window_s``,
:mod:`ethen.gateway.accounting.ratelimit`) are a
whole number from 1 to ``MAX_RATE`` or null (no limit): anything else is a 400 whose ``param`` names the field
(``invalid_type`` for a non-integer, ``invalid_value`` out of range). A change is applied by every gateway
instance within about a second (the store's change counter, as a revocation).

The admin key is compared as SHA-256 digests with :func:`hmac.compare_digest`; it is a separate secret from
client keys (a project key gets 401 here). The dashboard's session cookie is accepted too, with its CSRF token
for writes (``ethen.admin.sessions``). The routes exist only when a store and an admin key are configured,
except ``/requests``: a gateway without a store serves its memory ring there when ``[log] admin_key_sha256``
is set.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, overload

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ethen.admin.sessions import AdminAuth
from ethen.gateway.accounting.accounts import Accounts, AccountsUnavailableError
from ethen.gateway.errors import AuthenticationError, GatewayError, InvalidRequestError, http_status
from ethen.store import (
    UNSET,
    Store,
    StoreConflictError,
    StoreError,
    StoreInvalidError,
    StoreNotFoundError,
    usage_report,
)
from ethen.store.requests import RequestQuery, parse_status
from ethen.store.store import MAX_RATE

if TYPE_CHECKING:
    from ethen.gateway.observation.requestlog import RequestLog

__all__ = ["ADMIN_PREFIX", "admin_routes", "query_int", "request_routes"]
_MAX_LIMIT = 500

ADMIN_PREFIX = "/api/admin/v1"
_JSON = "application/json"
_RATE_FIELDS = ("rpm", "tpm")
_PROJECT_FIELDS = ("allowed_providers", "allowed_models", "budget_usd", "budget_window", "default_alias",
                   *_RATE_FIELDS)
Handler = Callable[[Request, Store], Awaitable[Response]]


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status, media_type=_JSON)


def _error(err: GatewayError, status: int | None = None) -> Response:
    return _json(err.to_dict(), status or http_status(err))


def _store_error(exc: StoreError) -> Response:
    if isinstance(exc, StoreInvalidError):
        return _error(InvalidRequestError(exc.message, code="invalid_value"), 400)
    if isinstance(exc, StoreNotFoundError):
        return _error(GatewayError(exc.message, code="not_found", type="invalid_request_error"), 404)
    if isinstance(exc, StoreConflictError):
        return _error(GatewayError(exc.message, code="conflict", type="invalid_request_error"), 409)
    return _error(AccountsUnavailableError("The gateway's store is unavailable."))


async def _body(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_type")
    for k in body:
        if k not in allowed:
            raise InvalidRequestError(
                f"Unknown field {k!r} (allowed: {', '.join(allowed)}).", code="invalid_value", param=k
            )
    for k in ("allowed_providers", "allowed_models"):
        v = body.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise InvalidRequestError(
                f"{k!r} must be a list of strings or null.", code="invalid_type", param=k
            )
    for k in ("name", "budget_window", "default_alias"):
        v = body.get(k)
        if v is not None and not isinstance(v, str):
            raise InvalidRequestError(f"{k!r} must be a string.", code="invalid_type", param=k)
    b = body.get("budget_usd")
    if b is not None and (isinstance(b, bool) or not isinstance(b, int | float)):
        raise InvalidRequestError(
            "'budget_usd' must be a number or null.", code="invalid_type", param="budget_usd"
        )
    for k in _RATE_FIELDS:
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequestError(f"{k!r} = {v!r}: must be a whole number or null.", code="invalid_type",
                                      param=k)
        if not 1 <= v <= MAX_RATE:
            raise InvalidRequestError(f"{k!r} = {v!r}: must be from 1 to {MAX_RATE}, or null.",
                                      code="invalid_value", param=k)
    return body


def _time(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        t = datetime.fromisoformat(raw)
        return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except (ValueError, OverflowError):  # not a date, or one out of range in UTC (0001-01-01T00:00+05:00)
        raise InvalidRequestError(
            f"{name} = {raw!r}: not an ISO-8601 date or time (years 1-9999 in UTC).", code="invalid_value",
            param=name
        ) from None


async def _list_projects(request: Request, st: Store) -> Response:
    return _json({"object": "list", "data": [p.to_dict() for p in await st.list_projects()]})


async def _create_project(request: Request, st: Store) -> Response:
    body = await _body(request, ("name", *_PROJECT_FIELDS))
    if "name" not in body:
        raise InvalidRequestError("'name' is required.", code="missing_required_parameter", param="name")
    p = await st.create_project(
        body["name"],
        allowed_providers=body.get("allowed_providers"),
        allowed_models=body.get("allowed_models"),
        budget_usd=body.get("budget_usd"),
        budget_window=body.get("budget_window") or "month",
        default_alias=body.get("default_alias"),
        rpm=body.get("rpm"),
        tpm=body.get("tpm"),
    )
    return _json(p.to_dict(), 201)


async def _project_view(st: Store, name: str) -> dict[str, Any]:
    p = await st.get_project(name)
    spend = await st.spend(p)
    return {
        **p.to_dict(),
        "window": {
            "start": spend.window_start.isoformat(),
            "settled_usd": spend.settled_usd,
            "reserved_usd": spend.reserved_usd,
            "remaining_usd": spend.remaining_usd,
        },
    }


async def _get_project(request: Request, st: Store) -> Response:
    return _json(await _project_view(st, request.path_params["name"]))


async def _patch_project(request: Request, st: Store) -> Response:
    body = await _body(request, _PROJECT_FIELDS)
    if "budget_window" in body and body["budget_window"] is None:
        raise InvalidRequestError(
            "'budget_window' cannot be null.", code="invalid_value", param="budget_window"
        )
    name = request.path_params["name"]
    await st.update_project(name, **{k: body.get(k, UNSET) for k in _PROJECT_FIELDS})
    return _json(await _project_view(st, name))


async def _list_keys(request: Request, st: Store) -> Response:
    name = request.path_params["name"]
    await st.get_project(name)
    return _json({"object": "list", "data": [k.to_dict() for k in await st.list_keys(name)]})


async def _create_key(request: Request, st: Store) -> Response:
    body = await _body(request, ("name", *_RATE_FIELDS))
    key, info = await st.create_key(
        request.path_params["name"], name=body.get("name"), rpm=body.get("rpm"), tpm=body.get("tpm")
    )
    return _json({**info.to_dict(), "key": key}, 201)


async def _patch_key(request: Request, st: Store) -> Response:
    body = await _body(request, _RATE_FIELDS)
    info = await st.update_key(request.path_params["key_id"], **{k: body.get(k, UNSET) for k in _RATE_FIELDS})
    return _json(info.to_dict())


async def _revoke_key(request: Request, st: Store) -> Response:
    return _json((await st.revoke_key(request.path_params["key_id"])).to_dict())


async def _usage(request: Request, st: Store) -> Response:
    rows = await st.usage(
        project=request.query_params.get("project"),
        since=_time(request, "since"),
        until=_time(request, "until"),
    )
    return _json({"object": "list", **usage_report(rows)})


async def _certifications(request: Request, st: Store) -> Response:
    return _json({"object": "list", "data": [c.to_dict() for c in await st.certifications()]})


def _denied() -> Response:
    return _error(AuthenticationError("A valid admin key is required: 'Authorization: Bearer <admin key>' "
                                      "(or a dashboard session, with its x-csrf-token for a write)."))


@overload
def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int: ...
@overload
def query_int(request: Request, name: str, default: None, lo: int, hi: int) -> int | None: ...
def query_int(request: Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    """The query parameter ``name`` as an integer in ``lo..hi`` (``default`` when absent), or a 400
    ``invalid_value`` naming it."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only ("²" is a digit to str.isdigit, not to int()), at most as many as ``hi`` has
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(hi))) or not lo <= int(raw) <= hi:
        raise InvalidRequestError(f"{name} = {raw!r}: an integer from {lo} to {hi}.", code="invalid_value",
                                  param=name)
    return int(raw)


def _text_filter(request: Request, name: str) -> str | None:
    """A text filter, or a 400 ``invalid_value`` naming it when it holds a NUL (no stored text holds one:
    the log stores U+FFFD in its place, and Postgres refuses a NUL in a query)."""
    raw = request.query_params.get(name)
    if raw is not None and "\x00" in raw:
        raise InvalidRequestError(f"{name} = {raw!r}: a filter cannot hold a NUL character.",
                                  code="invalid_value", param=name)
    return raw


def _request_query(request: Request) -> RequestQuery:
    """The filters of ``GET /requests``: any bad one is a 400 ``invalid_value`` whose ``param`` names it."""
    qp = request.query_params
    status = qp.get("status")
    try:
        parsed = parse_status(status) if status is not None else None
    except ValueError as exc:
        raise InvalidRequestError(str(exc), code="invalid_value", param="status") from None
    return RequestQuery(
        project=_text_filter(request, "project"),
        model=_text_filter(request, "model"),
        status=parsed,
        since=_time(request, "since"),
        until=_time(request, "until"),
        limit=query_int(request, "limit", 50, 1, _MAX_LIMIT),
        before_id=query_int(request, "cursor", None, 1, 2**63 - 1),
    )


def request_routes(
    requests: RequestLog, auth: AdminAuth | None, health: Callable[[], dict[str, Any]] | None = None
) -> list[Route]:
    """``GET /requests``, ``GET /requests/{request_id}`` and ``GET /health`` (none without an admin key)."""
    if auth is None:
        return []

    async def status(request: Request) -> Response:
        if not auth.allows(request):
            return _denied()
        return _json(health() if health is not None else {})

    async def listing(request: Request) -> Response:
        if not auth.allows(request):
            return _denied()
        try:
            q = _request_query(request)
            rows = await requests.query(q)
        except GatewayError as err:
            return _error(err)
        except StoreError as exc:
            return _store_error(exc)
        cursor = str(rows[-1]["id"]) if len(rows) == q.limit else None
        return _json({"object": "list", "data": rows, "next_cursor": cursor})

    async def one(request: Request) -> Response:
        if not auth.allows(request):
            return _denied()
        rid = request.path_params["request_id"]
        try:
            row = await requests.get(rid)
        except StoreError as exc:
            return _store_error(exc)
        if row is None:
            return _error(GatewayError(f"request_id = {rid!r}: no such request in the log", code="not_found",
                                       type="invalid_request_error"), 404)
        return _json(row)

    return [
        Route(f"{ADMIN_PREFIX}/requests", listing, methods=["GET"]),
        Route(f"{ADMIN_PREFIX}/requests/{{request_id}}", one, methods=["GET"]),
        Route(f"{ADMIN_PREFIX}/health", status, methods=["GET"]),
    ]


def admin_routes(accounts: Accounts, auth: AdminAuth | None) -> list[Route]:
    """The admin routes (none when no admin key is configured)."""
    if auth is None or accounts.store_url is None:
        return []

    def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not auth.allows(request):
                return _denied()
            st = accounts.store
            if st is None:
                return _error(AccountsUnavailableError("The gateway's store is not open."))
            try:
                return await handler(request, st)
            except GatewayError as err:
                return _error(err)
            except StoreError as exc:
                return _store_error(exc)

        return endpoint

    p = ADMIN_PREFIX
    return [
        Route(f"{p}/projects", wrap(_list_projects), methods=["GET"]),
        Route(f"{p}/projects", wrap(_create_project), methods=["POST"]),
        Route(f"{p}/projects/{{name}}", wrap(_get_project), methods=["GET"]),
        Route(f"{p}/projects/{{name}}", wrap(_patch_project), methods=["PATCH"]),
        Route(f"{p}/projects/{{name}}/keys", wrap(_list_keys), methods=["GET"]),
        Route(f"{p}/projects/{{name}}/keys", wrap(_create_key), methods=["POST"]),
        Route(f"{p}/keys/{{key_id}}", wrap(_patch_key), methods=["PATCH"]),
        Route(f"{p}/keys/{{key_id}}", wrap(_revoke_key), methods=["DELETE"]),
        Route(f"{p}/usage", wrap(_usage), methods=["GET"]),
        Route(f"{p}/certifications", wrap(_certifications), methods=["GET"]),
    ]
