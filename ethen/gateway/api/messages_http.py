"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API inbound (issue
26), so the ``anthropic`` SDKs and Claude Code work through the gateway unchanged.

The body is translated into a chat-completions body (:mod:`ethen.gateway.api.messages`) and runs through the
very
request path chat completions use (:mod:`ethen.gateway.api.pipeline`: auth, ``ethen/*`` aliases, hard gates,
fallback chain, rate limits, budgets, request log, receipt); the answer is translated back
(:mod:`ethen.gateway.api.messages_stream`). Both endpoints are also served under ``/api/gateway/v1``; a query
string (Claude Code's ``?beta=true``) is ignored.

- Auth: ``x-api-key: <key>`` or ``Authorization: Bearer <key>``, the same keys as chat
  (:func:`ethen.gateway.accounting.auth.authorization`). ``anthropic-version`` and ``anthropic-beta`` are
  accepted and
  not checked: an unknown beta does not fail the request (nothing a beta enables is sent to chat upstreams).
- Model names: :func:`ethen.gateway.api.messages.resolve_model` (an alias, a route, or the ``[model_map]``
  config table); when a name was mapped, the receipt carries ``model_map: {"requested", "routed_as"}`` and
  the request log the routed name.
- Buffered: the Message object with the routing receipt at a top-level ``ethen.routing``. Streamed: the
  events of :class:`~ethen.gateway.api.messages_stream.MessageEvents`; ``message_start``'s message carries the
  receipt as it stands when the stream opens, ``message_delta`` the final one (with ``overhead_ms``).
- Errors: Anthropic's envelope and statuses (:func:`error_status_and_type`, the one mapping from the
  gateway's error table), with ``x-request-id`` / ``request-id`` headers and ``retry-after`` when the error
  has one. A refusal before the stream starts is such a JSON response, as on chat.
- Native pass-through: the executor gets a :class:`~ethen.gateway.providers.anthropic_native.NativeBody`
  (the chat body plus the client's Messages body and ``anthropic-beta``); when the candidate that serves is a
  ``kind = "anthropic"`` provider, it sends the client's body as it is and the answer (the Message, or the
  upstream's events) goes back as it came, plus the receipt (``ethen`` on the Message, in ``message_start``'s
  message and on ``message_delta``). Which way a stream went is read from its first chunk.
- ``count_tokens``: ``{"input_tokens": N}`` where N is the gateway's own conservative estimate (the one its
  budgets and context gate use: :func:`ethen.gateway.routing.parse_requirements`, UTF-8 bytes / 3 plus
  per-message and per-image allowances), not a provider tokenizer's count; it never calls an upstream and is
  not written to the request log. It needs a key and a known (or mapped) model like ``/messages``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ethen.gateway.accounting.auth import authorization
from ethen.gateway.api.execute import Attempt, BufferedRun, RouteTarget, StreamRun
from ethen.gateway.api.messages import resolve_model, to_chat
from ethen.gateway.api.messages_stream import MessageEvents, NativeEvents, from_chat
from ethen.gateway.api.pipeline import Call, Pipeline
from ethen.gateway.api.relay import StreamRelay
from ethen.gateway.api.sse import decode_frame, dumps
from ethen.gateway.errors import HTTP_STATUS, GatewayError, InvalidRequestError, http_status
from ethen.gateway.providers.anthropic_native import (
    NATIVE_KEY,
    NativeAnswer,
    NativeBody,
)
from ethen.gateway.routing import parse_requirements

__all__ = ["ANTHROPIC_ERRORS", "error_body", "error_status_and_type", "messages_endpoints", "status_of_code"]

Handler = Callable[[Request], Awaitable[Response]]
#: Anthropic's status -> error type (the statuses its API answers with)
ANTHROPIC_ERRORS: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
_JSON = "application/json"


# --- errors: the one mapping ------------------------------------------------------------------------------


def error_status_and_type(status: int) -> tuple[int, str]:
    """The gateway's HTTP status (from its one error table) as Anthropic's ``(status, error type)``: 400, 401,
    402, 403, 404, 413, 429, 500, 504 as they are; 503 -> 529 ``overloaded_error``; any other 4xx (422: no
    candidate can serve the request) -> 400 ``invalid_request_error``; any other 5xx -> 500 ``api_error``."""
    if status == 503:
        return 529, "overloaded_error"
    if status in ANTHROPIC_ERRORS:
        return status, ANTHROPIC_ERRORS[status]
    if 400 <= status < 500:
        return 400, "invalid_request_error"
    return 500, "api_error"


def _subclasses(cls: type[GatewayError]) -> list[type[GatewayError]]:
    out: list[type[GatewayError]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def status_of_code(code: object) -> int:
    """The HTTP status of the gateway error class whose default code is ``code`` (500 when none is): how a
    stream's error envelope, which carries a code and no status, finds its Anthropic type."""
    for cls in _subclasses(GatewayError):
        if cls.default_code == code:
            return next((HTTP_STATUS[c] for c in cls.__mro__ if c in HTTP_STATUS), 500)
    return 500


def _type_of_code(code: object) -> str:
    return error_status_and_type(status_of_code(code))[1]


def error_body(err: GatewayError, request_id: str | None) -> tuple[int, dict[str, Any]]:
    """``(Anthropic status, Anthropic error envelope)`` for a gateway error; ``code`` and ``param`` carry the
    gateway's specific code and the offending field, and the error's other details (``rejections``,
    ``attempts``, ``retry_after_s``) come along as on chat."""
    status, kind = error_status_and_type(http_status(err))
    details = {k: v for k, v in err.to_dict()["error"].items()
               if k not in ("type", "message") and v is not None}
    return status, {"type": "error", "error": {"type": kind, "message": err.message, **details},
                    "request_id": request_id}


def _error_response(err: GatewayError, request_id: str) -> Response:
    status, body = error_body(err, request_id)
    headers = {"x-request-id": request_id, "request-id": request_id}
    retry_after = getattr(err, "retry_after_s", None)
    if isinstance(retry_after, int):
        headers["retry-after"] = str(retry_after)
    return Response(dumps(body), status, headers, media_type=_JSON)


# --- the endpoints ----------------------------------------------------------------------------------------


class _Asked:
    """What the client asked for: its model name, the routed one, its stop sequences."""

    def __init__(self) -> None:
        self.model = ""
        self.routed = ""
        self.stops: tuple[str, ...] = ()
        self.native_only: list[str] = []  # fields only a native provider can carry (routed to those only)

    def receipt(self, call: Call) -> Callable[[list[Attempt], RouteTarget, Mapping[str, Any] | None],
                                              dict[str, Any]]:
        def build(attempts: list[Attempt], target: RouteTarget, extra: Mapping[str, Any] | None
                  ) -> dict[str, Any]:
            routing = call.receipt(attempts, target, extra)
            if self.routed != self.model:
                routing.setdefault("model_map", {"requested": self.model, "routed_as": self.routed})
            if self.native_only:
                routing.setdefault("native_only", self.native_only)
            return routing

        return build


def _native(first: bytes) -> bool:
    """Whether a stream's first chunk is a native Anthropic provider's (it carries the upstream's event)."""
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and NATIVE_KEY in obj


def _stream(pipe: Pipeline, call: Call, run: StreamRun, asked: _Asked) -> Response:
    assert call.hold is not None and call.decision is not None
    receipt = asked.receipt(call)
    relay = StreamRelay(run, receipt, True, call.rid, call.t0, call.label, call.hold, pipe.gw.metrics,
                        pipe.stream_end(call))
    opening = receipt(run.attempts, run.target, run.stream.receipt_extra)
    events: MessageEvents | NativeEvents = (
        NativeEvents(NATIVE_KEY, opening) if _native(run.first)
        else MessageEvents(asked.model, asked.stops, call.decision.requirements.input_tokens))

    async def frames() -> AsyncIterator[bytes]:
        inner: AsyncGenerator[bytes, None] = relay.frames()  # type: ignore[assignment]
        try:
            for frame in events.start(opening):
                yield frame
            async for chunk in inner:
                decoded = decode_frame(chunk)
                if decoded is None:
                    continue  # [DONE], or an upstream chunk that is no JSON: nothing to translate
                is_error, obj = decoded
                if is_error:
                    yield events.error(obj, _type_of_code)
                    return
                for frame in events.complete(obj) if "ethen" in obj else events.chunk(obj):
                    yield frame
        finally:
            with contextlib.suppress(Exception):
                await inner.aclose()  # a client gone: the relay settles and records the attempt

    headers = {**relay.headers(), "request-id": call.rid}
    return StreamingResponse(frames(), 200, headers, media_type="text/event-stream")


def messages_endpoints(
    pipe: Pipeline, model_map: Mapping[str, str], known: frozenset[str], native: Sequence[str]
) -> dict[str, Handler]:
    """The handlers of one gateway: ``{"/messages": ..., "/messages/count_tokens": ...}``; they run on a
    pipeline like ``pipe`` that answers errors in Anthropic's envelope. ``known``: the model names and
    route ids the gateway serves; ``native``: the ids of its ``kind = "anthropic"`` providers."""
    mpipe = Pipeline(pipe.gw, pipe.acc, pipe.read_body, pipe.stream_check, _error_response, pipe.request_id)
    native = sorted(native)

    def chat_of(body: Mapping[str, Any], asked: _Asked, count_only: bool = False) -> dict[str, Any]:
        """The chat translation; a body only a native provider can carry is routed to those only."""
        try:
            chat = to_chat(body, count_only=count_only)
        except InvalidRequestError as err:
            if err.code != "unsupported_value" or not native:
                raise
            chat = to_chat(body, count_only=count_only, drop=asked.native_only)
            chat["providerOptions"] = {"gateway": {"only": native}}
        asked.model = chat["model"]
        asked.routed = chat["model"] = resolve_model(chat["model"], known, model_map)
        asked.stops = tuple(chat.get("stop", ()))
        return chat

    async def messages(request: Request) -> Response:
        call = mpipe.start(request)
        asked = _Asked()
        raw: list[dict[str, Any]] = []

        def translate(body: dict[str, Any]) -> dict[str, Any]:
            raw.append(body)
            return chat_of(body, asked)

        try:
            await mpipe.admit(call, request, translate)
            assert call.payload is not None
            call.payload = NativeBody(call.payload, raw[0], request.headers.get("anthropic-beta"))
            if call.stream:
                return _stream(mpipe, call, await mpipe.open_stream(call), asked)

            def render(res: BufferedRun) -> bytes:
                body = res.body
                out = dict(body.message) if isinstance(body, NativeAnswer) else from_chat(body, asked.model,
                                                                                          asked.stops)
                out["ethen"] = {"routing": asked.receipt(call)(res.attempts, res.target, res.receipt_extra)}
                return dumps(out)

            res, content = await mpipe.run_buffered(call, render)
            headers = {**mpipe.served(call, res.upstream_s), "request-id": call.rid}
            return Response(content, 200, headers, media_type=_JSON)
        except GatewayError as err:
            return mpipe.failed(call, err)

    async def count_tokens(request: Request) -> Response:
        rid = mpipe.request_id(request)
        try:
            await mpipe.acc.authenticate(authorization(request.headers))
            chat = chat_of(await mpipe.read_body(request), _Asked(), count_only=True)
            tokens = parse_requirements(chat).input_tokens
        except GatewayError as err:
            return _error_response(err, rid)
        return Response(dumps({"input_tokens": tokens}), 200, {"x-request-id": rid, "request-id": rid},
                        media_type=_JSON)

    return {"/messages": messages, "/messages/count_tokens": count_tokens}
