"""What a worker needs from the model: run whole fragments for one session, or for a batch of sessions.

:class:`FragmentBackend` is the seam between the gRPC shell and the NumPy model; :class:`ModelBackend`
implements it with :mod:`ethen.model` (one :class:`~ethen.model.model.LayerStack` per served fragment, loaded
alone: the worker maps only its own layers' weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ethen.model.kv_cache import KVCache
from ethen.model.model import LayerStack, load_layer_stacks

__all__ = ["F32", "I64", "FragmentBackend", "ModelBackend"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


class FragmentBackend(Protocol):
    """Runs consecutive served fragments (named by their first layer); one cache per fragment and session."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    def new_cache(self, fragment: int) -> KVCache: ...

    def forward(self, fragments: Sequence[int], hidden: F32, positions: I64,
                caches: Sequence[KVCache]) -> F32:
        """``hidden`` [T, d] at ``positions`` [T] of one session -> [T, d]; appends T positions per cache."""
        ...

    def forward_batch(self, fragments: Sequence[int], hidden: F32, positions: I64,
                      caches: Sequence[Sequence[KVCache]]) -> F32:
        """One decode step of B sessions: ``hidden`` [B, d], ``positions`` [B], ``caches[b][fragment]``."""
        ...


class ModelBackend:
    """:class:`FragmentBackend` over :mod:`ethen.model` layer stacks."""

    def __init__(self, stacks: Sequence[LayerStack]) -> None:
        if not stacks:
            raise ValueError("ModelBackend needs at least one layer stack")
        self.stacks = {s.start: s for s in stacks}
        self.config = stacks[0].config

    @classmethod
    def load(cls, fragments: Sequence[tuple[int, int]]) -> ModelBackend:
        return cls(load_layer_stacks(list(fragments)))

    @property
    def hidden_size(self) -> int:
        return self.config.d_model

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def new_cache(self, fragment: int) -> KVCache:
        return self.stacks[fragment].new_kv_cache()

    def forward(self, fragments: Sequence[int], hidden: F32, positions: I64,
                caches: Sequence[KVCache]) -> F32:
        x = hidden  # [T, d]
        for f, kv in zip(fragments, caches, strict=True):
            x = self.stacks[f].forward(x, positions, kv)  # [T, d]
        return x

    def forward_batch(self, fragments: Sequence[int], hidden: F32, positions: I64,
                      caches: Sequence[Sequence[KVCache]]) -> F32:
        x = hidden  # [B, d]
        for j, f in enumerate(fragments):
            x = self.stacks[f].forward_batch(x, positions, [c[j] for c in caches])  # [B, d]
        return x
