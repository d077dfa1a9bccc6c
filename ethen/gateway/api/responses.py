"""The OpenAI Responses API over chat completions: request and buffered-answer translation.

``POST /responses`` (:mod:`ethen.gateway.api.responses_http`) translates the Responses body into a
chat-completions body (:func:`to_chat`), runs it through exactly the chat path
(:mod:`ethen.gateway.api.pipeline`:
the same requirements, ``decide``, fallback chain, budgets, telemetry and receipt), and translates the answer
back (:func:`from_chat` here, :mod:`ethen.gateway.api.responses_stream` for the event stream). No configured
provider speaks Responses natively today (the mesh, OpenAI-compatible servers and Anthropic are all reached
through chat completions), so every provider is reached by translation.

Request mapping (Responses -> chat completions):
- ``instructions`` (string) -> a leading ``system`` message; ``input`` string -> one ``user`` message;
  ``input`` items: messages (``user`` / ``assistant`` / ``system`` / ``developer``; string content or
  ``input_text`` / ``output_text`` / ``refusal`` / ``input_image`` parts: ``input_image.image_url`` ->
  an ``image_url`` part with its ``detail``), ``function_call`` items -> an assistant message's
  ``tool_calls`` (consecutive calls are merged into one assistant turn), ``function_call_output`` -> a
  ``tool`` message; ``reasoning`` items are dropped (no chat equivalent).
- ``tools``: function tools -> chat ``tools``; ``namespace`` groups -> one chat function per member, named
  ``namespace__name`` (calls answer with ``name`` and ``namespace`` again); hosted tools (``web_search``,
  ``file_search``, ``mcp``...) dropped, or refused with ``[compat] drop_unsupported_tools = false`` (see
  :mod:`ethen.gateway.api.responses_tools`); ``tool_choice`` ``auto``/``none``/``required``/
  ``{"type":"function","name"}``; ``parallel_tool_calls``; ``text.format`` ``json_schema`` / ``json_object``
  -> ``response_format`` (structured-output requirement for routing); ``max_output_tokens`` ->
  ``max_completion_tokens``; ``temperature``, ``top_p``, ``user``, ``stream``; ``metadata`` as is (its
  ``routing`` object carries the same routing hints as on chat: budget ceiling, latency target,
  certification level); ``providerOptions`` as on chat; ``prompt_cache_key`` as is.
- Ignored (no chat equivalent, accepted so clients that always send them work): ``reasoning``, ``include``,
  ``truncation``, ``service_tier``, ``text.verbosity``, ``max_tool_calls``, ``safety_identifier``,
  ``stream_options``, ``top_logprobs`` (an integer in ``[0, 20]``), and any unknown key.
  ``temperature`` (``[0, 2]``) and ``top_p`` (``[0, 1]``) are checked against OpenAI's ranges on the chat body
  they become (same names): 400 ``invalid_value`` naming the field, before routing.
- Refused with 400 ``unsupported_parameter`` naming the field (the gateway keeps no response store):
  ``previous_response_id``, ``conversation``, ``store: true``, ``background: true``, ``prompt`` (stored
  prompt templates). Refused with 400 ``unsupported_value``: ``custom`` and unknown tool types,
  ``input_image`` by ``file_id``, ``input_file`` parts, ``item_reference`` and other item types.

Answer mapping: ``message.content`` -> a ``message`` output item (``output_text``; a ``refusal`` becomes a
``refusal`` part); each ``tool_calls`` entry -> a ``function_call`` item (``call_id`` = the upstream's call
id); ``finish_reason`` ``length`` / ``content_filter`` -> ``status: "incomplete"`` with
``incomplete_details.reason`` ``max_output_tokens`` / ``content_filter``; ``usage`` prompt/completion ->
``input_tokens`` / ``output_tokens``, ``prompt_tokens_details`` ``cached_tokens`` / ``cache_write_tokens`` ->
``input_tokens_details``. ``model`` is the upstream's, as on chat. The routing receipt is at the
Response object's top-level ``ethen.routing`` (the schema allows extra properties; ``metadata`` must stay a
map of strings, so it cannot hold it); ``store`` is always ``false``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ethen.gateway.api.responses_tools import ToolNames, chat_tools, qualify
from ethen.gateway.errors import InvalidRequestError

__all__ = ["Echo", "finish", "from_chat", "new_id", "obj", "response_object", "to_chat", "usage_from_chat",
           "usage_object"]

#: Responses fields the gateway cannot honour without a response store: refused when set
_STATEFUL = ("previous_response_id", "conversation", "prompt")
_ROLES = ("user", "assistant", "system", "developer")
_TOOL_CHOICES = ("auto", "none", "required")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, code=code, param=param)


def obj(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``parent[key]`` when it is an object, else an empty one."""
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _expect(value: object, kind: type | tuple[type, ...], param: str, what: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        raise _bad(param, f"'{param}' must be {what}, got {_type_name(value)}.", "invalid_type")


@dataclass(slots=True)
class Echo:
    """The request fields a Response object echoes back."""

    instructions: str | None
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    text_format: dict[str, Any]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    user: str | None
    names: ToolNames = field(default_factory=ToolNames)  # namespaced tools' chat names (responses_tools)
    dropped: list[dict[str, str]] = field(default_factory=list)  # hosted tools left out


def _text_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    text = part.get("text")
    _expect(text, str, f"{where}.text", "a string")
    return {"type": "text", "text": text}


def _image_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise _bad(f"{where}.file_id", "Images by 'file_id' are not supported (the gateway has no file "
                   "store); send 'image_url' (an https or data: URL).", "unsupported_value")
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}.image_url", f"'{where}.image_url' must be a non-empty string URL.",
                   "invalid_type" if url is not None else "missing_required_parameter")
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail is not None:
        if detail not in ("auto", "low", "high"):
            raise _bad(f"{where}.detail", f"'{where}.detail' must be one of auto, low, high.")
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _content(content: object, where: str, role: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"'{where}' must be a string or an array of content parts, got "
                   f"{_type_name(content)}.", "invalid_type")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise _bad(pw, f"'{pw}' must be an object, got {_type_name(part)}.", "invalid_type")
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            parts.append(_text_part(part, pw))
        elif kind == "refusal":
            refusal = part.get("refusal")
            _expect(refusal, str, f"{pw}.refusal", "a string")
            parts.append({"type": "text", "text": refusal})
        elif kind == "input_image":
            if role == "assistant":
                raise _bad(f"{pw}.type", "An assistant message cannot hold images.")
            parts.append(_image_part(part, pw))
        elif isinstance(kind, str):
            raise _bad(f"{pw}.type", f"Content part type {kind!r} is not supported by this gateway "
                       "(supported: input_text, output_text, refusal, input_image).", "unsupported_value")
        else:
            raise _bad(f"{pw}.type", f"'{pw}.type' must be a string, got {_type_name(kind)}.", "invalid_type")
    if role in ("assistant", "system", "developer"):  # text only: many upstreams want a string there
        return "".join(p["text"] for p in parts if p["type"] == "text")
    return parts


def _items(items: list[Any], where: str, messages: list[dict[str, Any]]) -> None:
    """Append the chat messages of Responses input ``items`` to ``messages``."""
    for i, item in enumerate(items):
        iw = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(iw, f"'{iw}' must be an object, got {_type_name(item)}.", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{iw}.role", f"'{iw}.role' must be one of {', '.join(_ROLES)}, got {role!r:.40}.",
                           "invalid_value" if isinstance(role, str) else "invalid_type")
            if "content" not in item:
                raise _bad(f"{iw}.content", f"'{iw}.content' is required.", "missing_required_parameter")
            messages.append({"role": role, "content": _content(item["content"], f"{iw}.content", role)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            for key, value in (("call_id", call_id), ("name", name), ("arguments", args)):
                _expect(value, str, f"{iw}.{key}", "a string")
            if item.get("namespace") is not None:  # a call of a namespace group's tool (responses_tools)
                _expect(item["namespace"], str, f"{iw}.namespace", "a string")
                name = qualify(item["namespace"], str(name))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # text then calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            _expect(call_id, str, f"{iw}.call_id", "a string")
            if isinstance(output, list):
                text = _content(output, f"{iw}.output", "tool")
                if isinstance(text, list):
                    text = "".join(p["text"] for p in text if p["type"] == "text")
                output = text
            _expect(output, str, f"{iw}.output", "a string or an array of content parts")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str):
            raise _bad(f"{iw}.type", f"Input item type {kind!r} is not supported by this gateway (supported: "
                       "message, function_call, function_call_output, reasoning).", "unsupported_value")
        else:
            raise _bad(f"{iw}.type", f"'{iw}.type' must be a string, got {_type_name(kind)}.", "invalid_type")


def _tool_choice(choice: object) -> Any:
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise _bad("tool_choice", f"'tool_choice' must be one of {', '.join(_TOOL_CHOICES)} or a "
                       f"function choice, got {choice!r:.40}.")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        _expect(choice.get("name"), str, "tool_choice.name", "a string")
        name = choice["name"]
        if isinstance(choice.get("namespace"), str):
            name = qualify(choice["namespace"], name)
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, Mapping):
        raise _bad("tool_choice.type", f"tool_choice type {choice.get('type')!r:.40} is not supported "
                   "(only function tools).", "unsupported_value")
    raise _bad("tool_choice", f"'tool_choice' must be a string or an object, got {_type_name(choice)}.",
               "invalid_type")


def _text_format(text: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat response_format or None, echoed text.format)."""
    if text is None:
        return None, {"type": "text"}
    _expect(text, Mapping, "text", "an object")
    assert isinstance(text, Mapping)
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    _expect(fmt, Mapping, "text.format", "an object")
    kind = fmt.get("type")
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        _expect(name, str, "text.format.name", "a string")
        _expect(schema, Mapping, "text.format.schema", "an object (a JSON schema)")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        for key, kind_, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
            if fmt.get(key) is not None:
                _expect(fmt[key], kind_, f"text.format.{key}", what)
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}, {"type": "json_schema", **spec}
    raise _bad("text.format.type", f"'text.format.type' must be one of text, json_schema, json_object, got "
               f"{kind!r:.40}.", "invalid_value" if isinstance(kind, str) else "invalid_type")


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    _expect(value, (int, float), key, "a number")
    return float(value)


def to_chat(body: Mapping[str, Any], drop_hosted: bool = True) -> tuple[dict[str, Any], Echo]:
    """A Responses request body as a chat-completions body (and what the answer echoes). Raises
    ``InvalidRequestError`` naming the offending Responses field. ``drop_hosted``: leave hosted tools out
    (else refuse them; see :mod:`ethen.gateway.api.responses_tools`)."""
    for key in _STATEFUL:
        if body.get(key) is not None:
            raise _bad(key, f"'{key}' is not supported: this gateway keeps no response store; send the whole "
                       "conversation in 'input'.", "unsupported_parameter")
    for key in ("store", "background"):
        if body.get(key) is True:
            raise _bad(key, f"'{key}: true' is not supported: this gateway keeps no response store "
                       f"(send '{key}': false or omit it).", "unsupported_parameter")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        if instructions:
            messages.append({"role": "system", "content": instructions})
    elif isinstance(instructions, list):
        _items(instructions, "instructions", messages)
        instructions = None
    elif instructions is not None:
        raise _bad("instructions", "'instructions' must be a string.", "invalid_type")
    if "input" not in body or body["input"] is None:
        raise _bad("input", "'input' is required.", "missing_required_parameter")
    inp = body["input"]
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        _items(inp, "input", messages)
    else:
        raise _bad("input", f"'input' must be a string or an array of items, got {_type_name(inp)}.",
                   "invalid_type")
    if not messages:
        raise _bad("input", "'input' must contain at least one message.")
    chat: dict[str, Any] = {"messages": messages}
    if "model" in body:
        chat["model"] = body["model"]
    tools_echo: list[Any] = []
    names, dropped = ToolNames(), list[dict[str, str]]()
    if body.get("tools") is not None:
        _expect(body["tools"], list, "tools", "an array")
        listed, tools_echo, names, dropped = chat_tools(body["tools"], drop_hosted)
        if listed:
            chat["tools"] = listed
    choice = body.get("tool_choice")
    if choice is not None:
        chat_choice = _tool_choice(choice)
        if "tools" in chat:
            chat["tool_choice"] = chat_choice
    ptc = body.get("parallel_tool_calls")
    if ptc is not None:
        _expect(ptc, bool, "parallel_tool_calls", "a boolean")
        if "tools" in chat:
            chat["parallel_tool_calls"] = ptc
    response_format, fmt_echo = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    mot = body.get("max_output_tokens")
    if mot is not None:
        if not isinstance(mot, int) or isinstance(mot, bool) or not 1 <= mot <= 2**53 - 1:
            raise _bad("max_output_tokens", f"'max_output_tokens' must be an integer >= 1, got {mot!r:.40}.",
                       "invalid_value" if isinstance(mot, int | float) else "invalid_type")
        chat["max_completion_tokens"] = mot
    tlp = body.get("top_logprobs")  # ignored (no log probabilities are relayed), but its range is OpenAI's
    if tlp is not None and (not isinstance(tlp, int) or isinstance(tlp, bool) or not 0 <= tlp <= 20):
        raise _bad("top_logprobs", f"'top_logprobs' must be an integer between 0 and 20, got {tlp!r:.40}.",
                   "invalid_value" if isinstance(tlp, int | float) and not isinstance(tlp, bool)
                   else "invalid_type")
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    if temperature is not None:
        chat["temperature"] = body["temperature"]
    if top_p is not None:
        chat["top_p"] = body["top_p"]
    user = body.get("user")
    if user is not None:
        _expect(user, str, "user", "a string")
        chat["user"] = user
    meta = body.get("metadata")
    echo_meta: dict[str, str] = {}
    if meta is not None:
        _expect(meta, Mapping, "metadata", "an object")
        assert isinstance(meta, Mapping)
        chat["metadata"] = dict(meta)
        echo_meta = {k: v for k, v in meta.items() if k != "routing" and isinstance(v, str)}
    for key in ("stream", "providerOptions"):
        if key in body:
            chat[key] = body[key]
    if isinstance(body.get("prompt_cache_key"), str):
        chat["prompt_cache_key"] = body["prompt_cache_key"]  # OpenAI-compatible upstreams take it on chat
    return chat, Echo(
        instructions if isinstance(instructions, str) else None,
        tools_echo,
        choice if choice is not None else "auto",
        ptc if isinstance(ptc, bool) else True,
        fmt_echo,
        temperature,
        top_p,
        mot,
        echo_meta,
        user if isinstance(user, str) else None,
        names,
        dropped,
    )


def usage_object(prompt: int, completion: int, cached: int = 0, written: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(rid: str, created: int, model: str, echo: Echo, status: str) -> dict[str, Any]:
    """A Response object without output (for ``response.created`` / ``in_progress``, or to fill)."""
    resp: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "background": False,
        "temperature": echo.temperature if echo.temperature is not None else 1.0,
        "text": {"format": echo.text_format},
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p if echo.top_p is not None else 1.0,
        "truncation": "disabled",
        "metadata": echo.metadata,
        # not translated, echoed at their defaults (the Open Responses schema requires them)
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": 0,
        "max_tool_calls": None,
        "service_tier": "default",
        "safety_identifier": None,
        "prompt_cache_key": None,
        "usage": None,  # until known (the last stream event / a buffered answer fills it)
    }
    if echo.user is not None:  # the schema's user is a string, not nullable
        resp["user"] = echo.user
    return resp


#: chat finish_reason -> Responses incomplete_details.reason (others: completed)
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def finish(resp: dict[str, Any], finish_reason: object) -> None:
    """Set the terminal status (completed, or incomplete with its reason) of ``resp``."""
    reason = INCOMPLETE.get(finish_reason) if isinstance(finish_reason, str) else None
    resp["status"] = "incomplete" if reason else "completed"
    resp["incomplete_details"] = {"reason": reason} if reason else None
    resp["completed_at"] = int(time.time()) if not reason else None


def from_chat(completion: Mapping[str, Any], echo: Echo, resp_id: str, created: int) -> dict[str, Any]:
    """A buffered ``chat.completion`` as a Response object (without the receipt)."""
    choices = completion.get("choices")
    choice: Mapping[str, Any] = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
    )
    msg = obj(choice, "message")
    model = completion.get("model")
    resp = response_object(resp_id, created, model if isinstance(model, str) else "", echo, "completed")
    finish(resp, choice.get("finish_reason"))
    item_status = "incomplete" if resp["status"] == "incomplete" else "completed"
    parts: list[dict[str, Any]] = []
    content, refusal = msg.get("content"), msg.get("refusal")
    if isinstance(content, str) and content:
        parts.append({"type": "output_text", "text": content, "annotations": [], "logprobs": []})
    if isinstance(refusal, str) and refusal:
        parts.append({"type": "refusal", "refusal": refusal})
    output: list[dict[str, Any]] = []
    calls = msg["tool_calls"] if isinstance(msg.get("tool_calls"), list) else []
    if parts or not calls:
        output.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": item_status,
                       "content": parts or [{"type": "output_text", "text": "", "annotations": [],
                                             "logprobs": []}]})
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        args = fn.get("arguments")
        output.append({
            "id": new_id("fc"),
            "type": "function_call",
            "status": "completed",
            "call_id": str(call.get("id") or new_id("call")),
            **echo.names.call_fields(str(fn.get("name", ""))),
            "arguments": args if isinstance(args, str) else json.dumps(args),
        })
    resp["output"] = output
    usage = completion.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int) \
            and isinstance(usage.get("completion_tokens"), int):
        resp["usage"] = usage_from_chat(usage)
    return resp


def usage_from_chat(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A chat ``usage`` object as a Response's (``prompt_tokens_details``' cache reads and writes kept)."""
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}

    def count(value: object) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    return usage_object(count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")),
                        count(details.get("cached_tokens")), count(details.get("cache_write_tokens")))
