"""A scripted OpenAI-compatible (and Anthropic Messages) upstream, served over real HTTP on 127.0.0.1.

This is the only test double in the gateway tests: it stands in for cloud LLM providers. Behaviour is scripted
per upstream model name (:class:`Behavior`): latency, TTFT, failures (HTTP status, for the first N calls or
always), mid-stream cuts (the connection is dropped after N chunks), tool calls. Every call is recorded.

:class:`ServerThread` runs any ASGI app under a real uvicorn server on an ephemeral port in a daemon thread
(it also serves the gateway under test). ``python tests/gateway/upstream.py --port P --latency-ms 50`` serves
the upstream standalone (used by ``bench/gateway_overhead.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["Behavior", "Script", "ServerThread", "make_upstream_app"]


@dataclass
class Behavior:
    """How the upstream answers one model."""

    latency_s: float = 0.0  # buffered: delay before the answer; stream: delay before the response head
    ttft_s: float = 0.0  # stream: delay between the head and the first chunk
    chunk_delay_s: float = 0.0  # stream: delay between chunks
    fail_status: int | None = None  # answer with this HTTP status ...
    fail_times: int | None = None  # ... for the first N calls (None: always)
    cut_after: int | None = None  # stream: drop the connection after N content chunks
    pieces: tuple[str, ...] = ("Hello", " from", " upstream")
    tool_call: bool = True  # answer a request carrying tools with a tool call
    prompt_tokens: int = 11
    echo_credentials: bool = False  # a leaky upstream: its error message echoes the credential it received
    answer_tool_results: bool = False  # a request whose last message is a tool result gets text, not a call
    tool_name: str | None = None  # call this tool (when the request lists it; else answer text) ...
    tool_args: str = '{"x": 1}'  # ... with these arguments (default: the first tool, {"x": 1})
    cache_read_tokens: int = 0  # of prompt_tokens, read from the prompt cache (OpenAI's and Anthropic's) ...
    cache_write_tokens: int = 0  # ... and written to it (Anthropic's usage cache_*_input_tokens)
    headers: dict[str, str] = field(default_factory=dict)  # on every chat/messages answer (rate limits)
    calls: int = 0


@dataclass
class Script:
    """Behaviours by upstream model name, plus a log of received calls."""

    behaviors: dict[str, Behavior] = field(default_factory=dict)
    default: Behavior = field(default_factory=Behavior)
    calls: list[dict[str, Any]] = field(default_factory=list)
    record: bool = True

    def behavior(self, model: str) -> Behavior:
        return self.behaviors.get(model, self.default)

    def models_called(self) -> list[str]:
        return [c["body"].get("model") for c in self.calls]


class _Cut(Exception):
    """Raised inside a streaming body: uvicorn drops the connection mid-response."""


def _failure(b: Behavior) -> int | None:
    b.calls += 1
    if b.fail_status is None:
        return None
    if b.fail_times is None or b.calls <= b.fail_times:
        return b.fail_status
    return None


def _tool_call(body: dict[str, Any], b: Behavior) -> dict[str, Any] | None:
    tools = body.get("tools")
    if not tools:
        return None
    names = [t.get("function", {}).get("name", "tool") if isinstance(t, dict) else "tool" for t in tools]
    if b.tool_name is not None and b.tool_name not in names:
        return None
    name = names[0] if b.tool_name is None else b.tool_name
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": b.tool_args}}


def make_upstream_app(script: Script) -> Starlette:
    async def chat(request: Request) -> Response:
        resp = await chat_answer(request)
        body = json.loads(await request.body())  # cached by Starlette
        resp.headers.update(script.behavior(str(body.get("model"))).headers)
        return resp

    async def chat_answer(request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if script.record:
            script.calls.append({"path": "chat", "body": body, "headers": dict(request.headers)})
        model = str(body.get("model"))
        b = script.behavior(model)
        status = _failure(b)
        if b.latency_s:
            await asyncio.sleep(b.latency_s)
        if status is not None:
            msg = f"scripted failure {status}"
            if b.echo_credentials:
                msg += f" (you sent {request.headers.get('authorization')})"
            return JSONResponse(
                {"error": {"message": msg, "type": "server_error", "code": None}},
                status_code=status,
            )
        created = int(time.time())
        tool = _tool_call(body, b) if b.tool_call else None
        if b.answer_tool_results and (body.get("messages") or [{}])[-1].get("role") == "tool":
            tool = None
        usage = {
            "prompt_tokens": b.prompt_tokens,
            "completion_tokens": len(b.pieces),
            "total_tokens": b.prompt_tokens + len(b.pieces),
        }
        if b.cache_read_tokens:  # OpenAI: of prompt_tokens, read from the prompt cache
            usage["prompt_tokens_details"] = {"cached_tokens": b.cache_read_tokens}
        if not body.get("stream"):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None if tool else "".join(b.pieces),
                "refusal": None,
            }
            if tool:
                message["tool_calls"] = [tool]
            return JSONResponse(
                {
                    "id": "chatcmpl-up1",
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": "tool_calls" if tool else "stop",
                            "logprobs": None,
                        }
                    ],
                    "usage": usage,
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
            obj = {
                "id": "chatcmpl-up1",
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        async def gen() -> AsyncIterator[bytes]:
            if b.ttft_s:
                await asyncio.sleep(b.ttft_s)
            yield chunk({"role": "assistant", "content": ""}, None)
            if tool:
                yield chunk({"tool_calls": [{"index": 0, **tool}]}, None)
            for i, piece in enumerate(() if tool else b.pieces):
                if b.cut_after is not None and i >= b.cut_after:
                    raise _Cut("scripted mid-stream cut")
                if b.chunk_delay_s:
                    await asyncio.sleep(b.chunk_delay_s)
                yield chunk({"content": piece}, None)
            yield chunk({}, "tool_calls" if tool else "stop")
            if include_usage:
                obj = {
                    "id": "chatcmpl-up1",
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield b"data: " + json.dumps(obj).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def messages(request: Request) -> Response:
        resp = await messages_answer(request)
        body = json.loads(await request.body())  # cached by Starlette
        resp.headers.update(script.behavior(str(body.get("model"))).headers)
        return resp

    async def messages_answer(request: Request) -> Response:
        """Anthropic Messages API (``POST /v1/messages``)."""
        body = json.loads(await request.body())
        if script.record:
            script.calls.append({"path": "messages", "body": body, "headers": dict(request.headers)})
        model = str(body.get("model"))
        b = script.behavior(model)
        status = _failure(b)
        if b.latency_s:
            await asyncio.sleep(b.latency_s)
        if status is not None:
            msg = f"scripted failure {status}"
            if b.echo_credentials:
                msg += f" (you sent {request.headers.get('x-api-key')})"
            return JSONResponse(
                {"type": "error", "error": {"type": "api_error", "message": msg}},
                status_code=status,
            )
        tools = body.get("tools") or []
        names = [t.get("name") for t in tools]
        tool = (
            {"type": "tool_use", "id": "toolu_1", "name": b.tool_name or names[0],
             "input": json.loads(b.tool_args)}
            if (tools and b.tool_call and (b.tool_name is None or b.tool_name in names))
            else None
        )
        last = (body.get("messages") or [{}])[-1]
        content = last.get("content")
        if b.answer_tool_results and isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "tool_result" for p in content
        ):
            tool = None
        args = json.dumps(tool["input"]) if tool else ""
        text = "".join(b.pieces)
        usage: dict[str, Any] = {"input_tokens": b.prompt_tokens - b.cache_read_tokens - b.cache_write_tokens,
                                 "output_tokens": len(b.pieces)}
        if b.cache_read_tokens or b.cache_write_tokens:
            usage |= {"cache_read_input_tokens": b.cache_read_tokens,
                      "cache_creation_input_tokens": b.cache_write_tokens}
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [tool] if tool else [{"type": "text", "text": text}],
                    "stop_reason": "tool_use" if tool else "end_turn",
                    "stop_sequence": None,
                    "usage": usage,
                }
            )

        def ev(name: str, data: dict[str, Any]) -> bytes:
            return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

        async def gen() -> AsyncIterator[bytes]:
            if b.ttft_s:
                await asyncio.sleep(b.ttft_s)
            yield ev(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": "msg_1",
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "usage": {**usage, "output_tokens": 1},
                    },
                },
            )
            if tool:
                yield ev(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": {**tool, "input": {}}},
                )
                yield ev(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "input_json_delta", "partial_json": args[: len(args) // 2]},
                    },
                )
                yield ev(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "input_json_delta", "partial_json": args[len(args) // 2 :]},
                    },
                )
            else:
                yield ev(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
                yield ev("ping", {"type": "ping"})
                for i, piece in enumerate(b.pieces):
                    if b.cut_after is not None and i >= b.cut_after:
                        raise _Cut("scripted mid-stream cut")
                    yield ev(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": piece},
                        },
                    )
            yield ev("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield ev(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "tool_use" if tool else "end_turn"},
                    "usage": {"output_tokens": len(b.pieces)},
                },
            )
            yield ev("message_stop", {"type": "message_stop"})

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        """OpenAI embeddings (``POST /v1/embeddings``): one 3-float vector per input (from its length)."""
        body = json.loads(await request.body())
        if script.record:
            script.calls.append({"path": "embeddings", "body": body, "headers": dict(request.headers)})
        model = str(body.get("model"))
        b = script.behavior(model)
        status = _failure(b)
        if status is not None:
            return JSONResponse(
                {"error": {"message": f"scripted failure {status}", "type": "server_error", "code": None}},
                status_code=status,
            )
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [len(str(x)) / 10, 0.5, -0.25]}
            for i, x in enumerate(inputs)
        ]
        usage = {"prompt_tokens": b.prompt_tokens, "total_tokens": b.prompt_tokens}
        return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ]
    )


class ServerThread:
    """A real uvicorn server for ``app`` on 127.0.0.1:<ephemeral port>, in a daemon thread. ``port``: that
    port instead (an upstream brought back where it was after its server was stopped)."""

    def __init__(self, app: Any, *, log_level: str = "critical", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=30
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        # a bound, not a timing: a gateway with a mesh provider loads the model's ends at start, and on a
        # fresh machine the first one parses the GGUF and builds its caches first (seconds on a loaded VM)
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="Scripted OpenAI-compatible upstream")
    ap.add_argument("--port", type=int, default=9001)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    args = ap.parse_args()
    script = Script(default=Behavior(latency_s=args.latency_ms / 1000.0), record=False)
    uvicorn.run(
        make_upstream_app(script),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
