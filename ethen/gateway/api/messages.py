"""The Anthropic Messages API over chat completions: request translation and model names (pure: no I/O).
The answer (buffered and streamed) is :mod:`ethen.gateway.api.messages_stream`; the endpoints (``POST
/v1/messages``, ``POST /v1/messages/count_tokens``) and the error envelope
:mod:`ethen.gateway.api.messages_http`.

Request mapping (Messages -> chat completions). Every request is routed by this translation (hard gates,
aliases, budgets); it is what chat upstreams (OpenAI-compatible servers, the mesh) receive. A ``kind =
"anthropic"`` provider receives the client's body itself (:mod:`ethen.gateway.providers.anthropic_native`).
- ``system`` (a string, or an array of ``text`` blocks joined with a blank line) -> a leading ``system``
  message.
- ``messages`` (roles ``user`` / ``assistant``; content a string or an array of blocks):
  ``text`` -> a text part; ``image`` with a ``base64`` source -> an ``image_url`` part holding a ``data:``
  URL, with a ``url`` source -> an ``image_url`` part with that URL; an assistant's ``tool_use`` blocks ->
  its ``tool_calls`` (``input`` serialized as the call's JSON ``arguments``); a user's ``tool_result`` blocks
  -> ``tool`` messages (before the rest of that turn, in order; the result's text blocks joined, prefixed
  ``Error: `` when ``is_error``; images in a result follow in a ``user`` message, as chat tool messages
  carry text only); ``thinking`` / ``redacted_thinking`` blocks are **dropped** (chat has no way to send
  them back, and their signatures only mean something to Anthropic).
- ``tools`` (custom tools: no ``type`` or ``"custom"``) -> function tools (``input_schema`` ->
  ``parameters``); ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` /
  the named function / ``none``; ``disable_parallel_tool_use: true`` -> ``parallel_tool_calls: false``.
- ``max_tokens`` (required: a positive integer) -> ``max_tokens``; ``temperature``, ``top_p`` as they are;
  ``stop_sequences`` -> ``stop``; ``stream`` (with ``stream_options.include_usage``, so the stream's
  ``message_delta`` carries real usage); ``metadata.user_id`` -> ``user``; ``metadata.routing`` (the
  gateway's routing hints, as on chat) -> ``metadata.routing``; ``output_config.format`` (``json_schema``:
  structured outputs) -> ``response_format`` ``json_schema`` named ``output`` (the structured-output gate).
- Accepted and not sent to chat upstreams: ``top_k`` (validated: OpenAI's API refuses it), ``thinking``
  (the reasoning budget), ``output_config.effort``, ``cache_control`` on any block, tool or system block
  (chat has no breakpoints: an OpenAI-compatible upstream gets the conversation's ``prompt_cache_key``),
  ``service_tier``, ``container``, ``context_management`` and any
  other unknown key.
- No chat equivalent: server / Anthropic-defined tools (``web_search_*``, ``bash_*``, ``text_editor_*``,
  ``computer_*``...), ``document``, ``search_result`` and ``server_tool_use`` blocks, any other block type,
  and images by ``file`` source. When a ``kind = "anthropic"`` provider is configured, such a request is left
  out of the translation and routed to those providers only (their native pass-through carries it; the
  receipt lists the fields at ``native_only``); otherwise it is 400 ``unsupported_value`` naming the field.

Answer mapping (chat completion -> Message, :mod:`ethen.gateway.api.messages_stream`): ``id`` ``msg_<hex>``;
``content`` a ``thinking`` block for an upstream's ``reasoning_content`` (no signature), a ``text`` block
for the message text, a ``tool_use`` block per tool call (``input`` the parsed arguments; arguments that are
no JSON object are kept under ``_raw``); ``stop_reason``: ``length`` -> ``max_tokens``, ``tool_calls`` ->
``tool_use``, ``content_filter`` -> ``refusal``, ``stop`` -> ``stop_sequence`` when the upstream names which
requested stop sequence it hit (vLLM's ``stop_reason``; OpenAI says nothing, then it is ``end_turn``),
otherwise ``end_turn``; ``model`` is the model the client asked for (the receipt names what served it);
``usage``: ``input_tokens`` = prompt tokens minus cache reads and writes, ``cache_read_input_tokens`` =
``prompt_tokens_details.cached_tokens`` (0 when the upstream does not say), ``cache_creation_input_tokens`` =
``prompt_tokens_details.cache_write_tokens`` (0 when not said), ``output_tokens`` = completion tokens.

Model names (:func:`resolve_model`): an ``ethen/*`` alias, a route's model or ``provider/model`` id is used
as it is; any other name is looked up in ``[model_map]`` (fnmatch glob patterns, case-sensitive, first match
in file order) and replaced by its target; a name nothing matches is 404 ``not_found_error``, whose
message says which ``[model_map]`` entry to add (issue 42: ``claude -p`` asks for ``claude-sonnet-4-6``).

Errors: Anthropic's envelope and statuses, mapped from the gateway's one error table in one place
(:func:`ethen.gateway.api.messages_http.error_status_and_type`).
"""

from __future__ import annotations

import fnmatch
import json
import uuid
from collections.abc import Collection, Mapping
from typing import Any

from ethen.gateway.errors import InvalidRequestError, ModelNotFoundError
from ethen.gateway.routing.hints import model_map_hint

__all__ = ["chat_breakpoints", "new_message_id", "resolve_model", "to_chat"]

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, code=code, param=param)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _expect(value: object, kind: type | tuple[type, ...], param: str, what: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        if value is None:
            raise _bad(param, f"{param}: Field required ({what}).", "missing_required_parameter")
        raise _bad(param, f"{param}: must be {what}, got {_type_name(value)}.", "invalid_type")


def _blocks(content: object, where: str) -> list[Mapping[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _expect(content, list, where, "a string or an array of content blocks")
    assert isinstance(content, list)
    for j, block in enumerate(content):
        _expect(block, dict, f"{where}[{j}]", "a content block object")
        _expect(block.get("type"), str, f"{where}[{j}].type", "a string")
    return content


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    _expect(text, str, f"{where}.text", "a string")
    assert isinstance(text, str)
    return text


def _skip(err: InvalidRequestError, drop: list[str] | None) -> None:
    """Raise ``err`` (a field chat cannot carry), or note its field in ``drop`` (a lenient translation)."""
    if drop is None:
        raise err
    drop.append(err.param or "")


def _image(block: Mapping[str, Any], where: str, drop: list[str] | None = None) -> dict[str, Any] | None:
    source = block.get("source")
    _expect(source, dict, f"{where}.source", "an object")
    assert isinstance(source, dict)
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        _expect(media, str, f"{where}.source.media_type", "a string")
        _expect(data, str, f"{where}.source.data", "a base64 string")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        _expect(url, str, f"{where}.source.url", "a string")
        if not url:
            raise _bad(f"{where}.source.url", f"{where}.source.url: must not be empty.")
        return {"type": "image_url", "image_url": {"url": url}}
    _skip(_bad(f"{where}.source.type", f"{where}.source.type: {kind!r} is not supported for chat upstreams "
               "(base64 or url).", "unsupported_value"), drop)
    return None


def _unsupported_block(kind: str, where: str) -> InvalidRequestError:
    return _bad(f"{where}.type", f"{where}.type: {kind!r} blocks are not supported by this gateway for chat "
                "upstreams.", "unsupported_value")


def _tool_result(block: Mapping[str, Any], where: str, drop: list[str] | None
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``tool_result`` block as a ``tool`` message, and the images it carried."""
    tool_use_id = block.get("tool_use_id")
    _expect(tool_use_id, str, f"{where}.tool_use_id", "a string")
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if content is not None:
        for j, part in enumerate(_blocks(content, f"{where}.content")):
            pwhere = f"{where}.content[{j}]"
            if part["type"] == "text":
                texts.append(_text(part, pwhere))
            elif part["type"] == "image":
                images += filter(None, [_image(part, pwhere, drop)])
            else:
                _skip(_unsupported_block(str(part["type"]), pwhere), drop)
    is_error = block.get("is_error")
    if is_error is not None:
        _expect(is_error, bool, f"{where}.is_error", "a boolean")
    text = "\n".join(texts)
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}, images


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    _expect(call_id, str, f"{where}.id", "a string")
    _expect(name, str, f"{where}.name", "a string")
    _expect(args, dict, f"{where}.input", "an object")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _user_turn(blocks: list[Mapping[str, Any]], where: str, drop: list[str] | None) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind, bwhere = str(block["type"]), f"{where}[{j}]"
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, bwhere)})
        elif kind == "image":
            parts += filter(None, [_image(block, bwhere, drop)])
        elif kind == "tool_result":
            message, images = _tool_result(block, bwhere, drop)
            results.append(message)
            parts.extend(images)
        else:
            _skip(_unsupported_block(kind, bwhere), drop)
    out = results
    if parts:
        simple = all(p["type"] == "text" for p in parts)
        content: Any = "\n\n".join(p["text"] for p in parts) if simple and len(parts) == 1 else parts
        out.append({"role": "user", "content": content})
    return out


def _assistant_turn(blocks: list[Mapping[str, Any]], where: str, drop: list[str] | None) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind, bwhere = str(block["type"]), f"{where}[{j}]"
        if kind == "text":
            texts.append(_text(block, bwhere))
        elif kind == "tool_use":
            calls.append(_tool_call(block, bwhere))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # dropped for chat upstreams (module docstring)
        else:
            _skip(_unsupported_block(kind, bwhere), drop)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _system(system: object) -> str:
    if isinstance(system, str):
        return system
    return "\n\n".join(_text(b, f"system[{i}]") for i, b in enumerate(_blocks(system, "system")))


def _tools(tools: object, drop: list[str] | None) -> list[dict[str, Any]]:
    _expect(tools, list, "tools", "an array of tools")
    assert isinstance(tools, list)
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _expect(tool, dict, where, "an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            _skip(_bad(f"{where}.type", f"{where}.type: {kind!r}: server and Anthropic-defined tools are not "
                       "supported for chat upstreams (send custom tools with an input_schema).",
                       "unsupported_value"), drop)
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        _expect(name, str, f"{where}.name", "a string")
        _expect(schema, dict, f"{where}.input_schema", "a JSON schema object")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            _expect(description, str, f"{where}.description", "a string")
            fn["description"] = description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object, chat: dict[str, Any]) -> None:
    _expect(choice, dict, "tool_choice", "an object")
    assert isinstance(choice, dict)
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        _expect(name, str, "tool_choice.name", "a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif isinstance(kind, str) and kind in _TOOL_CHOICE:
        chat["tool_choice"] = _TOOL_CHOICE[kind]
    else:
        raise _bad("tool_choice.type",
                   f"tool_choice.type: must be one of auto, any, tool, none, got {kind!r}.")
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        chat["parallel_tool_calls"] = False


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float | None) -> None:
    value = body.get(key)
    if value is None:
        return
    _expect(value, (int, float), key, "a number")
    if value < lo or (hi is not None and value > hi):
        raise _bad(key, f"{key}: must be between {lo} and {hi}, got {value!r}." if hi is not None
                   else f"{key}: must be >= {lo}, got {value!r}.")


def to_chat(body: Mapping[str, Any], *, count_only: bool = False, drop: list[str] | None = None
            ) -> dict[str, Any]:
    """A Messages body as a chat-completions body (``count_only``: a ``count_tokens`` body, which has no
    ``max_tokens``). Raises ``InvalidRequestError`` naming the field. With a ``drop`` list, what chat cannot
    carry (400 ``unsupported_value`` otherwise) is left out and its field noted there instead."""
    model = body.get("model")
    _expect(model, str, "model", "a string")
    chat: dict[str, Any] = {"model": model}
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _system(body["system"])
        if system:
            messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    _expect(turns, list, "messages", "an array of messages")
    assert isinstance(turns, list)
    if not turns:
        raise _bad("messages", "messages: at least one message is required.")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        _expect(turn, dict, where, "an object")
        role = turn.get("role")
        blocks = _blocks(turn.get("content"), f"{where}.content")
        if role == "user":
            messages.extend(_user_turn(blocks, f"{where}.content", drop))
        elif role == "assistant":
            messages.append(_assistant_turn(blocks, f"{where}.content", drop))
        else:
            raise _bad(f"{where}.role", f"{where}.role: must be 'user' or 'assistant', got {role!r}.",
                       "invalid_value" if isinstance(role, str) else "invalid_type")
    chat["messages"] = messages
    if body.get("tools") is not None:
        tools = _tools(body["tools"], drop)
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
        if "tools" not in chat:
            chat.pop("tool_choice")
            chat.pop("parallel_tool_calls", None)
    if not count_only:
        _request_fields(body, chat)
    return chat


def _marks(blocks: object) -> list[Mapping[str, Any]]:
    return [b["cache_control"] for b in blocks if isinstance(b, Mapping) and isinstance(
        b.get("cache_control"), Mapping)] if isinstance(blocks, list) else []


def chat_breakpoints(body: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """The client's ``cache_control`` breakpoints of a Messages body, for upstreams that read its chat
    translation (Gemini's context caching, :mod:`ethen.gateway.providers.gemini_cache`): each as (how many
    leading messages of :func:`to_chat`'s translation it covers, the mark). A tool's covers none, a system
    block's the system message; one on a block of ``messages[j]`` the translation of ``messages[:j + 1]``
    when it is the turn's last block, else of ``messages[:j]`` (a translated turn is not split). ``[]`` for
    a body :func:`to_chat` refuses."""
    turns = body.get("messages")
    if not isinstance(turns, list):
        return []
    try:
        system = 1 if body.get("system") is not None and _system(body["system"]) else 0

        def covered(k: int) -> int:
            if k == 0:
                return system
            return len(to_chat({**body, "messages": turns[:k]}, count_only=True, drop=[])["messages"])

        out: list[tuple[int, Mapping[str, Any]]] = [(0, m) for m in _marks(body.get("tools"))]
        out += [(system, m) for m in _marks(body.get("system"))]
        for j, turn in enumerate(turns):
            content = turn.get("content") if isinstance(turn, Mapping) else None
            for mark in _marks(content):
                last = isinstance(content, list) and isinstance(content[-1], Mapping) and content[-1].get(
                    "cache_control") is mark
                out.append((covered(j + 1 if last else j), mark))
    except InvalidRequestError:
        return []
    return out


def _request_fields(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    max_tokens = body.get("max_tokens")
    _expect(max_tokens, int, "max_tokens", "an integer")
    assert isinstance(max_tokens, int)
    if max_tokens < 1:
        raise _bad("max_tokens", f"max_tokens: must be at least 1, got {max_tokens}.")
    chat["max_tokens"] = max_tokens
    _number(body, "temperature", 0.0, 1.0)
    _number(body, "top_p", 0.0, 1.0)
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("top_k") is not None:
        _expect(body["top_k"], int, "top_k", "an integer")
        if body["top_k"] < 0:
            raise _bad("top_k", f"top_k: must be >= 0, got {body['top_k']}.")
    stops = body.get("stop_sequences")
    if stops is not None:
        _expect(stops, list, "stop_sequences", "an array of strings")
        for i, s in enumerate(stops):
            _expect(s, str, f"stop_sequences[{i}]", "a string")
        if stops:
            chat["stop"] = list(stops)
    stream = body.get("stream")
    if stream is not None:
        _expect(stream, bool, "stream", "a boolean")
        if stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
    output = body.get("output_config")
    if output is not None:
        _expect(output, dict, "output_config", "an object")
        assert isinstance(output, dict)
        fmt = output.get("format")
        if fmt is not None:
            _expect(fmt, dict, "output_config.format", "an object")
            assert isinstance(fmt, dict)
            if fmt.get("type") != "json_schema":
                raise _bad("output_config.format.type",
                           f"output_config.format.type: must be 'json_schema', got {fmt.get('type')!r}.")
            _expect(fmt.get("schema"), dict, "output_config.format.schema", "a JSON schema object")
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
    metadata = body.get("metadata")
    if metadata is not None:
        _expect(metadata, dict, "metadata", "an object")
        assert isinstance(metadata, dict)
        user = metadata.get("user_id")
        if user is not None:
            _expect(user, str, "metadata.user_id", "a string")
            chat["user"] = user
        if metadata.get("routing") is not None:
            chat["metadata"] = {"routing": metadata["routing"]}


# --- model names --------------------------------------------------------------------------------------------


def resolve_model(model: str, known: Collection[str], model_map: Mapping[str, str]) -> str:
    """The model to route: ``model`` itself when it is ``known`` (an alias, a route's model or id), else the
    target of the first ``model_map`` pattern (fnmatch, case-sensitive, in order) it matches. Raises
    ``ModelNotFoundError`` (404 ``not_found_error``) when none does."""
    if model in known:
        return model
    for pattern, target in model_map.items():
        if fnmatch.fnmatchcase(model, pattern):
            return target
    raise ModelNotFoundError(model, model_map_hint(model))
