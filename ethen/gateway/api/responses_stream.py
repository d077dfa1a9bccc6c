"""The Responses event stream, translated from chat-completion chunks (pure: no I/O).

:class:`ResponsesEvents` turns the chunks of a streamed chat completion (as the gateway relays them, see
:mod:`ethen.gateway.api.relay`) into the Responses API's server-sent events, each with its ``sequence_number``
(from 0) and an ``event:`` line naming its type, as OpenAI sends them:

``response.created`` and ``response.in_progress`` first; then per output item ``response.output_item.added``,
for a message ``response.content_part.added`` + ``response.output_text.delta``... (or
``response.refusal.delta``...) and at its end ``response.output_text.done`` + ``response.content_part.done``,
for a tool call ``response.function_call_arguments.delta``... + ``.done``; ``response.output_item.done``;
finally ``response.completed`` (``response.incomplete`` when the model stopped at ``max_output_tokens`` or a
content filter) with the whole Response: its output, usage and the routing receipt at ``ethen.routing``.
A stream that breaks after it began ends with an ``error`` event (``code``, ``message``, ``param``, plus the
receipt at ``ethen.routing``) and no terminal ``response.*`` event. No ``[DONE]`` is sent (OpenAI sends none
on this API).

An item is closed when another kind of output starts (text after tool calls opens a new message item) or at
the end; an answer with no output at all gets one empty message item, as the buffered answer does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ethen.gateway.api.responses import Echo, finish, new_id, obj, response_object, usage_from_chat
from ethen.gateway.api.sse import dumps

__all__ = ["ResponsesEvents"]


def _part(kind: str) -> dict[str, Any]:
    if kind == "refusal":
        return {"type": "refusal", "refusal": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


class ResponsesEvents:
    """One streamed Response: feed it the relayed chunks, send the frames it returns."""

    def __init__(self, resp_id: str, created: int, echo: Echo) -> None:
        self.seq = 0
        self.resp = response_object(resp_id, created, "", echo, "in_progress")
        self.output: list[dict[str, Any]] = []  # items in output_index order (mutated while open)
        self.message: dict[str, Any] | None = None  # the open message item
        self.part: str | None = None  # the open content part of it: "text" | "refusal"
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool_calls index -> open function_call item
        self.finish_reason: object = None
        self.names = echo.names  # namespaced tools: the chat name back to (namespace, name)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = dumps({"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self, first: bytes) -> list[bytes]:
        """``response.created`` and ``response.in_progress`` (``first``: the upstream's first chunk)."""
        try:
            model = json.loads(first).get("model")
        except (ValueError, AttributeError):
            model = None
        self.resp["model"] = model if isinstance(model, str) else ""
        return [
            self._event("response.created", response=self.resp),
            self._event("response.in_progress", response=self.resp),
        ]

    # --- items ------------------------------------------------------------------------------------------

    def _open_message(self) -> list[bytes]:
        out = self._close_calls()
        item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        self.message = item
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**item, "content": []}))
        return out

    def _open_part(self, kind: str) -> list[bytes]:
        out: list[bytes] = [] if self.message is not None else self._open_message()
        out += self._close_part()
        assert self.message is not None
        self.message["content"].append(_part(kind))
        self.part = kind
        out.append(self._event("response.content_part.added", item_id=self.message["id"],
                               output_index=len(self.output) - 1,
                               content_index=len(self.message["content"]) - 1, part=_part(kind)))
        return out

    def _close_part(self) -> list[bytes]:
        if self.message is None or self.part is None:
            return []
        msg, kind = self.message, self.part
        self.part = None
        index = self.output.index(msg)
        ci = len(msg["content"]) - 1
        part = msg["content"][ci]
        ids = {"item_id": msg["id"], "output_index": index, "content_index": ci}
        done = (self._event("response.output_text.done", **ids, text=part["text"], logprobs=[])
                if kind == "text" else self._event("response.refusal.done", **ids, refusal=part["refusal"]))
        return [done, self._event("response.content_part.done", **ids, part=part)]

    def _close_message(self, status: str = "completed") -> list[bytes]:
        if self.message is None:
            return []
        out = self._close_part()
        msg, self.message = self.message, None
        msg["status"] = status
        out.append(self._event("response.output_item.done", output_index=self.output.index(msg), item=msg))
        return out

    def _close_calls(self) -> list[bytes]:
        out: list[bytes] = []
        for item in self.calls.values():
            index = self.output.index(item)
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   name=item["name"], output_index=index, arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.calls = {}
        return out

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out = self._open_part(kind) if self.part != kind else []
        assert self.message is not None
        part = self.message["content"][-1]
        part["text" if kind == "text" else "refusal"] += delta
        ids = {"item_id": self.message["id"], "output_index": len(self.output) - 1,
               "content_index": len(self.message["content"]) - 1}
        if kind == "text":
            out.append(self._event("response.output_text.delta", **ids, delta=delta, logprobs=[]))
        else:
            out.append(self._event("response.refusal.delta", **ids, delta=delta))
        return out

    def _tool_call(self, tc: Mapping[str, Any]) -> list[bytes]:
        raw_index = tc.get("index")
        index = raw_index if isinstance(raw_index, int) else 0
        fn = obj(tc, "function")
        raw_args = fn.get("arguments")
        args = raw_args if isinstance(raw_args, str) else ""
        out: list[bytes] = []
        item = self.calls.get(index)
        if item is None:
            out += self._close_message()
            name = fn.get("name")
            call_id = tc.get("id")
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call_id if isinstance(call_id, str) and call_id else new_id("call"),
                    **self.names.call_fields(name if isinstance(name, str) else ""), "arguments": ""}
            self.calls[index] = item
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(item)))
        if args:
            item["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=args))
        return out

    # --- chunks -----------------------------------------------------------------------------------------

    def chunk(self, obj: Mapping[str, Any]) -> list[bytes]:
        """The events of one relayed chat-completion chunk."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            return []
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return []
        out: list[bytes] = []
        for key, kind in (("content", "text"), ("refusal", "refusal")):
            value = delta.get(key)
            if isinstance(value, str) and value:
                out += self._text(kind, value)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for tc in calls:
                if isinstance(tc, Mapping):
                    out += self._tool_call(tc)
        return out

    def complete(self, terminal: Mapping[str, Any]) -> list[bytes]:
        """Close every open item and end with ``response.completed`` (or ``.incomplete``); ``terminal`` is
        the relay's terminal chunk (usage and ``ethen.routing``)."""
        out: list[bytes] = []
        out += self.chunk(terminal)
        if not self.output:
            out += self._open_part("text")
        finish(self.resp, self.finish_reason)
        out += self._close_message("incomplete" if self.resp["status"] == "incomplete" else "completed")
        out += self._close_calls()
        self.resp["output"] = self.output
        usage = terminal.get("usage")
        if isinstance(usage, Mapping):
            self.resp["usage"] = usage_from_chat(usage)
        ethen = terminal.get("ethen")
        if isinstance(ethen, Mapping):
            self.resp["ethen"] = ethen
        kind = "response.incomplete" if self.resp["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self.resp))
        return out

    def error(self, envelope: Mapping[str, Any]) -> bytes:
        """The ``error`` event for the relay's error envelope (``{"error": {...}, "ethen": {...}}``)."""
        err = obj(envelope, "error")
        fields: dict[str, Any] = {
            "code": err.get("code") if isinstance(err.get("code"), str) else "stream_error",
            "message": str(err.get("message") or "The stream failed."),
            "param": err.get("param") if isinstance(err.get("param"), str) else None,
        }
        if isinstance(envelope.get("ethen"), Mapping):
            fields["ethen"] = envelope["ethen"]
        return self._event("error", **fields)
