"""Chat prompt rendering with the GGUF's own ``tokenizer.chat_template`` (jinja2, sandboxed).

Rendered the way transformers' ``apply_chat_template`` does it: an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` available to the
template, and ``add_generation_prompt``, ``bos_token`` and ``eos_token`` (the GGUF's BOS/EOS token text, as
Llama and TinyLlama templates use them) passed in. Messages are validated first (role and content must be
strings), so a bad request gets a clear error rather than a template traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ethen.model.errors import ModelInputError

__all__ = ["ChatTemplate"]


def _raise_exception(message: str) -> NoReturn:
    raise ModelInputError(f"chat template refused the messages: {message}")


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ModelInputError("tokenizer.chat_template is empty")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelInputError(f"tokenizer.chat_template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise ModelInputError("messages must be a non-empty list of {role, content} objects")
        clean: list[dict[str, str]] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                raise ModelInputError(f"messages[{i}] must be an object, got {type(msg).__name__}")
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str) or not role:
                raise ModelInputError(f"messages[{i}].role must be a non-empty string, got {role!r}")
            if not isinstance(content, str):
                raise ModelInputError(f"messages[{i}].content must be a string, got {type(content).__name__}")
            clean.append({"role": role, "content": content})
        try:
            return str(self._template.render(messages=clean, add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token, eos_token=self.eos_token))
        except ModelInputError:
            raise
        except jinja2.TemplateError as exc:
            raise ModelInputError(f"chat template failed to render: {exc}") from exc
