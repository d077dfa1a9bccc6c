"""The SSE answer of a streamed chat completion: relay the upstream's chunks, put the receipt on the terminal
chunk, settle the spend, and record the metrics (time to first token among them).

:class:`StreamRelay` is what ``POST /chat/completions`` with ``stream: true`` returns as its body once the
executor has opened a stream (:class:`~ethen.gateway.api.execute.StreamRun`: the first chunk is read).
Behaviour (documented in :mod:`ethen.gateway.api.app`): without ``stream_options.include_usage`` the
upstream's
last chunk with a ``finish_reason`` is held back until the upstream ends and carries the receipt; with it,
the usage chunk does; a break after the first chunk ends with ``event: error``; a client gone before the end
settles and counts ``client_closed``.

Time to first token (``ethen_gateway_ttft_seconds``, and the ``ttft_ms`` telemetry the router scores) is the
time to the first chunk that carries content: a non-empty ``delta.content`` or ``refusal``, or a
``tool_calls`` entry (:func:`~ethen.gateway.api.execute.has_content`, a bytes regex). Providers open with a
role-only chunk (``{"role": "assistant", "content": ""}``) within milliseconds, long before the first token
(~1 s on the mesh), so timing the first chunk measured the connection, not the model. Only chunks until the
first content are scanned; a stream that never carries content records no TTFT.

``on_end`` (the pipeline's :meth:`~ethen.gateway.api.pipeline.Pipeline.stream_end`) is called once when the
stream ends, whichever way (``ok``, ``stream_error``, ``client_closed``): the request log's hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from ethen.gateway.accounting.accounts import AccountsUnavailableError, Hold
from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.api.execute import Attempt, RouteTarget, StreamRun, chunk_meta, has_content
from ethen.gateway.api.sse import DONE_FRAME, encode_data, encode_error, encode_json
from ethen.gateway.errors import UpstreamError
from ethen.gateway.observation.metrics import GatewayMetrics

__all__ = ["Receipt", "StreamRelay"]

log = logging.getLogger("ethen.gateway")

#: ``(attempts, served target, provider receipt extras) -> ethen.routing`` of the request's decision
Receipt = Callable[[list[Attempt], RouteTarget, Mapping[str, Any] | None], dict[str, Any]]
#: ``(relay, outcome, error code, perf_counter at the end)``: called once when the stream ends
OnEnd = Callable[["StreamRelay", str, str | None, float], None]

#: a stream chunk whose ``finish_reason`` is set (a string, not ``null``)
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')


def _finish_chunk(payload: bytes) -> dict[str, Any] | None:
    """The upstream's finish chunk as a dict, to carry the receipt; ``None`` if it is not a JSON object."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("choices"), list) else None


class StreamRelay:
    """One streamed answer; iterate :meth:`frames` (once) for the SSE body."""

    def __init__(self, run: StreamRun, receipt: Receipt, include_usage: bool, rid: str, t0: float,
                 label: str, hold: Hold, metrics: GatewayMetrics, on_end: OnEnd | None = None) -> None:
        self.run = run
        self.receipt = receipt
        self.include_usage = include_usage
        self.rid = rid
        self.t0 = t0  # the request's arrival (perf_counter)
        self.label = label
        self.hold = hold
        self.m = metrics
        self.held: bytes | None = None  # the finish chunk held back to carry the receipt
        self.done = False  # the stream reached an end it reported (terminal chunk or error event)
        self.opened = time.perf_counter()
        self.overhead_at_open = max(0.0, self.opened - t0 - run.upstream_s)
        self.on_end = on_end
        self.ttft_s: float | None = None  # arrival -> first content chunk
        self.overhead_s: float | None = None  # the whole stream's overhead (set at its terminal chunk)
        self.awaiting_content = not has_content(run.first)
        if not self.awaiting_content:
            self.ttft_s = self.opened - t0
            metrics.ttft.observe(self.ttft_s)

    async def frames(self) -> AsyncIterator[bytes]:
        """The SSE frames; whatever way the stream ends, the attempt is recorded and the spend settled."""
        body = self._frames()
        try:
            async for frame in body:
                yield frame
        finally:
            await body.aclose()
            if not self.done:
                await self._client_gone()
            with contextlib.suppress(Exception):
                await self.run.stream.aclose()

    async def _frames(self) -> AsyncGenerator[bytes, None]:
        run = self.run
        upstream_after_first = time.perf_counter()
        for frame in self._relay(run.first):
            yield frame
        try:
            async for payload in run.stream:
                if self.awaiting_content and has_content(payload):
                    self._first_content()
                for frame in self._relay(payload):
                    yield frame
        except UpstreamError as err:
            for frame in self._release():
                yield frame
            yield await self._broken(err)
            return
        run.finish(None)
        if not await self.hold.settle_or_log(run.target.candidate, run.stream.usage):
            self.done = True
            lost = AccountsUnavailableError("The gateway could not record the request's spend.")
            self._ended("stream_error", lost.code, time.perf_counter())
            yield encode_error(lost.to_dict())
            return
        end = time.perf_counter()
        upstream = run.upstream_s + (end - upstream_after_first)
        terminal, before = self._terminal(end, upstream)
        if before is not None:  # the held chunk was no JSON object: sent as it came, then a terminal chunk
            yield before
        self.done = True
        self.m.requests.labels(self.label, "true", "200").inc()
        self.m.latency.labels("true").observe(end - self.t0)
        self.overhead_s = max(0.0, end - self.t0 - upstream)
        self.m.overhead.observe(self.overhead_s)
        self._ended("ok", None, end)
        yield encode_json(terminal)
        yield DONE_FRAME


    def headers(self) -> dict[str, str]:
        """The stream response's headers: request id, the gateway's overhead until it opened, no caching."""
        return {
            "x-request-id": self.rid,
            "x-ethen-overhead-ms": f"{self.overhead_at_open * 1000:.3f}",
            "cache-control": "no-cache",
            **self.run.headers,
        }

    def _first_content(self) -> None:
        now = time.perf_counter()
        self.awaiting_content = False
        self.run.ttft_s = now - self.run.started  # the serving attempt's TTFT, for the router's telemetry
        self.ttft_s = now - self.t0
        self.m.ttft.observe(self.ttft_s)

    def _release(self) -> tuple[bytes, ...]:
        """The held finish chunk, if any (it turned out not to be the last)."""
        if self.held is None:
            return ()
        held, self.held = self.held, None
        return (encode_data(held),)

    def _relay(self, payload: bytes) -> tuple[bytes, ...]:
        """Frames to send for ``payload``: a held chunk first; a finish chunk is held (no include_usage)."""
        out = self._release()
        if not self.include_usage and _FINISHED.search(payload):
            self.held = payload
            return out
        return (*out, encode_data(payload))

    async def _broken(self, err: UpstreamError) -> bytes:
        run = self.run
        run.finish(err)
        await self.hold.settle_or_log(run.target.candidate, run.stream.usage)
        env = err.to_dict()
        env["ethen"] = {"routing": self.receipt(run.attempts, run.target, None)}
        self.done = True
        self.m.requests.labels(self.label, "true", "stream_error").inc()
        log.warning("stream %s broke after the first chunk: %s", self.rid, err.code)
        self._ended("stream_error", err.code, time.perf_counter())
        return encode_error(env)

    def _terminal(self, end: float, upstream: float) -> tuple[dict[str, Any], bytes | None]:
        """The terminal chunk with the receipt (and usage), and a frame to send before it if any."""
        run = self.run
        routing = self.receipt(run.attempts, run.target, run.stream.receipt_extra)
        routing["overhead_ms"] = round(max(0.0, end - self.t0 - upstream) * 1000, 3)
        if run.stream.usage is not None:
            routing["cost"] = cost_of(run.target.candidate, run.stream.usage).to_dict()
        held = self.held
        terminal = _finish_chunk(held) if held is not None else None
        before = None
        if terminal is None:
            before = encode_data(held) if held is not None else None
            terminal = {**chunk_meta(run.first), "object": "chat.completion.chunk", "choices": []}
        terminal["ethen"] = {"routing": routing}
        if self.include_usage:
            terminal["usage"] = run.stream.usage.to_openai() if run.stream.usage else None
        return terminal, before

    async def _client_gone(self) -> None:
        run = self.run
        run.finish(None, client_gone=True)
        await self.hold.settle_or_log(run.target.candidate, run.stream.usage)
        self.m.requests.labels(self.label, "true", "client_closed").inc()
        self._ended("client_closed", None, time.perf_counter())

    def _ended(self, outcome: str, code: str | None, at: float) -> None:
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end(self, outcome, code, at)
