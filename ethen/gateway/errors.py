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
    "GatewayConfigError",
    "GatewayError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "NoSmartRouteCandidateError",
    "http_status",
]


class GatewayError(Exception):
    """Base of every gateway error. ``code`` is machine-readable, ``param`` names the offending field."""

    default_code = "gateway_error"
    default_type = "api_error"

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

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model {model!r} does not exist or you do not have access to it.", param="model"
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


class GatewayConfigError(GatewayError):
    """Operator configuration is inconsistent (e.g. two candidates with the same id). Never a client error."""

    default_code = "gateway_config_error"
    default_type = "server_error"


#: The one table: error class -> HTTP status. :func:`http_status` walks the class MRO, so subclasses inherit
#: their parent's status unless listed here. The service layer adds its own classes to this mapping.
HTTP_STATUS: dict[type[GatewayError], int] = {
    GatewayError: 500,
    InvalidRequestError: 400,
    ModelNotFoundError: 404,
    NoSmartRouteCandidateError: 422,
    GatewayConfigError: 500,
}


def http_status(error: GatewayError, table: Mapping[type[GatewayError], int] = HTTP_STATUS) -> int:
    """HTTP status for ``error``: the entry of its nearest class in ``table``."""
    for cls in type(error).__mro__:
        if issubclass(cls, GatewayError) and cls in table:
            return table[cls]
    return 500
