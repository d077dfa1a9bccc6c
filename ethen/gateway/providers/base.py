"""The one interface every gateway provider implements.

A provider turns an OpenAI chat-completions body into an upstream call and back into OpenAI-shaped output:

- :meth:`Provider.complete` returns a :class:`Completion` (an OpenAI ``chat.completion`` object as a dict);
- :meth:`Provider.stream` returns a :class:`ProviderStream`, an async iterator of OpenAI
  ``chat.completion.chunk`` JSON payloads as ``bytes`` (already serialized, so an OpenAI-compatible upstream
  is passed through without re-encoding), which records the usage and completion it observed.

Nothing in the interface is HTTP-specific: an in-process provider (the mesh) implements the same two methods.
Both results carry ``receipt_extra``, a JSON-able mapping the provider wants on the routing receipt (the mesh
puts its route there: stages, nodes, per-stage cost); the executor merges it under ``ethen.routing`` as
``provider_receipt`` of the attempt that served the request.

Errors: a provider raises only :class:`ethen.gateway.errors.UpstreamError` subclasses; each carries
``retryable`` (may the executor try the next candidate?) and an ``error_class`` for telemetry and metrics.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.routing.capacity import ProviderCapacity


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-provider timeouts in seconds: TCP/TLS connect, first byte (also the longest idle gap between two
    reads of a stream), and the total time of one call."""

    connect: float = 5.0
    first_byte: float = 60.0
    total: float = 300.0


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as reported by the upstream (``None`` when it did not report them)."""

    prompt_tokens: int
    completion_tokens: int
    #: of ``prompt_tokens``: read from the provider's prompt cache / written to it (priced apart: see
    #: :mod:`ethen.gateway.accounting.pricing`); of ``completion_tokens``: reasoning (thinking) tokens
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cache_read_tokens or self.cache_write_tokens:
            # ``cache_write_tokens``: the prompt tokens the provider wrote to its cache (OpenRouter's name)
            out["prompt_tokens_details"] = {"cached_tokens": self.cache_read_tokens} | (
                {"cache_write_tokens": self.cache_write_tokens} if self.cache_write_tokens else {})
        if self.reasoning_tokens:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out

    @staticmethod
    def of(prompt_tokens: object, completion_tokens: object) -> Usage | None:
        """Counts reported by an upstream, or ``None`` unless both are plausible: non-negative ints (not
        bools) up to 2^53 - 1. An upstream's absurd count must not overflow the cost arithmetic (float) or
        the ledger; it is treated like a missing report."""
        p, c = prompt_tokens, completion_tokens
        if _count(p) and _count(c):
            return Usage(p, c)
        return None

    @staticmethod
    def from_openai(obj: Any) -> Usage | None:
        """Read an OpenAI ``usage`` object; ``None`` for anything that is not one."""
        if not isinstance(obj, Mapping):
            return None
        base = Usage.of(obj.get("prompt_tokens"), obj.get("completion_tokens"))
        pd, cd = obj.get("prompt_tokens_details"), obj.get("completion_tokens_details")
        cached = pd.get("cached_tokens") if isinstance(pd, Mapping) else None
        written = pd.get("cache_write_tokens") if isinstance(pd, Mapping) else None
        reasoning = cd.get("reasoning_tokens") if isinstance(cd, Mapping) else None
        if base is None or not (_count(cached) or _count(written) or _count(reasoning)):
            return base
        read = min(cached, base.prompt_tokens) if _count(cached) else 0
        return Usage(base.prompt_tokens, base.completion_tokens, cache_read_tokens=read,
                     cache_write_tokens=min(written, base.prompt_tokens - read) if _count(written) else 0,
                     reasoning_tokens=min(reasoning, base.completion_tokens) if _count(reasoning) else 0)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53 - 1


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """One call to one candidate: the client's body (already stripped of gateway-only fields), the model name
    the upstream knows, and the request id (for upstream logs)."""

    body: Mapping[str, Any]
    upstream_model: str
    request_id: str


@dataclass(slots=True)
class Completion:
    """A buffered answer in OpenAI ``chat.completion`` form."""

    body: dict[str, Any]
    usage: Usage | None
    receipt_extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Embeddings:
    """An ``POST /embeddings`` answer in OpenAI form (``{"object": "list", "data": [...], ...}``)."""

    body: dict[str, Any]
    usage: Usage | None  # prompt tokens (completion_tokens 0)


@dataclass(frozen=True, slots=True)
class NodeStats:
    """One node of a provider made of several (the mesh's workers), as ``/metrics`` exports it.

    ``latency_ms`` / ``load`` are ``None`` when the node's last poll got no answer; ``sessions`` counts the
    generations this gateway routed through the node (first route or a failover substitute), ``failovers``
    those that failed over away from it."""

    node_id: str
    alive: bool
    latency_ms: float | None
    load: float | None
    active_sessions: int | None
    sessions: int
    failovers: int


class ProviderStream(abc.ABC):
    """An async iterator of OpenAI chunk payloads (``bytes`` of one JSON object each).

    Iteration raises an ``UpstreamError`` on failure. It ends normally only when the upstream ended the
    answer properly; ``completed`` is then true. A usage-only chunk is not yielded: its counts land in
    ``usage`` and the executor decides whether the client asked for it.
    """

    usage: Usage | None = None
    completed: bool = False
    receipt_extra: Mapping[str, Any] = {}

    def __aiter__(self) -> ProviderStream:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> bytes: ...

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the upstream connection (idempotent)."""


class Provider(abc.ABC):
    """A provider the gateway can call. One instance per configured provider, shared by all requests."""

    #: the provider id from config (``Candidate.provider``)
    name: str

    @abc.abstractmethod
    async def complete(self, call: UpstreamCall) -> Completion:
        """Run a buffered completion."""

    @abc.abstractmethod
    async def stream(self, call: UpstreamCall) -> ProviderStream:
        """Start a streaming completion. Returns once the upstream accepted the call (status known); the
        first chunk is read by iterating."""

    async def probe(self, upstream_model: str, request_id: str) -> None:
        """A cheap liveness check of one model, for circuit recovery (``ethen.gateway.circuit``): a chat
        completion of at most 1 token (as LiteLLM's health checks send). Returns when the upstream answered;
        raises an ``UpstreamError`` otherwise. A provider with a cheaper check may override it."""
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        await self.complete(UpstreamCall(body, upstream_model, request_id))

    #: whether :meth:`embed` is implemented (a ``[[routes]]`` entry with ``endpoint = "embeddings"`` needs it)
    supports_embeddings: bool = False

    async def embed(self, call: UpstreamCall) -> Embeddings:
        """Embed ``call.body`` (an OpenAI ``CreateEmbeddingRequest``) with ``call.upstream_model``. Only
        providers with ``supports_embeddings`` implement it; the config refuses an embeddings route on any
        other provider at start, so this is reached only by a caller that skipped that check."""
        raise GatewayConfigError(f"provider {self.name!r} offers no embeddings")

    def health(self) -> tuple[str, ...]:
        """Why this provider cannot serve right now (one sentence per problem; empty: nothing known to be
        wrong). ``/healthz`` calls it on every probe, so it must read state only (no I/O). HTTP providers
        report nothing (their failures show in the circuits); the mesh reports layers no live worker
        covers."""
        return ()

    def capacity(self) -> ProviderCapacity | None:
        """Issue 44: what a new request would wait for before its first token here (read state only, no
        I/O: called once per routing decision); ``None``: nothing known (no queue assumed)."""
        return None

    def node_stats(self) -> tuple[NodeStats, ...]:
        """Per-node state for ``/metrics`` (read at scrape time; no I/O). Empty for single-endpoint
        providers; the mesh returns one entry per worker."""
        return ()

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op for HTTP providers
        """Acquire what the provider needs before serving (the gateway's lifespan start-up calls it)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process providers
        """Close pooled connections at shutdown."""


__all__ = [
    "Completion",
    "Embeddings",
    "NodeStats",
    "Provider",
    "ProviderStream",
    "Timeouts",
    "UpstreamCall",
    "Usage",
]
