"""``POST /completions``: OpenAI's legacy text completions over the chat path (issue 15).

The body is translated into a chat-completions body (:func:`to_chat`) and runs through the very request path
chat completions and ``/responses`` use (:mod:`ethen.gateway.api.pipeline`: auth, requirements, ``ethen/*``
aliases, fallback chain, rate limits, budgets, telemetry, receipt); the answer is translated back into a
``text_completion`` object (:func:`from_chat`), or, streamed, each chat chunk into a ``text_completion``
chunk (:func:`chunk_from_chat`). Also served under ``/v1/completions``.

Choices where the issue and the API are silent:
- **A prompt is a user message.** Every provider behind the gateway (the mesh, OpenAI-compatible servers,
  Anthropic) is reached through chat completions, and today's models are chat models: the prompt becomes
  one ``user`` message, so the model answers it through its chat template rather than continuing the text
  verbatim. A client that needs raw continuation should call a raw-completion server directly.
- ``prompt``: a string or a list of exactly one string (``""`` allowed). Token arrays, several prompts,
  ``n`` > 1, ``best_of`` > 1, ``echo: true``, a non-empty ``suffix`` and any ``logprobs`` are refused
  with 400 ``unsupported_parameter`` naming the field (they have no chat equivalent; their defaults
  ``null`` / 1 / ``false`` / ``""`` are accepted). ``prompt`` missing: 400 ``missing_required_parameter``.
- Passed on as on chat (validated there): ``model``, ``n`` (1), ``max_tokens`` (the legacy API's default 16
  when unset, so budgets reserve what will be billed), ``temperature``, ``top_p``, ``stop``, ``seed``,
  ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``user``, ``stream``, ``stream_options``,
  ``metadata`` (its ``routing`` hints as on chat) and ``providerOptions``. Any other key is ignored.
- Answer: ``choices[0].text`` is the message content (``""`` for none); a chat ``finish_reason`` other than
  ``length`` / ``content_filter`` (``stop``, ``tool_calls``...) is ``stop``; ``usage`` as the upstream
  reported it; ``model`` is the upstream's, as on chat. The receipt is at ``ethen.routing`` (buffered body,
  or the stream's terminal chunk).
- Stream: chunks that carry no text and end nothing (the upstream's role-only opening chunk) are dropped;
  intermediate chunks have ``finish_reason: null``, as OpenAI's API sends them (the OpenAPI description
  marks the field non-null: it describes the finished object), the last one its finish reason and the
  receipt; with ``stream_options.include_usage`` a final ``choices: []`` chunk carries usage and the
  receipt. A break after the first chunk is the chat stream's ``event: error`` frame, unchanged.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ethen.gateway.api.execute import BufferedRun, StreamRun
from ethen.gateway.api.pipeline import Call, Pipeline
from ethen.gateway.api.relay import StreamRelay
from ethen.gateway.api.sse import DONE_FRAME, dumps, encode_json
from ethen.gateway.errors import GatewayError, InvalidRequestError

__all__ = ["DEFAULT_MAX_TOKENS", "chunk_from_chat", "completions_endpoint", "from_chat", "to_chat"]

#: the legacy API's ``max_tokens`` default
DEFAULT_MAX_TOKENS = 16
#: chat fields a completions body shares, passed on unchanged
_PASSED = ("model", "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
           "logit_bias", "user", "stream", "stream_options", "metadata", "providerOptions")
_FINISH = ("length", "content_filter")
_ERROR_FRAME = b"event: error\n"


def _unsupported(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' is not supported on /completions: {why}.",
                               code="unsupported_parameter", param=param)


def _prompt(body: Mapping[str, Any]) -> str:
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequestError("'prompt' is required.", code="missing_required_parameter", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if (prompt and all(_int(p) for p in prompt)) or any(isinstance(p, list) for p in prompt):
            raise _unsupported("prompt", "token arrays need the model's own tokenizer; send the text")
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
            raise _unsupported("prompt", f"one prompt per request (got {len(prompt)})")
    raise InvalidRequestError("'prompt' must be a string or an array of one string.", code="invalid_type",
                              param="prompt")


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """``n`` / ``best_of`` > 1, ``echo: true``, a ``suffix``, ``logprobs``: 400 ``unsupported_parameter``
    (wrong types: ``invalid_type``; ``n`` < 1 is refused by the chat validation it is passed on to)."""
    n, best_of, echo, suffix = body.get("n"), body.get("best_of"), body.get("echo"), body.get("suffix")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise _unsupported("n", "one completion per request")
    if best_of is not None and not _int(best_of):
        raise InvalidRequestError("'best_of' must be an integer.", code="invalid_type", param="best_of")
    if isinstance(best_of, int) and best_of > 1:
        raise _unsupported("best_of", "no server-side best-of sampling")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequestError("'echo' must be a boolean.", code="invalid_type", param="echo")
    if echo:
        raise _unsupported("echo", "the prompt is a chat message, not continued text")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequestError("'suffix' must be a string.", code="invalid_type", param="suffix")
    if suffix:
        raise _unsupported("suffix", "no insertion mode over chat models")
    if body.get("logprobs") is not None:
        raise _unsupported("logprobs", "log probabilities are not relayed")


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A completions body as a chat-completions body. Raises ``InvalidRequestError`` naming the field."""
    prompt = _prompt(body)
    _refuse_unsupported(body)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = [{"role": "user", "content": prompt}]
    max_tokens = body.get("max_tokens")
    chat["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    return chat


def _finish(reason: object) -> str:
    return reason if isinstance(reason, str) and reason in _FINISH else "stop"


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


def from_chat(completion: Mapping[str, Any], cid: str) -> dict[str, Any]:
    """A buffered chat completion as a ``text_completion`` object."""
    choices = completion.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
    message = first.get("message")
    content = message.get("content") if isinstance(message, Mapping) else None
    text = content if isinstance(content, str) else ""
    created = completion.get("created")
    model = completion.get("model")
    out: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created if _int(created) else int(time.time()),
        "model": model if isinstance(model, str) else "",
        "choices": [_choice(text, _finish(first.get("finish_reason")))],
    }
    fingerprint = completion.get("system_fingerprint")
    if isinstance(fingerprint, str):
        out["system_fingerprint"] = fingerprint
    if isinstance(completion.get("usage"), Mapping):
        out["usage"] = completion["usage"]
    return out


def chunk_from_chat(chunk: Mapping[str, Any], cid: str, created: int) -> dict[str, Any] | None:
    """A chat stream chunk as a ``text_completion`` chunk; ``None`` for one with nothing to say."""
    choices = chunk.get("choices")
    out_choices: list[dict[str, Any]] = []
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        delta = choices[0].get("delta")
        text = delta.get("content") if isinstance(delta, Mapping) else None
        reason = choices[0].get("finish_reason")
        finish = None if reason is None else _finish(reason)
        if (isinstance(text, str) and text) or finish is not None:
            out_choices.append(_choice(text if isinstance(text, str) else "", finish))
    extra = {k: chunk[k] for k in ("usage", "ethen") if chunk.get(k) is not None}
    if not out_choices and not extra:
        return None
    model = chunk.get("model")
    return {"id": cid, "object": "text_completion", "created": created,
            "model": model if isinstance(model, str) else "", "choices": out_choices, **extra}


def _stream(pipe: Pipeline, call: Call, run: StreamRun) -> Response:
    assert call.hold is not None and call.decision is not None
    relay = StreamRelay(run, call.receipt, call.include_usage, call.rid, call.t0, call.label, call.hold,
                        pipe.gw.metrics, pipe.stream_end(call))
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    async def frames() -> AsyncIterator[bytes]:
        inner: AsyncGenerator[bytes, None] = relay.frames()  # type: ignore[assignment]
        try:
            async for frame in inner:
                if frame == DONE_FRAME or frame.startswith(_ERROR_FRAME):
                    yield frame
                    continue
                try:
                    obj = json.loads(frame.split(b"data: ", 1)[1])
                except (ValueError, IndexError):
                    continue  # an upstream chunk that is no JSON: nothing to translate
                out = chunk_from_chat(obj, cid, created) if isinstance(obj, dict) else None
                if out is not None:
                    yield encode_json(out)
        finally:
            with contextlib.suppress(Exception):
                await inner.aclose()  # a client gone: the relay settles and records the attempt

    return StreamingResponse(frames(), 200, relay.headers(), media_type="text/event-stream")


def completions_endpoint(pipe: Pipeline) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /completions`` handler of one gateway."""

    async def completions(request: Request) -> Response:
        call = pipe.start(request)
        call.endpoint = "completions"
        try:
            await pipe.admit(call, request, to_chat)
            if call.stream:
                return _stream(pipe, call, await pipe.open_stream(call))

            def render(res: BufferedRun) -> bytes:
                out = from_chat(res.body, f"cmpl-{uuid.uuid4().hex}")
                out["ethen"] = {"routing": call.receipt(res.attempts, res.target, res.receipt_extra)}
                return dumps(out)

            res, content = await pipe.run_buffered(call, render)
            return Response(content, 200, pipe.served(call, res.upstream_s), media_type="application/json")
        except GatewayError as err:
            return pipe.failed(call, err)

    return completions
