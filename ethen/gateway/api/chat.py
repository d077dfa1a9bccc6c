"""``POST /chat/completions``: the chat endpoint, buffered or SSE, over the shared request path
(:mod:`ethen.gateway.api.pipeline`: auth -> parse -> decide -> rate limits -> budget hold -> executor ->
settle).

The buffered answer is the upstream's with the receipt at ``ethen.routing``, sent once its spend is settled;
a stream is relayed by :class:`~ethen.gateway.api.relay.StreamRelay` (the terminal chunk carries the receipt;
the behaviour is documented in :mod:`ethen.gateway.api.app`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ethen.gateway.api.execute import BufferedRun, StreamRun
from ethen.gateway.api.pipeline import Call, Pipeline
from ethen.gateway.api.relay import StreamRelay
from ethen.gateway.api.sse import dumps
from ethen.gateway.errors import GatewayError

__all__ = ["chat_endpoint"]

_JSON = "application/json"


def _stream(pipe: Pipeline, call: Call, run: StreamRun) -> Response:
    assert call.hold is not None
    relay = StreamRelay(run, call.receipt, call.include_usage, call.rid, call.t0, call.label, call.hold,
                        pipe.gw.metrics, pipe.stream_end(call))
    return StreamingResponse(relay.frames(), 200, relay.headers(), media_type="text/event-stream")


def chat_endpoint(pipe: Pipeline) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /chat/completions`` handler of one gateway."""

    async def chat(request: Request) -> Response:
        call = pipe.start(request)

        def render(res: BufferedRun) -> bytes:
            out = res.body
            out["ethen"] = {"routing": call.receipt(res.attempts, res.target, res.receipt_extra)}
            return dumps(out)

        try:
            await pipe.admit(call, request)  # auth, parse, decide, rate limits, budget hold
            assert call.decision is not None and call.hold is not None
            if call.stream:
                return _stream(pipe, call, await pipe.open_stream(call))
            res, content = await pipe.run_buffered(call, render)  # settled before the answer leaves
            return Response(content, 200, pipe.served(call, res.upstream_s), media_type=_JSON)
        except GatewayError as err:
            return pipe.failed(call, err)

    return chat
