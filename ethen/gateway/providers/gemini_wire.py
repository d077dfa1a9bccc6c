"""The Gemini API's wire format (``generateContent``), translated from and to OpenAI chat completions. Pure
functions: no I/O (the provider is :mod:`.gemini`).

Request (OpenAI -> Gemini ``GenerateContentRequest``):
- ``system`` / ``developer`` messages -> ``systemInstruction.parts`` (text);
- ``user`` -> a ``user`` turn, ``assistant`` -> a ``model`` turn; text parts -> ``{text}``, ``image_url``
  parts -> ``{inlineData: {mimeType, data}}`` for a ``data:`` URL, else ``{fileData: {mimeType, fileUri}}``;
- assistant ``tool_calls`` -> ``{functionCall: {name, args}}`` parts; ``tool`` messages ->
  ``{functionResponse: {name, response}}`` parts in a ``user`` turn (the name comes from the assistant call
  with that ``tool_call_id``; a JSON-object result is the response as is, anything else ``{"result": ...}``);
- consecutive turns of one role are merged (Gemini wants them alternating);
- ``tools`` -> one ``{functionDeclarations: [...]}`` tool; ``tool_choice`` auto/required/none/named ->
  ``toolConfig.functionCallingConfig.mode`` AUTO/ANY/NONE (named: ANY + ``allowedFunctionNames``);
- ``generationConfig``: ``temperature``, ``top_p`` -> ``topP``, ``max_completion_tokens`` / ``max_tokens`` ->
  ``maxOutputTokens``, ``stop`` -> ``stopSequences``, ``n`` -> ``candidateCount``, ``seed``,
  ``presence_penalty`` / ``frequency_penalty``; ``response_format`` ``json_object`` -> ``responseMimeType:
  application/json``, ``json_schema`` -> that plus ``responseSchema``; ``reasoning_effort`` ->
  ``thinkingConfig`` (``thinkingBudget`` 0 / 1K / 8K / 24K, or ``thinkingLevel`` for ``gemini-3*`` models);
- schemas (tool parameters, ``responseSchema``) are reduced to the OpenAPI subset Gemini's ``Schema``
  accepts (:func:`gemini_schema`: ``type: [x, "null"]`` -> ``nullable``, unknown keywords such as
  ``additionalProperties`` / ``$schema`` / ``strict`` dropped).

Response: the first candidate's ``text`` parts -> ``message.content`` (``thought`` parts are left out),
``functionCall`` parts -> ``tool_calls`` (id from the part when Gemini sends one, else ``call_<n>``; a
part's ``thoughtSignature`` rides in the id after ``__thought__`` and goes back on the ``functionCall`` part
when the client replays the call, as thinking models require);
``finishReason`` -> ``finish_reason`` (:data:`FINISH`; a function call with STOP -> ``tool_calls``);
``usageMetadata`` -> usage (:func:`usage_of`). A prompt blocked by safety (``promptFeedback.blockReason``,
no candidate) is :class:`~ethen.gateway.errors.UpstreamContentFilterError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ethen.gateway.errors import UpstreamContentFilterError
from ethen.gateway.providers.base import Usage

__all__ = [
    "FINISH",
    "SIG_SEP",
    "THINKING_BUDGET",
    "THINKING_LEVEL",
    "blocked_error",
    "call_of",
    "finish_reason",
    "from_gemini",
    "gemini_schema",
    "message_parts",
    "to_gemini",
    "turn_owners",
    "usage_of",
]

#: joins a tool call id and the ``thoughtSignature`` of its ``functionCall`` part
SIG_SEP = "__thought__"
#: Gemini ``finishReason`` -> OpenAI ``finish_reason`` (anything else: ``stop``)
FINISH: Mapping[str, str] = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}

_SCHEMA_KEYS = frozenset({
    "type", "format", "title", "description", "nullable", "enum", "maxItems", "minItems", "properties",
    "required", "minProperties", "maxProperties", "minLength", "maxLength", "pattern", "example", "anyOf",
    "propertyOrdering", "default", "items", "minimum", "maximum",
})


def gemini_schema(schema: Any) -> Any:
    """A JSON Schema reduced to the OpenAPI subset of Gemini's ``Schema`` object."""
    if isinstance(schema, list):
        return [gemini_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key not in _SCHEMA_KEYS:
            continue
        if key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            if len(kinds) < len(value):
                out["nullable"] = True
            if kinds:
                out["type"] = kinds[0]
        elif key == "properties" and isinstance(value, Mapping):
            out[key] = {str(k): gemini_schema(v) for k, v in value.items()}
        elif key in ("items", "anyOf"):
            out[key] = gemini_schema(value)
        else:
            out[key] = value
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


def _mime_of(url: str) -> str:
    ext = url.rsplit("?", 1)[0].rsplit(".", 1)[-1].lower()
    return {"png": "image/png", "gif": "image/gif", "webp": "image/webp", "pdf": "application/pdf"}.get(
        ext, "image/jpeg")


def _image_part(part: Mapping[str, Any]) -> dict[str, Any]:
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, Mapping) else iu if isinstance(iu, str) else part.get("url")
    url = str(url or "")
    if url.startswith("data:") and ";base64," in url:
        head, data = url[5:].split(";base64,", 1)
        return {"inlineData": {"mimeType": head or "image/png", "data": data}}
    return {"fileData": {"mimeType": _mime_of(url), "fileUri": url}}


def message_parts(content: Any) -> list[dict[str, Any]]:
    """OpenAI message content (a string or content parts) as Gemini parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    out: list[dict[str, Any]] = []
    for part in content if isinstance(content, Sequence) else ():
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            out.append({"text": str(part.get("text", ""))})
        elif kind in ("image_url", "input_image"):
            out.append(_image_part(part))
    return out


def _args(raw: Any) -> dict[str, Any]:
    try:
        parsed = json.loads(raw) if isinstance(raw, str) and raw else {}
    except ValueError:
        return {"_raw": raw}
    return parsed if isinstance(parsed, dict) else {"_value": parsed}


def _response(content: Any) -> dict[str, Any]:
    text = _text_of(content)
    try:
        parsed = json.loads(text)
    except ValueError:
        return {"result": text}
    return parsed if isinstance(parsed, dict) else {"result": parsed}


def _tool_config(choice: Any) -> dict[str, Any] | None:
    if choice == "auto":
        return {"functionCallingConfig": {"mode": "AUTO"}}
    if choice == "required":
        return {"functionCallingConfig": {"mode": "ANY"}}
    if choice == "none":
        return {"functionCallingConfig": {"mode": "NONE"}}
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = str(choice["function"].get("name", ""))
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}
    return None


#: OpenAI ``reasoning_effort`` -> Gemini 2.5 ``thinkingBudget`` (Google's own OpenAI-compatible mapping:
#: low / medium / high = 1K / 8K / 24K tokens, none = off) ...
THINKING_BUDGET: Mapping[str, int] = {"none": 0, "minimal": 1024, "low": 1024, "medium": 8192, "high": 24576}
#: ... and -> Gemini 3 ``thinkingLevel`` (Pro knows only low and high)
THINKING_LEVEL: Mapping[str, str] = {"none": "low", "minimal": "low", "low": "low", "medium": "high",
                                     "high": "high"}  # fmt: skip


def _thinking(effort: Any, model: str) -> dict[str, Any] | None:
    if not isinstance(effort, str) or effort not in THINKING_BUDGET:
        return None
    if model.removeprefix("models/").startswith("gemini-3"):
        return {"thinkingLevel": THINKING_LEVEL[effort]}
    return {"thinkingBudget": THINKING_BUDGET[effort]}


def _generation_config(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    thinking = _thinking(body.get("reasoning_effort"), model)
    if thinking is not None:
        cfg["thinkingConfig"] = thinking
    for ours, theirs in (("temperature", "temperature"), ("top_p", "topP"), ("seed", "seed"),
                         ("presence_penalty", "presencePenalty"), ("frequency_penalty", "frequencyPenalty")):
        value = body.get(ours)
        if isinstance(value, int | float) and not isinstance(value, bool):
            cfg[theirs] = value
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        cfg["maxOutputTokens"] = max_tokens
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        cfg["candidateCount"] = n
    stop = body.get("stop")
    if isinstance(stop, str):
        cfg["stopSequences"] = [stop]
    elif isinstance(stop, list):
        cfg["stopSequences"] = [s for s in stop if isinstance(s, str)]
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema"):
        cfg["responseMimeType"] = "application/json"
        js = fmt.get("json_schema")
        schema = js.get("schema") if isinstance(js, Mapping) else None
        if fmt.get("type") == "json_schema" and isinstance(schema, Mapping):
            cfg["responseSchema"] = gemini_schema(schema)
    return cfg


def _contents(messages: Any) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    """Chat messages as (system texts, Gemini turns, the turn each message went into: -1 for none)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    owners: list[int] = []
    names: dict[str, str] = {}  # tool_call_id -> function name

    def add(role: str, parts: list[dict[str, Any]]) -> int:
        if not parts:
            return -1
        if turns and turns[-1]["role"] == role:
            turns[-1]["parts"].extend(parts)
        else:
            turns.append({"role": role, "parts": parts})
        return len(turns) - 1

    for msg in messages if isinstance(messages, Sequence) and not isinstance(messages, str) else ():
        owner = -1
        if not isinstance(msg, Mapping):
            owners.append(owner)
            continue
        role = msg.get("role")
        if role in ("system", "developer"):
            text = _text_of(msg.get("content"))
            if text:
                system.append(text)
        elif role == "user":
            owner = add("user", message_parts(msg.get("content")))
        elif role == "assistant":
            parts = message_parts(msg.get("content"))
            for call in msg.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    name, call_id = str(fn.get("name", "")), str(call.get("id", ""))
                    names[call_id] = name
                    fc = {"name": name, "args": _args(fn.get("arguments"))}
                    fc_part: dict[str, Any] = {"functionCall": fc}
                    sig = _signature(call_id)
                    if sig is not None:
                        fc_part["thoughtSignature"] = sig
                    parts.append(fc_part)
            owner = add("model", parts)
        elif role == "tool":
            call_id = str(msg.get("tool_call_id", ""))
            name = names.get(call_id) or str(msg.get("name") or call_id)
            result = {"name": name, "response": _response(msg.get("content"))}
            owner = add("user", [{"functionResponse": result}])
        owners.append(owner)
    return system, turns, owners


def turn_owners(body: Mapping[str, Any]) -> list[int]:
    """For each chat message of ``body``, the index of the :func:`to_gemini` ``contents`` turn it went into
    (-1: none, e.g. a system message); consecutive messages of one role share a turn."""
    return _contents(body.get("messages"))[2]


def to_gemini(body: Mapping[str, Any], model: str = "") -> dict[str, Any]:
    """An OpenAI chat-completions body as a Gemini ``GenerateContentRequest`` (the model is in the URL; its
    name picks how ``reasoning_effort`` is sent)."""
    system, turns, _ = _contents(body.get("messages"))
    out: dict[str, Any] = {"contents": turns}
    if system:
        out["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        decls: list[dict[str, Any]] = []
        for t in tools:
            fn = t.get("function") if isinstance(t, Mapping) else None
            if isinstance(fn, Mapping):
                decl: dict[str, Any] = {"name": str(fn.get("name", ""))}
                if fn.get("description"):
                    decl["description"] = str(fn["description"])
                params = fn.get("parameters")
                if isinstance(params, Mapping) and params.get("properties"):
                    decl["parameters"] = gemini_schema(params)
                decls.append(decl)
        if decls:
            out["tools"] = [{"functionDeclarations": decls}]
            tc = _tool_config(body.get("tool_choice"))
            if tc is not None:
                out["toolConfig"] = tc
    cfg = _generation_config(body, model)
    if cfg:
        out["generationConfig"] = cfg
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage_of(meta: Any) -> Usage | None:
    """``usageMetadata`` as usage: prompt = ``promptTokenCount`` (cached tokens included) + tool-use prompt
    tokens; completion = ``candidatesTokenCount`` + ``thoughtsTokenCount`` (thinking is billed as output);
    ``cachedContentTokenCount`` -> cache reads, thoughts -> reasoning tokens."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("promptTokenCount"), int):
        return None
    thoughts = _int(meta.get("thoughtsTokenCount"))
    base = Usage.of(_int(meta.get("promptTokenCount")) + _int(meta.get("toolUsePromptTokenCount")),
                    _int(meta.get("candidatesTokenCount")) + thoughts)
    if base is None:
        return None
    return Usage(base.prompt_tokens, base.completion_tokens,
                 cache_read_tokens=min(_int(meta.get("cachedContentTokenCount")), base.prompt_tokens),
                 reasoning_tokens=thoughts)


def blocked_error(obj: Mapping[str, Any], provider: str) -> UpstreamContentFilterError | None:
    """The error for a prompt Gemini blocked (``promptFeedback.blockReason`` and no candidate), else None."""
    fb = obj.get("promptFeedback")
    reason = fb.get("blockReason") if isinstance(fb, Mapping) else None
    if reason is None or obj.get("candidates"):
        return None
    return UpstreamContentFilterError(
        f"provider {provider!r} blocked the prompt (Gemini promptFeedback.blockReason = {str(reason)!r})",
        provider, 400)


def finish_reason(reason: Any, has_calls: bool) -> str:
    out = FINISH.get(str(reason), "stop")
    return "tool_calls" if has_calls and out == "stop" else out


def _signed_id(call_id: str, signature: Any) -> str:
    """A tool call id carrying Gemini's ``thoughtSignature`` (URL-safe base64, no padding), so the client
    echoes it back with the call and :func:`to_gemini` can return it (thinking models require it)."""
    if not isinstance(signature, str) or not signature:
        return call_id
    return call_id + SIG_SEP + signature.replace("+", "-").replace("/", "_").rstrip("=")


def _signature(call_id: str) -> str | None:
    if SIG_SEP not in call_id:
        return None
    sig = call_id.split(SIG_SEP, 1)[1].replace("-", "+").replace("_", "/")
    return sig + "=" * (-len(sig) % 4)


def call_of(part: Mapping[str, Any], index: int) -> dict[str, Any] | None:
    """A ``functionCall`` part as an OpenAI tool call (``None`` for any other part)."""
    fc = part.get("functionCall")
    if not isinstance(fc, Mapping):
        return None
    return {
        "id": _signed_id(str(fc.get("id") or f"call_{index}"), part.get("thoughtSignature")),
        "type": "function",
        "function": {"name": str(fc.get("name", "")), "arguments": json.dumps(fc.get("args") or {})},
    }


def from_gemini(obj: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A ``GenerateContentResponse`` as an OpenAI ``chat.completion`` (every candidate a choice)."""
    choices: list[dict[str, Any]] = []
    for i, cand in enumerate(obj.get("candidates") or ()):
        if not isinstance(cand, Mapping):
            continue
        content = cand.get("content")
        parts = content.get("parts") if isinstance(content, Mapping) else None
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, Mapping):
                continue
            call = call_of(part, len(calls))
            if call is not None:
                calls.append(call)
            elif isinstance(part.get("text"), str) and not part.get("thought"):
                text.append(part["text"])
        message: dict[str, Any] = {
            "role": "assistant", "content": "".join(text) if text or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": _int(cand.get("index")) or i, "message": message,
                        "finish_reason": finish_reason(cand.get("finishReason"), bool(calls)),
                        "logprobs": None})
    out: dict[str, Any] = {
        "id": str(obj.get("responseId") or "chatcmpl-gemini"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(obj.get("modelVersion") or model),
        "choices": choices,
    }
    usage = usage_of(obj.get("usageMetadata"))
    if usage is not None:
        out["usage"] = usage.to_openai()
    return out
