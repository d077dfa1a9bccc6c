"""Choosing the next token, and turning tokens into streamed text that honours stop strings.

* :class:`SamplingParams` carries the OpenAI-style knobs: ``temperature`` (0 = greedy), ``top_p``, ``seed``,
  ``max_tokens``, ``stop`` (up to 4 strings, as in the OpenAI API). Defaults follow the OpenAI API
  (temperature 1, top_p 1); ``max_tokens`` defaults to 256 because this model's context is small.
* :func:`sample_token` is pure given its ``numpy.random.Generator``: greedy is ``argmax`` (lowest id on
  ties); otherwise softmax(logits / temperature) restricted to the smallest set of most likely tokens whose
  mass reaches ``top_p`` (the token that crosses the threshold is kept), sampled with the generator. The
  same seed gives the same tokens.
* :class:`TextStream` decodes incrementally: it holds back text while the last token ends in an incomplete
  UTF-8 sequence, and holds back any suffix that could still become a stop string, so a stop string is never
  streamed; the returned text ends right before the stop string (OpenAI semantics). Special tokens are not
  shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from ethen.model.errors import ModelInputError
from ethen.model.tokenizer import Tokenizer

__all__ = ["MAX_STOP_STRINGS", "SamplingParams", "TextStream", "make_rng", "sample_token"]

MAX_STOP_STRINGS = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= float(t) <= 2.0:
            raise ModelInputError(f"temperature must be a number in [0, 2], got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < float(p) <= 1.0:
            raise ModelInputError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ModelInputError(f"seed must be a non-negative int or null, got {self.seed!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ModelInputError(f"max_tokens must be a positive int, got {m!r}")
        stop = self.stop
        if isinstance(stop, str):
            object.__setattr__(self, "stop", (stop,))
        elif not isinstance(stop, tuple):
            if not isinstance(stop, Sequence):
                raise ModelInputError(f"stop must be a string or a list of strings, got {stop!r}")
            object.__setattr__(self, "stop", tuple(stop))
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise ModelInputError(
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator a request samples with (seeded when the request gives a seed)."""
    return np.random.default_rng(seed)


def sample_token(logits: NDArray[np.floating], params: SamplingParams, rng: np.random.Generator) -> int:
    """Next token id from ``logits[V]``."""
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ModelInputError(f"logits must have shape [V], got {list(logits.shape)}")
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / float(params.temperature)  # [V]
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()  # [V]
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")  # [V] most likely first
        cum = np.cumsum(probs[order])  # [V]
        keep = int(np.searchsorted(cum, params.top_p)) + 1  # smallest prefix whose mass reaches top_p
        kept = order[:keep]
        p = probs[kept] / probs[kept].sum()
        return int(kept[rng.choice(keep, p=p)])
    return int(rng.choice(probs.shape[0], p=probs))


class TextStream:
    """Incremental detokenizer with stop strings: :meth:`push` each sampled token, get the text to emit."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.text = ""  # final text so far (up to a stop string, once found)
        self.stopped = False  # a stop string was found
        self._clean_ids = 0  # ids[:_clean_ids] decode to _clean_text and end on a character boundary
        self._clean_text = ""

    def _decoded(self) -> str:
        """Text of all ids, decoding only the ids since the last character boundary (linear overall)."""
        tail = self.tokenizer.decode(self.ids[self._clean_ids:], skip_special_tokens=True)
        return self._clean_text + tail

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly safe-to-show text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        full = self._decoded()
        if full.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next byte(s)
            return ""
        self._clean_ids, self._clean_text = len(self.ids), full
        cut = len(full)
        longest = max((len(s) for s in self.stop), default=0)
        search_from = max(0, self.emitted - longest)
        hits = [i for i in (full.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
        else:  # hold back a suffix that may still grow into a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        cut = min(cut, len(full) - k)
                        break
        cut = max(cut, self.emitted)
        delta = full[self.emitted:cut]
        self.emitted = cut
        self.text = full[:cut]
        return delta

    def flush(self) -> str:
        """At the end of generation: the held-back text (not a complete stop string) to emit."""
        if self.stopped:
            return ""
        full = self._decoded()
        delta = full[self.emitted:]
        self.emitted = len(full)
        self.text = full
        return delta
