"""Llama-family GGUF models (``llama``, ``qwen2``; default SmolLM2-135M-Instruct) in NumPy, split-able by
layer ranges.

* Worker side: :func:`load_layer_stacks` -> :class:`LayerStack` with
  ``forward(hidden[T, d], positions[T], kv)`` and batched ``forward_batch``; :class:`KVCache` per session.
* Orchestrator side: :func:`load_embed_and_head` -> :data:`Ends` (``embed``, ``logits``),
  :class:`Tokenizer`, :class:`ChatTemplate`, :mod:`sampling <ethen.model.sampling>`,
  :func:`generate_stream`.
* Single process: :func:`load_model` -> :class:`Model`; :func:`generate_chat`.
* The engine: the loaders take an :class:`EngineOptions` (``--engine`` / ``--accuracy`` / ``--device``;
  default ``auto`` everywhere); nothing in this package reads the environment for it.
"""

from ethen.model.chat_template import ChatTemplate
from ethen.model.choose import EngineOptions
from ethen.model.config import ModelConfig
from ethen.model.errors import (
    GGUFFormatError,
    KVCacheFullError,
    ModelError,
    ModelInputError,
    UnsupportedModelError,
    WeightsNotFoundError,
)
from ethen.model.generate import (
    GenerationChunk,
    GenerationResult,
    StepFn,
    generate,
    generate_chat,
    generate_stream,
    model_step,
)
from ethen.model.gguf_loader import WeightStore, find_gguf_path, open_weight_store
from ethen.model.kv_cache import KVCache
from ethen.model.model import (
    Ends,
    LayerStack,
    Model,
    load_embed_and_head,
    load_layer_stacks,
    load_model,
    parse_layer_ranges,
)
from ethen.model.sampling import SamplingParams, TextStream, make_rng, sample_token
from ethen.model.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "Ends",
    "EngineOptions",
    "GGUFFormatError",
    "GenerationChunk",
    "GenerationResult",
    "KVCache",
    "KVCacheFullError",
    "LayerStack",
    "Model",
    "ModelConfig",
    "ModelError",
    "ModelInputError",
    "SamplingParams",
    "StepFn",
    "TextStream",
    "Tokenizer",
    "UnsupportedModelError",
    "WeightStore",
    "WeightsNotFoundError",
    "find_gguf_path",
    "generate",
    "generate_chat",
    "generate_stream",
    "load_embed_and_head",
    "load_layer_stacks",
    "load_model",
    "make_rng",
    "model_step",
    "open_weight_store",
    "parse_layer_ranges",
    "sample_token",
]
