"""What a worker needs from the model: run whole fragments for one session, or for a batch of sessions, or
some layers of one fragment for one session (a prefill computed a slice at a time, issue 23 item 5).

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

    def forward_layer(self, fragment: int, layer: int, hidden: F32, positions: I64, cache: KVCache) -> F32:
        """Layer ``layer`` (0-based within the fragment) of one session's ``hidden`` [T, d] at ``positions``
        [T] (which start at ``cache.length``) -> [T, d]. Running layers 0, 1, .. of a fragment in turn gives
        the same bits as :meth:`forward` over the fragment; the cache holds the T new positions (its
        ``length`` grows) once the fragment's last layer has run."""
        ...


class ModelBackend:
    """:class:`FragmentBackend` over :mod:`ethen.model` layer stacks."""

    def __init__(self, stacks: Sequence[LayerStack]) -> None:
        if not stacks:
            raise ValueError("ModelBackend needs at least one layer stack")
        self.stacks = {s.start: s for s in stacks}
        self.config = stacks[0].config
        self._single: dict[tuple[int, int], LayerStack] = {}  # (fragment, layer) -> that layer alone

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

    def forward_layer(self, fragment: int, layer: int, hidden: F32, positions: I64, cache: KVCache) -> F32:
        stack = self.stacks[fragment]
        one = self._single.get((fragment, layer))
        if one is None:  # the layer's weights (shared, not copied) as a one-layer stack
            one = LayerStack(stack.config, stack.layers[layer : layer + 1])
            one._cos, one._sin = stack._cos, stack._sin  # the same RoPE tables (same config): 2 MB saved
            self._single[(fragment, layer)] = one
        t = hidden.shape[0]
        cache.reserve(t)  # before the view: reserve may reallocate the buffers
        view = KVCache(1, cache.n_kv_heads, cache.head_dim, cache.max_tokens, initial_capacity=1)
        view.k, view.v = cache.k[layer : layer + 1], cache.v[layer : layer + 1]  # [1, Hkv, C, hd] views
        view.length = cache.length
        x = one.forward(hidden, positions, view)  # writes this layer's K/V into ``cache``'s buffers
        if layer == stack.n_layers - 1:
            cache.commit(t)
        return x
