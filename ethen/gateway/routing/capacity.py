"""Live capacity (issue 44): what a new request would wait for before its first token, per provider.

The shell builds a :class:`CapacitySnapshot` per decision from its providers' state (no I/O here): the mesh
from its orchestrator (sessions in flight, queued prefill tokens, measured step time, batch limit:
:mod:`ethen.mesh.orchestrator.load`), an HTTP provider from the rate-limit headers of its last answers and
the gateway's in-flight calls against ``max_connections`` (:mod:`ethen.gateway.providers.ratelimit`).

A provider's :class:`ProviderCapacity` is linear in the request's own prompt: ``queue_ms`` (what the request
waits before its own work starts: the queue ahead of it, a rate-limit block) plus, with
``prefill_ms_per_token`` set, its own prefill (``input_tokens x prefill_ms_per_token``); without it, its own
part is the candidate's blended TTFT (catalog prior and telemetry, :mod:`.telemetry`), as a cloud model's
own TTFT is not known better. So :func:`predicted_wait_ms` is arrival to first token, the thing a user waits
for; a provider absent from the snapshot has no queue (``queue_ms`` 0).

Scoring (:mod:`.score`): the TTFT component uses the predicted wait; the latency component is, with
``ms_per_output_token`` set (the mesh: its decode step at the sessions decoding now), the predicted wait plus
the request's output tokens at that pace, else the blended latency plus the wait beyond the usual TTFT
(``max(0, wait - blended TTFT)``). A wait target (config
``[[wait_targets]]`` per alias, request ``metadata.routing.max_wait_ms`` which only tightens it,
:func:`effective_target`) rejects a candidate whose predicted wait exceeds it
(``predicted_wait_exceeds_target``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

__all__ = [
    "EMPTY_CAPACITY",
    "CapacitySnapshot",
    "ProviderCapacity",
    "Spillover",
    "WaitTarget",
    "effective_target",
    "predicted_wait_ms",
]


@dataclass(frozen=True, slots=True)
class ProviderCapacity:
    """One provider's capacity now (module docstring). ``source`` names what it came from (``mesh``,
    ``rate_limit``, ``connections``, ``idle``), for the explain view."""

    queue_ms: float = 0.0
    prefill_ms_per_token: float | None = None
    source: str = ""
    ms_per_output_token: float | None = None

    def __post_init__(self) -> None:
        if not (self.queue_ms >= 0 and math.isfinite(self.queue_ms)):
            raise ValueError(f"queue_ms must be finite and >= 0, got {self.queue_ms!r}")
        p = self.prefill_ms_per_token
        if p is not None and not (p >= 0 and math.isfinite(p)):
            raise ValueError(f"prefill_ms_per_token must be finite and >= 0, got {p!r}")
        o = self.ms_per_output_token
        if o is not None and not (o >= 0 and math.isfinite(o)):
            raise ValueError(f"ms_per_output_token must be finite and >= 0, got {o!r}")


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    """provider id -> :class:`ProviderCapacity`; a missing provider has no known queue."""

    providers: Mapping[str, ProviderCapacity] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, provider: str) -> ProviderCapacity | None:
        return self.providers.get(provider)


EMPTY_CAPACITY: Final = CapacitySnapshot()


@dataclass(frozen=True, slots=True)
class WaitTarget:
    """One ``[[wait_targets]]`` entry: requests to ``alias`` want their first token within ``max_wait_ms``."""

    alias: str
    max_wait_ms: float


@dataclass(frozen=True, slots=True)
class Spillover:
    """The preferred candidate (the rank 1 without the capacity signal) was passed over for capacity:
    ``reason`` ``predicted_wait_exceeds_target`` (rejected by the wait target) or ``predicted_wait`` (its
    score with the predicted wait ranked it lower). ``from_provider``: its provider id."""

    from_provider: str
    from_candidate: str
    reason: str
    predicted_wait_ms: float
    target_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "from": self.from_provider,
            "reason": self.reason,
            "predicted_wait_ms": round(self.predicted_wait_ms, 1),
            "target_ms": self.target_ms,
        }


def predicted_wait_ms(cap: ProviderCapacity | None, ttft_ms: float, input_tokens: int) -> float:
    """Arrival to first token: the queue plus the request's own prefill (module docstring)."""
    if cap is None:
        return ttft_ms
    own = ttft_ms if cap.prefill_ms_per_token is None else input_tokens * cap.prefill_ms_per_token
    return cap.queue_ms + own


def effective_target(config_ms: float | None, request_ms: float | None) -> float | None:
    """The wait target in force: the request's may only tighten the config's (the smaller of both)."""
    if config_ms is None:
        return request_ms
    if request_ms is None:
        return config_ms
    return min(config_ms, request_ms)
