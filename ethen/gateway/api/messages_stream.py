"""The Message object and its event stream, translated from chat completions (pure: no I/O).

:func:`from_chat` turns a buffered chat completion into a Message (mapping in
:mod:`ethen.gateway.api.messages`).
:class:`MessageEvents` turns the chunks of a streamed chat completion, as the gateway's relay yields them
(:mod:`ethen.gateway.api.relay`, with usage requested), into Anthropic's server-sent events, each with an
``event:`` line naming its type (the ``anthropic`` SDKs skip events without one):

``message_start`` (a Message with empty ``content``, ``stop_reason: null``, the gateway's input-token
estimate as ``usage.input_tokens`` and the routing receipt so far at ``ethen``); per content block
``content_block_start`` (after the first one, one ``ping``), ``content_block_delta`` with ``text_delta`` /
``input_json_delta`` / ``thinking_delta`` (an upstream's ``reasoning_content``), ``content_block_stop``; a
block is closed when another kind (or another tool call) starts, or at the end; then ``message_delta``
(``stop_reason``, ``stop_sequence``, the final ``usage`` with the upstream's input and output tokens, and the
final receipt at ``ethen``) and ``message_stop``. A stream that breaks after it began ends with an ``error``
event carrying Anthropic's envelope (``{"type": "error", "error": {"type", "message", "code"}}``, plus the
receipt at ``ethen``) and no ``message_stop``. A tool call's argument fragment arriving after its block was
closed (the upstream interleaved two calls) is still sent with that block's index (the SDKs append by index).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ethen.gateway.api.messages import new_message_id
from ethen.gateway.api.sse import dumps

__all__ = ["MessageEvents", "NativeEvents", "error_event", "from_chat", "stop_reason", "tool_input",
           "usage_from_chat"]

_STOP = {"length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
         "content_filter": "refusal"}


def stop_reason(finish: object, hit: object, stop_sequences: Collection[str]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` for a chat ``finish_reason`` (``hit``: the upstream's ``stop_reason``
    naming the stop string it matched, when it sends one)."""
    if isinstance(finish, str) and finish in _STOP:
        return _STOP[finish], None
    if isinstance(hit, str) and hit in stop_sequences:
        return "stop_sequence", hit
    return "end_turn", None


def usage_from_chat(usage: object) -> dict[str, int]:
    """An OpenAI ``usage`` object as Anthropic's (zeros for what the upstream did not report)."""
    u = usage if isinstance(usage, Mapping) else {}
    prompt, completion = u.get("prompt_tokens"), u.get("completion_tokens")
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    written = details.get("cache_write_tokens") if isinstance(details, Mapping) else None
    prompt = prompt if isinstance(prompt, int) and prompt >= 0 else 0
    cached = min(cached, prompt) if isinstance(cached, int) and cached >= 0 else 0
    written = min(written, prompt - cached) if isinstance(written, int) and written >= 0 else 0
    return {
        "input_tokens": prompt - cached - written,
        "output_tokens": completion if isinstance(completion, int) and completion >= 0 else 0,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
    }


def tool_input(arguments: object) -> dict[str, Any]:
    """A tool call's JSON arguments as ``tool_use.input`` (an object; anything else is kept in ``_raw``)."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def _tool_id(value: object) -> str:
    return value if isinstance(value, str) and value else f"toolu_{uuid.uuid4().hex}"


def _first_choice(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, Mapping) else {}


def _get(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def from_chat(completion: Mapping[str, Any], model: str, stop_sequences: Collection[str]) -> dict[str, Any]:
    """A buffered chat completion as a Message object (``model``: the name the client asked for)."""
    first = _first_choice(completion)
    message = _get(first, "message")
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        if isinstance(call, Mapping):
            fn = _get(call, "function")
            content.append({"type": "tool_use", "id": _tool_id(call.get("id")),
                            "name": str(fn.get("name") or ""), "input": tool_input(fn.get("arguments"))})
    reason, sequence = stop_reason(first.get("finish_reason"), first.get("stop_reason"), stop_sequences)
    if reason == "end_turn" and any(b["type"] == "tool_use" for b in content):
        reason = "tool_use"
    return {"id": new_message_id(), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_from_chat(completion.get("usage"))}


def event(kind: str, **fields: Any) -> bytes:
    """One SSE frame: ``event: <kind>`` and the JSON data (its ``type`` is ``kind``)."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"


class MessageEvents:
    """One streamed Message: feed it the relayed chunks, send the frames it returns."""

    def __init__(self, model: str, stop_sequences: Collection[str], input_estimate: int) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.input_estimate = input_estimate
        self.index = -1  # index of the last block opened
        self.open: tuple[str, int] | None = None  # the open block: ("text"|"thinking", -1) | ("tool", idx)
        self.tools: dict[int, int] = {}  # chat tool_calls index -> block index
        self.finish: object = None
        self.hit: object = None
        self.pinged = False
        self.has_tool = False

    def start(self, receipt: Mapping[str, Any] | None) -> list[bytes]:
        """``message_start`` (``receipt``: the routing receipt so far)."""
        message: dict[str, Any] = {
            "id": new_message_id(), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_estimate, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }
        if receipt is not None:
            message["ethen"] = {"routing": receipt}
        return [event("message_start", message=message)]

    def _open(self, key: tuple[str, int], block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = key
        out.append(event("content_block_start", index=self.index, content_block=block))
        if not self.pinged:
            self.pinged = True
            out.append(event("ping"))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open != (kind, -1):
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            out += self._open((kind, -1), block)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta",
                                                                             "thinking": text}
        out.append(event("content_block_delta", index=self.index, delta=delta))
        return out

    def _tool(self, tc: Mapping[str, Any]) -> list[bytes]:
        raw = tc.get("index")
        idx = raw if isinstance(raw, int) and not isinstance(raw, bool) else 0
        fn = _get(tc, "function")
        out: list[bytes] = []
        if idx not in self.tools:
            self.has_tool = True
            out += self._open(("tool", idx), {"type": "tool_use", "id": _tool_id(tc.get("id")),
                                              "name": str(fn.get("name") or ""), "input": {}})
            self.tools[idx] = self.index
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            out.append(event("content_block_delta", index=self.tools[idx],
                             delta={"type": "input_json_delta", "partial_json": args}))
        return out

    def chunk(self, obj: Mapping[str, Any]) -> list[bytes]:
        """The events of one relayed chat-completion chunk."""
        choice = _first_choice(obj)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
            self.hit = choice.get("stop_reason")
        delta = _get(choice, "delta")
        out: list[bytes] = []
        for key, kind in (("reasoning_content", "thinking"), ("content", "text")):
            value = delta.get(key)
            if isinstance(value, str) and value:
                out += self._text(kind, value)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for tc in calls:
                if isinstance(tc, Mapping):
                    out += self._tool(tc)
        return out

    def complete(self, terminal: Mapping[str, Any]) -> list[bytes]:
        """Close the open block; ``message_delta`` and ``message_stop``. ``terminal`` is the relay's terminal
        chunk (usage and ``ethen.routing``)."""
        out = self.chunk(terminal)
        out += self._close()
        reason, sequence = stop_reason(self.finish, self.hit, self.stop_sequences)
        if reason == "end_turn" and self.has_tool:
            reason = "tool_use"
        fields: dict[str, Any] = {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": usage_from_chat(terminal.get("usage"))}
        if isinstance(terminal.get("ethen"), Mapping):
            fields["ethen"] = terminal["ethen"]
        out.append(event("message_delta", **fields))
        out.append(event("message_stop"))
        return out

    def error(self, envelope: Mapping[str, Any], to_type: Callable[[object], str]) -> bytes:
        """The ``error`` event for the relay's error envelope (``{"error": {...}, "ethen": {...}}``);
        ``to_type`` maps the gateway's error code to Anthropic's error type."""
        return error_event(envelope, to_type)


def error_event(envelope: Mapping[str, Any], to_type: Callable[[object], str]) -> bytes:
    """The ``error`` event for the relay's error envelope (see :meth:`MessageEvents.error`)."""
    err = _get(envelope, "error")
    code = err.get("code")
    body: dict[str, Any] = {"type": to_type(code), "message": str(err.get("message") or "The stream failed."),
                            "code": code if isinstance(code, str) else "stream_error"}
    fields: dict[str, Any] = {"error": body}
    if isinstance(envelope.get("ethen"), Mapping):
        fields["ethen"] = envelope["ethen"]
    return event("error", **fields)


class NativeEvents:
    """A native Anthropic stream (:mod:`ethen.gateway.providers.anthropic_native`) sent on as it came: each
    relayed chunk carries the upstream's event at ``native_key``. ``message_start``'s message gains the
    receipt so far; ``message_delta`` is held to the end to carry the final receipt; ``message_stop`` (which
    ends the provider's stream) is sent after it."""

    def __init__(self, native_key: str, receipt: Mapping[str, Any] | None) -> None:
        self.key = native_key
        self.receipt = receipt
        self.held: dict[str, Any] | None = None

    def start(self, receipt: Mapping[str, Any] | None) -> list[bytes]:
        """Nothing: the upstream's own ``message_start`` is the first chunk."""
        return []

    def chunk(self, obj: Mapping[str, Any]) -> list[bytes]:
        ev = obj.get(self.key)
        if not isinstance(ev, Mapping) or not isinstance(ev.get("type"), str):
            return []
        fields = {k: v for k, v in ev.items() if k != "type"}
        message = ev.get("message")
        if ev["type"] == "message_start" and self.receipt is not None and isinstance(message, Mapping):
            fields["message"] = {**message, "ethen": {"routing": self.receipt}}
        if ev["type"] == "message_delta":
            self.held = fields
            return []
        return [event(ev["type"], **fields)]

    def complete(self, terminal: Mapping[str, Any]) -> list[bytes]:
        out = self.chunk(terminal)
        fields = self.held or {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 0}}
        if isinstance(terminal.get("ethen"), Mapping):
            fields = {**fields, "ethen": terminal["ethen"]}
        return [*out, event("message_delta", **fields), event("message_stop")]

    def error(self, envelope: Mapping[str, Any], to_type: Callable[[object], str]) -> bytes:
        return error_event(envelope, to_type)
