"""Gateway smart-routing core: requirements -> policy -> filter -> score -> canary -> receipt.

Pure and deterministic: no I/O, no clock, no randomness. ``now``, the request id and the telemetry snapshot
are inputs (:class:`RoutingContext`). Entry point: :func:`decide`.
"""

from .canary import CanaryEvaluation, bucket
from .candidates import (
    CANARY_PERCENTS,
    CanaryTarget,
    Candidate,
    LiveCertification,
    ModelInfo,
    Prices,
    ProjectPolicy,
)
from .capacity import (
    EMPTY_CAPACITY,
    CapacitySnapshot,
    ProviderCapacity,
    Spillover,
    WaitTarget,
    predicted_wait_ms,
)
from .circuits import DEFAULT_RETRY_AFTER_S, EMPTY_CIRCUITS, CircuitView, circuit_keys
from .decide import Decision, RoutingContext, decide, resolve_pool
from .filter import Rejection, estimate_cost_usd
from .policy import ALIASES, COMPONENTS, LATENCY_TARGETS, POLICY_VERSION, AliasProfile, HardGates
from .prefix import PrefixMemory, cache_ttl_s, prefix_hashes
from .reasons import REJECTION_REASONS, SELECTION_REASONS
from .receipt import Receipt
from .requirements import Requirements, parse_requirements
from .score import ScoreComponents, ScoredCandidate
from .telemetry import RECENT_MAX_OUTCOMES, RECENT_WINDOW_SECONDS, CandidateStats, TelemetrySnapshot

__all__ = [
    "ALIASES",
    "CANARY_PERCENTS",
    "COMPONENTS",
    "DEFAULT_RETRY_AFTER_S",
    "EMPTY_CAPACITY",
    "EMPTY_CIRCUITS",
    "LATENCY_TARGETS",
    "POLICY_VERSION",
    "RECENT_MAX_OUTCOMES",
    "RECENT_WINDOW_SECONDS",
    "REJECTION_REASONS",
    "SELECTION_REASONS",
    "AliasProfile",
    "CanaryEvaluation",
    "CanaryTarget",
    "Candidate",
    "CandidateStats",
    "CapacitySnapshot",
    "CircuitView",
    "Decision",
    "HardGates",
    "LiveCertification",
    "ModelInfo",
    "PrefixMemory",
    "Prices",
    "ProjectPolicy",
    "ProviderCapacity",
    "Receipt",
    "Rejection",
    "Requirements",
    "RoutingContext",
    "ScoreComponents",
    "ScoredCandidate",
    "Spillover",
    "TelemetrySnapshot",
    "WaitTarget",
    "bucket",
    "cache_ttl_s",
    "circuit_keys",
    "decide",
    "estimate_cost_usd",
    "parse_requirements",
    "predicted_wait_ms",
    "prefix_hashes",
    "resolve_pool",
]
