"""The Responses API's tool list beyond plain functions (pure: no I/O): ``namespace`` groups and hosted tools.

``namespace`` (what Codex CLI sends by default, e.g. its ``multi_agent_v1`` group)::

    {"type": "namespace", "name": "crm", "description": "...",
     "tools": [{"type": "function", "name": "lookup", "description": "...", "parameters": {...}}]}

Each function of a group becomes one chat function tool named :func:`qualify` (``crm__lookup``: chat tool
names allow ``[A-Za-z0-9_-]`` only, 64 at most; a longer name is cut and ends in a hash of the whole), its
description prefixed by the group's. The model's calls are mapped back by :class:`ToolNames`: a
``function_call`` item answers ``{"name": "lookup", "namespace": "crm"}`` as OpenAI's does, and an input
``function_call`` item carrying a ``namespace`` (the client replaying its history) is qualified the same way.
A ``custom`` (free-form) tool inside a group is refused like a top-level one (400 ``unsupported_value``).

Hosted tools (:data:`HOSTED`: ``web_search``, ``file_search``, ``code_interpreter``, ``image_generation``,
``mcp``...) run on OpenAI's side or need Responses-only output items. No configured provider speaks the
Responses API natively (every candidate is reached by chat translation), so no candidate can run one: they are
dropped, and the answer says so (``ethen.routing.dropped_tools`` and an ``x-ethen-dropped-tools`` header).
``[compat] drop_unsupported_tools = false`` makes them a 400 ``unsupported_value`` naming the tool instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ethen.gateway.errors import InvalidRequestError

__all__ = ["DROPPED_HEADER", "HOSTED", "Flat", "ToolNames", "chat_tools", "flatten", "qualify"]

#: tool types that run on OpenAI's side (or answer with Responses-only items): no chat upstream can run them
HOSTED = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer_use_preview", "computer",
    "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling",
})  # fmt: skip
DROPPED_HEADER = "x-ethen-dropped-tools"
SEP = "__"
_MAX_NAME = 64


def qualify(namespace: str, name: str) -> str:
    """The chat tool name of ``name`` in ``namespace`` (deterministic: input items qualify the same way)."""
    full = f"{namespace}{SEP}{name}"
    if len(full) <= _MAX_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:10]
    return f"{full[: _MAX_NAME - 11]}_{digest}"


@dataclass(slots=True)
class ToolNames:
    """Chat tool names of namespaced functions -> (namespace, name)."""

    grouped: dict[str, tuple[str, str]] = field(default_factory=dict)

    def original(self, chat_name: str) -> tuple[str | None, str]:
        """(namespace or None, name) of a tool name the model called."""
        hit = self.grouped.get(chat_name)
        return hit if hit is not None else (None, chat_name)

    def call_fields(self, chat_name: str) -> dict[str, str]:
        """The ``name`` (and ``namespace``) fields of a ``function_call`` item."""
        namespace, name = self.original(chat_name)
        return {"name": name, "namespace": namespace} if namespace is not None else {"name": name}


@dataclass(slots=True)
class Flat:
    """A Responses ``tools`` array flattened for chat."""

    #: (param, tool, its namespace, the namespace's description) per function, in order
    functions: list[tuple[str, Mapping[str, Any], str | None, str | None]]
    echo: list[Any]  # the tools the Response object echoes (namespace groups as sent, hosted ones left out)
    names: ToolNames
    dropped: list[dict[str, str]]  # {"param": "tools[8]", "type": "web_search"} per dropped hosted tool


def _bad(param: str, message: str, code: str) -> InvalidRequestError:
    return InvalidRequestError(message, code=code, param=param)


def _expect(value: object, kind: type, param: str, what: str) -> None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        got = "null" if value is None else type(value).__name__
        raise _bad(param, f"'{param}' must be {what}, got {got}.", "invalid_type")


def _unsupported(kind: object, param: str) -> InvalidRequestError:
    return _bad(f"{param}.type", f"Tool type {kind!r:.40} is not supported by this gateway (function and "
                "namespace tools; hosted tools are dropped unless [compat] drop_unsupported_tools = false).",
                "unsupported_value" if isinstance(kind, str) else "invalid_type")


def _namespace(tool: Mapping[str, Any], tw: str, flat: Flat) -> None:
    ns, desc, members = tool.get("name"), tool.get("description"), tool.get("tools")
    if not isinstance(ns, str) or not ns:
        raise _bad(f"{tw}.name", f"'{tw}.name' must be a non-empty string.", "invalid_type"
                   if not isinstance(ns, str) else "invalid_value")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"{tw}.description", f"'{tw}.description' must be a string.", "invalid_type")
    if not isinstance(members, list) or not members:
        raise _bad(f"{tw}.tools", f"'{tw}.tools' must be a non-empty array of function tools.",
                   "invalid_type" if not isinstance(members, list) else "invalid_value")
    for j, member in enumerate(members):
        mw = f"{tw}.tools[{j}]"
        if not isinstance(member, Mapping):
            raise _bad(mw, f"'{mw}' must be an object.", "invalid_type")
        if member.get("type") != "function":
            raise _bad(f"{mw}.type", f"Tool type {member.get('type')!r:.40} inside a namespace is not "
                       "supported by this gateway (only 'function').",
                       "unsupported_value" if isinstance(member.get("type"), str) else "invalid_type")
        flat.functions.append((mw, member, ns, desc if isinstance(desc, str) and desc else None))
        if isinstance(member.get("name"), str):
            flat.names.grouped[qualify(ns, member["name"])] = (ns, member["name"])
    flat.echo.append(dict(tool))


def flatten(tools: list[Any], drop_hosted: bool) -> Flat:
    """Function tools (top level and in namespace groups) in order; hosted ones dropped (or refused)."""
    flat = Flat([], [], ToolNames(), [])
    for i, tool in enumerate(tools):
        tw = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _bad(tw, f"'{tw}' must be an object, got {type(tool).__name__}.", "invalid_type")
        kind = tool.get("type")
        if not isinstance(kind, str):  # before any set lookup: a list or object is unhashable (issue 42)
            raise _unsupported(kind, tw)
        if kind == "function":
            flat.functions.append((tw, tool, None, None))
        elif kind == "namespace":
            _namespace(tool, tw, flat)
        elif kind in HOSTED and drop_hosted:
            flat.dropped.append({"param": tw, "type": str(kind)})
        elif kind in HOSTED:
            raise _bad(f"{tw}.type", f"Hosted tool {kind!r} cannot run here: no candidate speaks the "
                       "Responses API natively, and this gateway refuses instead of dropping it ([compat] "
                       "drop_unsupported_tools = false).", "unsupported_value")
        else:
            raise _unsupported(kind, tw)
    return flat


def chat_tools(tools: list[Any], drop_hosted: bool) -> tuple[list[dict[str, Any]], list[Any], ToolNames,
                                                            list[dict[str, str]]]:
    """The chat tools of a Responses ``tools`` array: (chat tools, echoed Responses tools, namespaced
    names, dropped hosted tools). Raises ``InvalidRequestError`` naming the field."""
    flat = flatten(tools, drop_hosted)
    chat: list[dict[str, Any]] = []
    echo: list[Any] = []
    seen: dict[str, tuple[str, bool]] = {}  # chat name -> (param, namespaced)
    for tw, tool, namespace, ns_desc in flat.functions:
        name, desc, params, strict = (tool.get(k) for k in ("name", "description", "parameters", "strict"))
        _expect(name, str, f"{tw}.name", "a string")
        if desc is not None:
            _expect(desc, str, f"{tw}.description", "a string")
        if params is not None:
            _expect(params, Mapping, f"{tw}.parameters", "an object (a JSON schema)")
        if strict is not None:
            _expect(strict, bool, f"{tw}.strict", "a boolean")
        assert isinstance(name, str)
        chat_name = qualify(namespace, name) if namespace is not None else name
        other = seen.get(chat_name)
        if other is not None and (namespace is not None or other[1]):  # a call could not be mapped back
            raise _bad(f"{tw}.name", f"'{tw}.name' = {name!r:.64}: its chat name {chat_name!r} is also "
                       f"{other[0]}'s.", "invalid_value")
        seen[chat_name] = (tw, namespace is not None)
        fn: dict[str, Any] = {"name": chat_name}
        if ns_desc is not None or desc is not None:
            fn["description"] = "\n\n".join(d for d in (ns_desc, desc) if d)
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if strict is not None:
            fn["strict"] = strict
        chat.append({"type": "function", "function": fn})
        if namespace is None:
            echo.append({"type": "function", "name": name, "description": desc, "parameters": params,
                         "strict": strict})
    echo += flat.echo  # namespace groups as sent
    return chat, echo, flat.names, flat.dropped
