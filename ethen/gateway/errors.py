"""One exception tree for the gateway, and one table from error class to HTTP status.

Every error the gateway raises is a :class:`GatewayError` carrying the fields of the OpenAI error envelope
(``{"error": {"message", "type", "param", "code"}}``). The routing core raises these directly; the HTTP shell
turns them into responses with :func:`http_status` (this module imports nothing from HTTP libraries: the
table is plain data). Upstream/auth errors are added to this tree by the service layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "HTTP_STATUS",
    "CatalogError",
    "GatewayConfigError",
    "GatewayError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "NoHealthyCandidateError",
    "NoSmartRouteCandidateError",
    "http_status",
]


class GatewayError(Exception):
    """Base of every gateway error. ``code`` is machine-readable, ``param`` names the offending field."""

    default_code = "gateway_error"
    default_type = "api_error"
    #: a refused request's routing facts for the request log (its ``receipt``), set where the refusal is
    #: decided (``ethen.gateway.routing.decide``): requirements, rejections with their reasons. Never sent to
    #: the client beyond what ``to_dict`` holds.
    receipt: Mapping[str, Any] | None = None

    def __init__(
        self,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        self.type = type if type is not None else self.default_type

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error envelope body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, param={self.param!r}, message={self.message!r})"


class InvalidRequestError(GatewayError):
    """The client's body is malformed. ``code`` is ``invalid_request_error`` or a more specific one:
    ``missing_required_parameter``, ``invalid_type``, ``invalid_value``. ``param`` is the dotted field path,
    e.g. ``metadata.routing.budget_ceiling_usd`` or ``messages[2].content[0].type``."""

    default_code = "invalid_request_error"
    default_type = "invalid_request_error"


class ModelNotFoundError(GatewayError):
    """Unknown concrete model id, or unknown ``ethen/*`` alias (same error for both, per the spec)."""

    default_code = "model_not_found"
    default_type = "invalid_request_error"

    def __init__(self, model: str, hint: str = "") -> None:
        super().__init__(
            f"The model {model!r} does not exist or you do not have access to it."
            + (f" {hint}" if hint else ""),
            param="model",
        )
        self.model = model


class NoSmartRouteCandidateError(GatewayError):
    """Fail closed: no candidate satisfies the request. ``rejections`` holds every rejected candidate with its
    reason codes (a tuple of ``ethen.gateway.routing.Rejection``)."""

    default_code = "no_smart_route_candidate"
    default_type = "invalid_request_error"

    def __init__(self, message: str, rejections: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.rejections = rejections

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["rejections"] = [r.to_dict() if hasattr(r, "to_dict") else r for r in self.rejections]
        return body


class NoHealthyCandidateError(NoSmartRouteCandidateError):
    """An outage, not the client's fault: every candidate that could serve the request is excluded only by
    recent telemetry (``provider_failing`` / ``candidate_failing``) and none may get a trial now. HTTP 503
    with ``Retry-After: retry_after_s`` (whole seconds until the earliest of them may get a trial);
    ``rejections`` as for the parent class."""

    default_code = "no_healthy_candidate"
    default_type = "api_error"

    def __init__(self, message: str, rejections: tuple[Any, ...] = (), retry_after_s: int = 2) -> None:
        super().__init__(message, rejections)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["retry_after_s"] = self.retry_after_s
        return body


class GatewayConfigError(GatewayError):
    """Operator configuration is inconsistent (e.g. two candidates with the same id). Never a client error."""

    default_code = "gateway_config_error"
    default_type = "server_error"


class CatalogError(GatewayConfigError):
    """The model catalog cannot be built: missing data source, unknown model, bad override (names the key)."""

    default_code = "catalog_error"


#: The one table: error class -> HTTP status. :func:`http_status` walks the class MRO, so subclasses inherit
#: their parent's status unless listed here. The service layer adds its own classes to this mapping.
HTTP_STATUS: dict[type[GatewayError], int] = {
    GatewayError: 500,
    InvalidRequestError: 400,
    ModelNotFoundError: 404,
    NoSmartRouteCandidateError: 422,
    NoHealthyCandidateError: 503,
    GatewayConfigError: 500,
}


def http_status(error: GatewayError, table: Mapping[type[GatewayError], int] = HTTP_STATUS) -> int:
    """HTTP status for ``error``: the entry of its nearest class in ``table``."""
    for cls in type(error).__mro__:
        if issubclass(cls, GatewayError) and cls in table:
            return table[cls]
    return 500


# ----------------------------------------------------------------------------------------------------
# Service-layer errors (issue 4: auth, upstream calls, fallback). Owned by the gateway service; kept in this
# one section. ``retryable`` tells the executor whether the next candidate of the fallback chain may be tried;
# ``error_class`` is the short label used in telemetry, metrics and receipts.
# ----------------------------------------------------------------------------------------------------


class AuthenticationError(GatewayError):
    """Missing, malformed or unknown API key (``Authorization: Bearer ethen...``)."""

    default_code = "invalid_api_key"
    default_type = "invalid_request_error"


class RequestTooLargeError(InvalidRequestError):
    """The request body exceeds the gateway's size limit."""

    default_code = "request_too_large"


class UpstreamError(GatewayError):
    """A provider call failed. ``provider`` is the provider id; ``upstream_status`` the upstream HTTP status
    when there was one. Messages never contain credentials."""

    default_code = "upstream_error"
    default_type = "api_error"
    retryable: bool = True
    error_class: str = "upstream_error"
    #: whether the failure is evidence against the provider's health (telemetry gates, circuits): not for a
    #: request-caused 4xx nor for a provider that is only full (:class:`MeshSaturatedError`)
    health_evidence: bool = True

    def __init__(self, message: str, provider: str = "", upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.provider = provider
        self.upstream_status = upstream_status


class UpstreamTimeoutError(UpstreamError):
    """Connect, first-byte or total timeout."""

    default_code = "upstream_timeout"
    error_class = "timeout"


class UpstreamConnectionError(UpstreamError):
    """Could not connect, or the connection broke before an answer."""

    default_code = "upstream_connection_error"
    error_class = "connect_error"


class UpstreamRateLimitError(UpstreamError):
    """The upstream answered 429."""

    default_code = "upstream_rate_limited"
    error_class = "rate_limited"


class UpstreamServerError(UpstreamError):
    """The upstream answered 5xx (or sent an error object in its stream)."""

    default_code = "upstream_server_error"
    error_class = "server_error"


class UpstreamRejectedError(UpstreamError):
    """The upstream answered 401/403/404: the operator's credentials or model mapping are wrong for that
    provider, not the client's request, so the next candidate is tried."""

    default_code = "upstream_rejected"
    error_class = "rejected"


class UpstreamInvalidResponseError(UpstreamError):
    """The upstream answered 2xx with a body that is not a chat completion."""

    default_code = "upstream_invalid_response"
    error_class = "invalid_response"


class UpstreamStreamError(UpstreamError):
    """The upstream stream broke or ended without its end marker after chunks were already sent."""

    default_code = "upstream_stream_interrupted"
    error_class = "stream_cut"


class UpstreamBadRequestError(UpstreamError):
    """The upstream rejected the request itself (4xx other than 401/403/404/408/429): caused by the request,
    so it is not retried elsewhere. The upstream's own message is passed on."""

    default_code = "upstream_bad_request"
    default_type = "invalid_request_error"
    retryable = False
    error_class = "bad_request"
    health_evidence = False


class UpstreamContentFilterError(UpstreamBadRequestError):
    """The upstream's safety system refused the prompt (Azure's ``content_filter`` 400, Gemini's
    ``promptFeedback.blockReason``): request-caused, not retried; the upstream's reason is passed on."""

    default_code = "content_filter"
    error_class = "content_filter"


class MeshSaturatedError(UpstreamError):
    """The mesh cannot take the request in time (its workers' queues or session caps are full): refused before
    the first byte (issue 42). Retryable (the next candidate of the fallback chain is tried); alone, 503 with
    ``Retry-After: retry_after_s``. Not evidence against the mesh's health (it works, it is full)."""

    default_code = "mesh_saturated"
    error_class = "saturated"
    health_evidence = False

    def __init__(self, message: str, provider: str = "", retry_after_s: int = 1) -> None:
        super().__init__(message, provider)
        self.retry_after_s = max(1, int(retry_after_s))

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["retry_after_s"] = self.retry_after_s
        return body


class FallbackExhaustedError(GatewayError):
    """Every candidate of the fallback chain failed. ``attempts`` lists them (candidate, error class)."""

    default_code = "all_candidates_failed"
    default_type = "api_error"

    def __init__(self, message: str, attempts: tuple[Mapping[str, Any], ...] = ()) -> None:
        super().__init__(message)
        self.attempts = attempts

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["attempts"] = [dict(a) for a in self.attempts]
        return body


HTTP_STATUS.update(
    {
        AuthenticationError: 401,
        RequestTooLargeError: 413,
        UpstreamError: 502,
        UpstreamTimeoutError: 504,
        UpstreamRateLimitError: 429,
        UpstreamBadRequestError: 400,
        MeshSaturatedError: 503,
        FallbackExhaustedError: 502,
    }
)
__all__ += [
    "AuthenticationError",
    "FallbackExhaustedError",
    "MeshSaturatedError",
    "RequestTooLargeError",
    "UpstreamBadRequestError",
    "UpstreamConnectionError",
    "UpstreamContentFilterError",
    "UpstreamError",
    "UpstreamInvalidResponseError",
    "UpstreamRateLimitError",
    "UpstreamRejectedError",
    "UpstreamServerError",
    "UpstreamStreamError",
    "UpstreamTimeoutError",
]


# --- accounts (projects, keys, budgets): raised by ethen.gateway.accounting.accounts on the request path --


class BudgetExceededError(GatewayError):
    """The project's remaining window budget cannot cover the request's estimated cost."""

    default_code = "budget_exceeded"
    default_type = "insufficient_quota"

    def __init__(self, message: str, rejections: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.rejections = rejections

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        if self.rejections:
            body["error"]["rejections"] = [r.to_dict() for r in self.rejections]
        return body


class AccountsUnavailableError(GatewayError):
    """The gateway's database failed; the request was not served."""

    default_code = "store_unavailable"
    default_type = "api_error"


HTTP_STATUS.update({BudgetExceededError: 402, AccountsUnavailableError: 503})
__all__ += ["AccountsUnavailableError", "BudgetExceededError"]


# --- several instances: shared state (Redis) and rate limits (ethen.gateway.shared, .ratelimit) ---------


class SharedStateUnavailableError(GatewayError):
    """Redis (``[shared] redis_url``) could not be reached or failed; the message names no URL or password.
    ``ethen.gateway.shared`` raises it at its one boundary for every redis-py error."""

    default_code = "shared_state_unavailable"
    default_type = "api_error"
    retry_after_s = 1


class RateLimitExceededError(GatewayError):
    """A key's or project's requests or tokens per window are used up: 429 with ``Retry-After`` (whole seconds
    until enough of the window has passed). ``type`` is ``requests`` or ``tokens``, as OpenAI's own 429s."""

    default_code = "rate_limit_exceeded"
    default_type = "requests"

    def __init__(self, message: str, retry_after_s: int, type: str = "requests") -> None:
        super().__init__(message, type=type)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["retry_after_s"] = self.retry_after_s
        return body


class RateLimiterUnavailableError(SharedStateUnavailableError):
    """A key with a rate limit cannot be checked because Redis is unreachable: the request is refused (fail
    closed, 503, ``Retry-After: 1``); keys without a limit keep being served."""

    default_code = "rate_limiter_unavailable"


HTTP_STATUS.update(
    {SharedStateUnavailableError: 503, RateLimitExceededError: 429, RateLimiterUnavailableError: 503}
)
__all__ += ["RateLimitExceededError", "RateLimiterUnavailableError", "SharedStateUnavailableError"]


# --- shadow evaluation (issue 27: ethen.admin.shadows) ---------------------------------------------------


class PromotionRefusedError(GatewayError):
    """``POST /api/admin/v1/shadows/promote``: the shadow's recorded pairs do not meet its ``min_samples`` /
    ``min_success_rate`` (the message says which)."""

    default_code = "promotion_refused"
    default_type = "invalid_request_error"


class NotFoundError(GatewayError):
    """An admin resource that does not exist (e.g. no ``[[shadows]]`` rule for an alias and candidate)."""

    default_code = "not_found"
    default_type = "invalid_request_error"


HTTP_STATUS.update({PromotionRefusedError: 409, NotFoundError: 404})
__all__ += ["NotFoundError", "PromotionRefusedError"]
