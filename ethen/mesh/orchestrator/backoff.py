"""Exponential back-off for nodes that just failed (pure: ``now`` is an argument).

After the n-th consecutive failure a node is not routed to for ``base_s * factor**(n-1)`` seconds, capped at
``max_s`` (defaults: 1 s, x2, 30 s). A successful call resets its count. The spec is silent on the numbers;
these keep a flapping node out for longer each time while letting a restarted one back within a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass(slots=True)
class Backoff:
    base_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    _failures: dict[str, int] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.factor < 1 or self.max_s < self.base_s:
            raise ValueError(f"need base_s > 0, factor >= 1, max_s >= base_s; got {self.base_s}, "
                             f"{self.factor}, {self.max_s}")

    def record_failure(self, node_id: str, now: float) -> float:
        """Count one failure; returns the time until which the node is blocked."""
        n = self._failures.get(node_id, 0) + 1
        self._failures[node_id] = n
        until = now + min(self.max_s, self.base_s * self.factor ** (n - 1))
        self._until[node_id] = until
        return until

    def record_success(self, node_id: str) -> None:
        self._failures.pop(node_id, None)
        self._until.pop(node_id, None)

    def blocked(self, node_id: str, now: float) -> bool:
        return now < self._until.get(node_id, float("-inf"))

    def failures(self, node_id: str) -> int:
        return self._failures.get(node_id, 0)
