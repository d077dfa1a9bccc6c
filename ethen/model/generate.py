"""Token generation loop, written once for any way of computing logits.

:func:`generate_stream` drives a ``step`` callable - "feed these token ids after everything fed so far,
return the logits of the last one" - so the single-process :class:`~ethen.model.model.Model` (see
:func:`model_step`) and a pipeline of remote workers share the same sampling, stop and streaming behaviour.

Finish reasons follow the OpenAI API: ``"stop"`` (a stop token such as ``<|im_end|>``, or a stop string) or
``"length"`` (``max_tokens`` reached, or the context is full).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import ModelInputError
from ethen.model.kv_cache import KVCache
from ethen.model.model import Model
from ethen.model.sampling import SamplingParams, TextStream, make_rng, sample_token
from ethen.model.tokenizer import Tokenizer

__all__ = ["GenerationChunk", "GenerationResult", "StepFn", "generate", "generate_chat", "generate_stream",
           "model_step"]

StepFn = Callable[[Sequence[int]], NDArray[np.float32]]


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """One generated token and the text it makes visible; ``finish_reason`` is set on the last chunk."""

    token_id: int | None  # None on a final chunk that only flushes held-back text
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def model_step(model: Model, kv: KVCache | None = None) -> StepFn:
    """A :data:`StepFn` over the single-process model with its own (or the given) KV cache."""
    cache = kv if kv is not None else model.new_kv_cache()

    def step(token_ids: Sequence[int]) -> NDArray[np.float32]:
        return model.logits(token_ids, cache)

    return step


def generate_stream(step: StepFn, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                    context_length: int | None = None) -> Iterator[GenerationChunk]:
    """Prefill ``prompt_ids`` then sample until a stop token/string, ``max_tokens`` or the context limit."""
    if len(prompt_ids) == 0:
        raise ModelInputError("prompt_ids must not be empty")
    if context_length is not None and len(prompt_ids) >= context_length:
        raise ModelInputError(f"prompt has {len(prompt_ids)} tokens; the context holds {context_length}")
    rng = make_rng(params.seed)
    stream = TextStream(tokenizer, params.stop)
    logits = step(list(prompt_ids))
    n_ctx = len(prompt_ids)
    for i in range(params.max_tokens):
        token = sample_token(logits, params, rng)
        if token in tokenizer.stop_token_ids:
            yield GenerationChunk(None, stream.flush(), "stop")
            return
        delta = stream.push(token)
        if stream.stopped:
            yield GenerationChunk(token, delta, "stop")
            return
        n_ctx += 1
        last = i == params.max_tokens - 1 or (context_length is not None and n_ctx >= context_length)
        if last:
            yield GenerationChunk(token, delta + stream.flush(), "length")
            return
        yield GenerationChunk(token, delta)
        logits = step([token])


def generate(step: StepFn, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             context_length: int | None = None) -> GenerationResult:
    """Run :func:`generate_stream` to the end and collect the result."""
    text: list[str] = []
    ids: list[int] = []
    reason = "length"
    for chunk in generate_stream(step, tokenizer, prompt_ids, params, context_length):
        text.append(chunk.text)
        if chunk.token_id is not None:
            ids.append(chunk.token_id)
        if chunk.finish_reason is not None:
            reason = chunk.finish_reason
    return GenerationResult("".join(text), tuple(ids), reason, len(prompt_ids))


def generate_chat(model: Model, messages: Sequence[Mapping[str, Any]],
                  params: SamplingParams) -> GenerationResult:
    """Single-process chat completion: render the GGUF chat template, tokenize, generate."""
    prompt_ids = model.tokenizer.encode(model.chat_template.render(messages, add_generation_prompt=True))
    return generate(model_step(model), model.tokenizer, prompt_ids, params, model.config.context_length)
