"""Gateway providers: one interface (:mod:`.base`), one module per upstream API."""

from .anthropic import AnthropicProvider
from .base import Completion, Provider, ProviderStream, Timeouts, UpstreamCall, Usage
from .openai_compat import OpenAICompatProvider

__all__ = [
    "AnthropicProvider",
    "Completion",
    "OpenAICompatProvider",
    "Provider",
    "ProviderStream",
    "Timeouts",
    "UpstreamCall",
    "Usage",
]
