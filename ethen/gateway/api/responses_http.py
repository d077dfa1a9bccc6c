"""``POST /responses``: the Responses API handler (translation in :mod:`ethen.gateway.api.responses` and
:mod:`ethen.gateway.api.responses_stream`, the request path in :mod:`ethen.gateway.api.pipeline`).

Buffered: the Response object, with the receipt at ``ethen.routing`` and the same ``x-request-id`` /
``x-ethen-overhead-ms`` headers as chat completions. Streamed: the chat stream is relayed by the very
:class:`~ethen.gateway.api.relay.StreamRelay` chat completions use (with usage requested, so the terminal
chunk carries it): it records the attempt, settles the spend and counts the metrics; each chunk it yields is
re-read here (one ``json.loads`` per chunk) and turned into Responses events. A refusal before the stream
starts is the plain JSON error envelope with its HTTP status, as on chat.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ethen.gateway.api.execute import BufferedRun, StreamRun
from ethen.gateway.api.pipeline import Call, Pipeline
from ethen.gateway.api.relay import StreamRelay
from ethen.gateway.api.responses import Echo, from_chat, new_id, to_chat
from ethen.gateway.api.responses_stream import ResponsesEvents
from ethen.gateway.api.responses_tools import DROPPED_HEADER
from ethen.gateway.api.sse import decode_frame, dumps
from ethen.gateway.errors import GatewayError

__all__ = ["responses_endpoint"]



def _headers(headers: dict[str, str], echo: Echo) -> dict[str, str]:
    if echo.dropped:
        headers[DROPPED_HEADER] = ",".join(dict.fromkeys(d["type"] for d in echo.dropped))
    return headers


def _stream(pipe: Pipeline, call: Call, run: StreamRun, events: ResponsesEvents, echo: Echo) -> Response:
    assert call.hold is not None
    relay = StreamRelay(run, call.receipt, True, call.rid, call.t0, call.label, call.hold,
                        pipe.gw.metrics, pipe.stream_end(call))

    async def frames() -> AsyncIterator[bytes]:
        inner: AsyncGenerator[bytes, None] = relay.frames()  # type: ignore[assignment]
        try:
            for frame in events.start(run.first):
                yield frame
            async for chunk in inner:
                decoded = decode_frame(chunk)
                if decoded is None:
                    continue  # [DONE], or an upstream chunk that is no JSON: nothing to translate
                is_error, obj = decoded
                if is_error:
                    yield events.error(obj)
                    return
                out = events.complete(obj) if "ethen" in obj else events.chunk(obj)
                for frame in out:
                    yield frame
        finally:
            with contextlib.suppress(Exception):
                await inner.aclose()  # a client gone: the relay settles and records the attempt

    return StreamingResponse(frames(), 200, _headers(relay.headers(), echo), media_type="text/event-stream")


def responses_endpoint(pipe: Pipeline, drop_hosted: bool = True) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /responses`` handler of one gateway.

    ``drop_hosted``: ``[compat] drop_unsupported_tools``."""

    async def responses(request: Request) -> Response:
        call = pipe.start(request)
        echoes: list[Echo] = []

        def translate(body: dict[str, Any]) -> dict[str, Any]:
            chat, echo = to_chat(body, drop_hosted)
            echoes.append(echo)
            if echo.dropped:  # on the receipt and in the request log
                call.notes["dropped_tools"] = echo.dropped
            return chat

        try:
            await pipe.admit(call, request, translate)
            resp_id, created = new_id("resp"), int(time.time())
            if call.stream:
                run = await pipe.open_stream(call)
                return _stream(pipe, call, run, ResponsesEvents(resp_id, created, echoes[0]), echoes[0])

            def render(res: BufferedRun) -> bytes:
                out = from_chat(res.body, echoes[0], resp_id, created)
                out["ethen"] = {"routing": call.receipt(res.attempts, res.target, res.receipt_extra)}
                return dumps(out)

            res, content = await pipe.run_buffered(call, render)
            headers = _headers(pipe.served(call, res.upstream_s), echoes[0])
            return Response(content, 200, headers, media_type="application/json")
        except GatewayError as err:
            return pipe.failed(call, err)

    return responses
