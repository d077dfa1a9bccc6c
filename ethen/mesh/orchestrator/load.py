"""What a new request would wait for on this mesh before its first token (issue 44): the capacity signal the
gateway's router reads (:mod:`ethen.gateway.routing.capacity`).

:class:`LoadBook` (the shell, thread-safe) counts the generations of this orchestrator: those waiting for
their first token with their prompt tokens (the prefill queue), those decoding, and two measurements kept as
EWMAs: the decode step time (the time between two tokens of one session) and the prefill cost per token
(calibrated from each first token: :func:`prefill_ms_per_token_of`).

Model (:func:`predicted_wait_ms`), for a request of ``own`` prompt tokens arriving now: the prefills already
queued and its own run before its first token (``(queued + own) x prefill_ms_per_token``), and for every
chunk of :data:`~ethen.mesh.worker.limits.PREFILL_CHUNK_TOKENS` of them the worker gives the decoding sessions
a turn: ``ceil(decoding / batch_limit)`` batched steps of ``step_ms`` (a worker batches at most
:data:`~ethen.mesh.worker.limits.MAX_DECODE_BATCH` decode steps into one). This is a FIFO bound (a worker
computes the prefills round robin, so a short prompt behind long ones finishes earlier) and linear in
``own`` as the router wants it: :meth:`MeshLoad.linear` gives ``(queue_ms, ms_per_own_token)`` (a bound).
Before any measurement the prefill cost is :data:`DEFAULT_PREFILL_MS_PER_TOKEN` and the step
:data:`DEFAULT_STEP_MS` (SmolLM2-135M on three CPU workers, ``ethen up``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from ethen.mesh.worker.limits import MAX_DECODE_BATCH, PREFILL_CHUNK_TOKENS

__all__ = ["DEFAULT_PREFILL_MS_PER_TOKEN", "DEFAULT_STEP_MS", "LoadBook", "MeshLoad", "predicted_wait_ms",
           "prefill_ms_per_token_of"]

DEFAULT_PREFILL_MS_PER_TOKEN = 1.0
DEFAULT_STEP_MS = 30.0
_MIN_PREFILL_MS_PER_TOKEN = 0.01


def _turn_ms(decoding: int, step_ms: float, batch_limit: int) -> float:
    return math.ceil(max(0, decoding) / max(1, batch_limit)) * step_ms


def predicted_wait_ms(queued_tokens: int, own_tokens: int, decoding: int, step_ms: float,
                      prefill_ms_per_token: float, batch_limit: int = MAX_DECODE_BATCH) -> float:
    """Arrival to first token of a request of ``own_tokens`` prompt tokens (module docstring)."""
    tokens = max(0, queued_tokens) + max(0, own_tokens)
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    return tokens * prefill_ms_per_token + chunks * _turn_ms(decoding, step_ms, batch_limit)


def prefill_ms_per_token_of(first_token_ms: float, queued_tokens: int, own_tokens: int, decoding: int,
                            step_ms: float, batch_limit: int = MAX_DECODE_BATCH) -> float:
    """The prefill cost per token that makes :func:`predicted_wait_ms` equal an observed first token (the
    queue and decoding sessions as they were when the request arrived); at least 0.01 ms."""
    tokens = max(1, max(0, queued_tokens) + max(0, own_tokens))
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    rest = first_token_ms - chunks * _turn_ms(decoding, step_ms, batch_limit)
    return max(_MIN_PREFILL_MS_PER_TOKEN, rest / tokens)


@dataclass(frozen=True, slots=True)
class MeshLoad:
    """The mesh's load now: sessions in flight (``prefilling`` + ``decoding``), the prompt tokens of the
    ``prefilling`` ones (``queued_tokens``), the measured step and prefill cost, the batch limit."""

    prefilling: int
    decoding: int
    queued_tokens: int
    step_ms: float
    prefill_ms_per_token: float
    batch_limit: int = MAX_DECODE_BATCH

    @property
    def sessions(self) -> int:
        return self.prefilling + self.decoding

    def wait_ms(self, own_tokens: int) -> float:
        return predicted_wait_ms(self.queued_tokens, own_tokens, self.decoding, self.step_ms,
                                 self.prefill_ms_per_token, self.batch_limit)

    def linear(self) -> tuple[float, float]:
        """``(queue_ms, ms_per_own_token)`` with ``wait_ms(own) <= queue_ms + own x ms_per_own_token``, at
        most two decode turns above it: the own prompt's chunks charged per token, plus one turn for the
        chunk it starts."""
        turn = _turn_ms(self.decoding, self.step_ms, self.batch_limit)
        queue = self.queued_tokens * self.prefill_ms_per_token + (
            (math.ceil(self.queued_tokens / PREFILL_CHUNK_TOKENS) + 1) * turn
        )
        return queue, self.prefill_ms_per_token + turn / PREFILL_CHUNK_TOKENS


class LoadBook:
    """The generations of one orchestrator and the measurements (module docstring). Thread-safe."""

    def __init__(self, alpha: float = 0.2, batch_limit: int = MAX_DECODE_BATCH) -> None:
        self.alpha = alpha
        self.batch_limit = batch_limit
        self._lock = threading.Lock()
        self._prefilling: dict[object, tuple[int, int, int]] = {}  # ticket -> (own, queued ahead, decoding)
        self._decoding: set[object] = set()
        self._queued = 0
        self.step_ms: float | None = None
        self.prefill_ms_per_token: float | None = None

    def begin(self, prompt_tokens: int) -> object:
        """A generation arrived with ``prompt_tokens``; returns its ticket."""
        ticket = object()
        with self._lock:
            self._prefilling[ticket] = (prompt_tokens, self._queued, len(self._decoding))
            self._queued += prompt_tokens
        return ticket

    def first_token(self, ticket: object, first_token_ms: float) -> None:
        with self._lock:
            entry = self._prefilling.pop(ticket, None)
            if entry is None:
                return
            own, ahead, decoding = entry
            self._queued -= own
            self._decoding.add(ticket)
            obs = prefill_ms_per_token_of(first_token_ms, ahead, own, decoding, self._step(),
                                          self.batch_limit)
            self.prefill_ms_per_token = self._ewma(self.prefill_ms_per_token, obs)

    def step(self, token_to_token_ms: float) -> None:
        """A session got its next token ``token_to_token_ms`` after the previous one: with D sessions
        decoding, that is ``ceil(D / batch_limit)`` batched steps, so one step took that share of it."""
        with self._lock:
            steps = max(1, math.ceil(len(self._decoding) / max(1, self.batch_limit)))
            self.step_ms = self._ewma(self.step_ms, token_to_token_ms / steps)

    def end(self, ticket: object) -> None:
        with self._lock:
            entry = self._prefilling.pop(ticket, None)
            if entry is not None:
                self._queued -= entry[0]
            self._decoding.discard(ticket)

    def snapshot(self) -> MeshLoad:
        with self._lock:
            return MeshLoad(len(self._prefilling), len(self._decoding), self._queued, self._step(),
                            self.prefill_ms_per_token or DEFAULT_PREFILL_MS_PER_TOKEN, self.batch_limit)

    def _step(self) -> float:
        return DEFAULT_STEP_MS if self.step_ms is None else self.step_ms

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
