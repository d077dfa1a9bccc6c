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

Session slots (:func:`slot_wait_ms`): a worker holds at most
:data:`~ethen.mesh.worker.limits.MAX_SESSIONS_PER_CALLER` (64) sessions of this orchestrator; a request
beyond them is refused (``RESOURCE_EXHAUSTED``, then ``mesh_saturated`` or a fallback). Measured on
``bench/spillover.py`` at 5x the mesh's capacity: TTFT stays low (prefills go first) while the sessions pile
up to that cap. So a request that would be session ``max_sessions + k`` waits for ``ceil(k /
max_sessions)`` generations to end, each the measured decode time of a generation (EWMA, first token to
end).

Bounded queue (issue 44 item 3, the mesh provider's ``max_queue``): at most that many generations of this
orchestrator wait for their first token; one more is refused at once (:meth:`LoadBook.try_begin`, the
decision :func:`queue_admits`), with a ``Retry-After`` of the queue's predicted wait
(:func:`queue_retry_after_s`), instead of waiting up to ``admission_timeout_s`` for worker slots. ``None``
(the default): no bound.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ethen.mesh.worker.limits import MAX_DECODE_BATCH, MAX_SESSIONS_PER_CALLER, PREFILL_CHUNK_TOKENS

__all__ = ["DEFAULT_PREFILL_MS_PER_TOKEN", "DEFAULT_STEP_MS", "HISTORY_S", "LoadBook", "LoadSample",
           "MeshLoad", "predicted_wait_ms", "prefill_ms_per_token_of", "queue_admits", "queue_retry_after_s",
           "slot_wait_ms"]

DEFAULT_PREFILL_MS_PER_TOKEN = 1.0
DEFAULT_STEP_MS = 30.0
_MIN_PREFILL_MS_PER_TOKEN = 0.01
HISTORY_S = 600.0  # the load book keeps a sample per second (when something happens) for this long
_MAX_RETRY_AFTER_S = 60


def _turn_ms(decoding: int, step_ms: float, batch_limit: int) -> float:
    return math.ceil(max(0, decoding) / max(1, batch_limit)) * step_ms


def predicted_wait_ms(queued_tokens: int, own_tokens: int, decoding: int, step_ms: float,
                      prefill_ms_per_token: float, batch_limit: int = MAX_DECODE_BATCH) -> float:
    """Arrival to first token of a request of ``own_tokens`` prompt tokens (module docstring)."""
    tokens = max(0, queued_tokens) + max(0, own_tokens)
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    return tokens * prefill_ms_per_token + chunks * _turn_ms(decoding, step_ms, batch_limit)


def slot_wait_ms(sessions: int, max_sessions: int, generation_ms: float) -> float:
    """The wait for a session slot of a new request when ``sessions`` are in flight (module docstring)."""
    over = sessions + 1 - max(1, max_sessions)
    return math.ceil(over / max(1, max_sessions)) * generation_ms if over > 0 else 0.0


def queue_admits(waiting: int, max_queue: int | None) -> bool:
    """Whether a new generation may join ``waiting`` ones that wait for their first token (``None``: no
    bound)."""
    return max_queue is None or max(0, waiting) < max_queue


def queue_retry_after_s(queue_ms: float) -> int:
    """Whole seconds until a request refused by a full queue may be taken: the queue's predicted wait
    (``queue_ms``, :meth:`MeshLoad.linear`), at least 1, at most 60."""
    return int(min(_MAX_RETRY_AFTER_S, max(1, math.ceil(max(0.0, queue_ms) / 1000.0))))


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
    max_sessions: int = MAX_SESSIONS_PER_CALLER
    generation_ms: float = 0.0  # measured decode time of a generation (first token to end)

    @property
    def sessions(self) -> int:
        return self.prefilling + self.decoding

    def wait_ms(self, own_tokens: int) -> float:
        return predicted_wait_ms(self.queued_tokens, own_tokens, self.decoding, self.step_ms,
                                 self.prefill_ms_per_token, self.batch_limit) + self.slot_ms

    @property
    def ms_per_output_token(self) -> float:
        """The decode pace of one more session: ``ceil((decoding + 1) / batch_limit)`` steps per token."""
        return _turn_ms(self.decoding + 1, self.step_ms, self.batch_limit)

    @property
    def slot_ms(self) -> float:
        return slot_wait_ms(self.sessions, self.max_sessions, self.generation_ms)

    def linear(self) -> tuple[float, float]:
        """``(queue_ms, ms_per_own_token)`` with ``wait_ms(own) <= queue_ms + own x ms_per_own_token``, at
        most two decode turns above it: the own prompt's chunks charged per token, plus one turn for the
        chunk it starts; the slot wait (:func:`slot_wait_ms`) is in ``queue_ms``."""
        turn = _turn_ms(self.decoding, self.step_ms, self.batch_limit)
        queue = self.queued_tokens * self.prefill_ms_per_token + (
            (math.ceil(self.queued_tokens / PREFILL_CHUNK_TOKENS) + 1) * turn
        ) + self.slot_ms
        return queue, self.prefill_ms_per_token + turn / PREFILL_CHUNK_TOKENS


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The load at wall time ``at`` (the dashboard's Mesh tab): sessions, queued prefill tokens, the
    predicted wait before a new request's own prefill (``queue_ms``), generations started so far."""

    at: float
    prefilling: int
    decoding: int
    queued_tokens: int
    queue_ms: float
    started: int


class LoadBook:
    """The generations of one orchestrator and the measurements (module docstring), and a history of
    :class:`LoadSample` (at most one a second, when a generation starts, gets its first token or ends; the
    last :data:`HISTORY_S`). Thread-safe."""

    def __init__(self, alpha: float = 0.2, batch_limit: int = MAX_DECODE_BATCH,
                 clock: Callable[[], float] = time.time, max_sessions: int = MAX_SESSIONS_PER_CALLER) -> None:
        self.alpha = alpha
        self.max_sessions = max_sessions
        self.batch_limit = batch_limit
        self.clock = clock
        self.started = 0
        self._history: deque[LoadSample] = deque()
        self._lock = threading.Lock()
        self._prefilling: dict[object, tuple[int, int, int]] = {}  # ticket -> (own, queued ahead, decoding)
        self._decoding: dict[object, float] = {}  # ticket -> wall time of its first token
        self.generation_ms: float | None = None
        self._queued = 0
        self.step_ms: float | None = None
        self.prefill_ms_per_token: float | None = None

    def begin(self, prompt_tokens: int) -> object:
        """A generation arrived with ``prompt_tokens``; returns its ticket."""
        ticket = self.try_begin(prompt_tokens, None)
        assert ticket is not None
        return ticket

    def try_begin(self, prompt_tokens: int, max_queue: int | None) -> object | None:
        """:meth:`begin` unless ``max_queue`` generations already wait for their first token
        (:func:`queue_admits`): then ``None``, and nothing is counted (one check, under the lock)."""
        with self._lock:
            if not queue_admits(len(self._prefilling), max_queue):
                return None
            ticket = object()
            self._prefilling[ticket] = (prompt_tokens, self._queued, len(self._decoding))
            self._queued += prompt_tokens
            self.started += 1
            self._sample()
        return ticket

    def first_token(self, ticket: object, first_token_ms: float) -> None:
        with self._lock:
            entry = self._prefilling.pop(ticket, None)
            if entry is None:
                return
            own, ahead, decoding = entry
            self._queued -= own
            self._decoding[ticket] = self.clock()
            obs = prefill_ms_per_token_of(first_token_ms, ahead, own, decoding, self._step(),
                                          self.batch_limit)
            self.prefill_ms_per_token = self._ewma(self.prefill_ms_per_token, obs)
            self._sample()

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
            first = self._decoding.pop(ticket, None)
            if first is not None:
                self.generation_ms = self._ewma(self.generation_ms, (self.clock() - first) * 1000.0)
            self._sample()

    def snapshot(self) -> MeshLoad:
        with self._lock:
            return self._load()

    def history(self) -> list[LoadSample]:
        with self._lock:
            return list(self._history)

    def _load(self) -> MeshLoad:
        return MeshLoad(len(self._prefilling), len(self._decoding), self._queued, self._step(),
                        self.prefill_ms_per_token or DEFAULT_PREFILL_MS_PER_TOKEN, self.batch_limit,
                        self.max_sessions, self.generation_ms or 0.0)

    def _sample(self) -> None:
        now = self.clock()
        h = self._history
        load = self._load()
        sample = LoadSample(now, load.prefilling, load.decoding, load.queued_tokens, load.linear()[0],
                            self.started)
        if h and math.floor(now) == math.floor(h[-1].at):
            h[-1] = sample  # the latest state of this wall-clock second
        else:
            h.append(sample)
        while h and now - h[0].at > HISTORY_S:
            h.popleft()

    def _step(self) -> float:
        return DEFAULT_STEP_MS if self.step_ms is None else self.step_ms

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
