"""The mesh's wait model (issue 44), pure: what a new request waits on a chain before its first token, the
session slots, the queue bound per chain. The model and its measurements: :mod:`ethen.mesh.orchestrator.load`
(its docstring), whose :class:`~ethen.mesh.orchestrator.load.LoadBook` feeds these functions its counts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ethen.mesh.orchestrator.admission import GATE_SLOTS
from ethen.mesh.worker.limits import MAX_DECODE_BATCH, MAX_SESSIONS_PER_CALLER, PREFILL_CHUNK_TOKENS

__all__ = ["DEFAULT_PREFILL_MS_PER_TOKEN", "DEFAULT_STEP_MS", "Chain", "ChainCounts", "MeshLoad",
           "chain_counts", "chain_slot_wait_ms", "pick_chain", "predicted_wait_ms", "prefill_ms_per_token_of",
           "queue_admits", "queue_retry_after_s", "session_cap", "shared_prefill_tokens", "slot_wait_ms"]

Chain = tuple[str, ...]
DEFAULT_PREFILL_MS_PER_TOKEN = 1.0
DEFAULT_STEP_MS = 30.0
_MIN_PREFILL_MS_PER_TOKEN = 0.01
_MAX_RETRY_AFTER_S = 60


def _turn_ms(decoding: int, step_ms: float) -> float:
    """What the decoding sessions cost a prefill per chunk: one batched step when any decodes."""
    return step_ms if decoding > 0 else 0.0


def _turns(chunks: int) -> float:
    """Decode turns a prefill of ``chunks`` chunks crosses: one per chunk, but half for the first (a request
    arrives on average halfway through the batched step in progress: the rest of it, half a step)."""
    return chunks - 0.5 if chunks > 0 else 0.0


def _round_ms(decoding: int, step_ms: float, batch_limit: int) -> float:
    """One token of every decoding session: ``ceil(decoding / batch_limit)`` batched steps."""
    return math.ceil(max(0, decoding) / max(1, batch_limit)) * step_ms


def shared_prefill_tokens(ahead: Sequence[int], own_tokens: int, slots: int = GATE_SLOTS) -> int:
    """Token-times until a prefill of ``own_tokens`` ends behind the prefills of ``ahead`` (their prompt
    tokens, in arrival order): at most ``slots`` are computed at once, sharing the worker equally (its round
    robin of slices), the others wait for a slot in arrival order (the orchestrator's
    :class:`~ethen.mesh.orchestrator.admission.NodeGate`). One slot: first come, first served,
    ``sum(ahead) + own``."""
    left = [max(0, a) for a in ahead] + [max(0, own_tokens)]
    me = len(left) - 1
    width = max(1, slots)
    active, nxt, t = list(range(min(width, len(left)))), min(width, len(left)), 0
    while True:
        m = min(left[j] for j in active)
        t += m * len(active)  # each active one gets 1 / len(active) of the worker until the least ends
        for j in active:
            left[j] -= m
        if left[me] == 0 and me in active:
            return t
        active = [j for j in active if left[j] > 0]
        while len(active) < width and nxt < len(left):
            active.append(nxt)
            nxt += 1


def _activation(ahead: Sequence[int], slots: int) -> tuple[int, int]:
    """``(T0, k)``: token-times until a new prefill gets a slot behind ``ahead``
    (:func:`shared_prefill_tokens`) and the prefills computed with it then, itself included. Only those
    share the worker with it until it ends (every one ahead has its slot by then), so
    ``shared_prefill_tokens(ahead, own) <= T0 + k x own``."""
    left = [a for a in ahead if a > 0]  # an empty prompt takes no time
    width = max(1, slots)
    active: list[int] = []
    nxt, t = 0, 0
    while True:
        while len(active) < width and nxt < len(left):
            active.append(nxt)
            nxt += 1
        if nxt == len(left) and len(active) < width:
            return t, len(active) + 1
        m = min(left[j] for j in active)
        t += m * len(active)
        for j in active:
            left[j] -= m
        active = [j for j in active if left[j] > 0]


def _wait_of(tokens: int, decoding: int, step_ms: float, prefill_ms_per_token: float) -> float:
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    return tokens * prefill_ms_per_token + _turns(chunks) * _turn_ms(decoding, step_ms)


def predicted_wait_ms(queued_tokens: int | Sequence[int], own_tokens: int, decoding: int, step_ms: float,
                      prefill_ms_per_token: float, slots: int = GATE_SLOTS) -> float:
    """Arrival to first token of a request of ``own_tokens`` prompt tokens (module docstring of
    :mod:`~ethen.mesh.orchestrator.load`): behind ``queued_tokens``, the prompts waiting (arrival order:
    :func:`shared_prefill_tokens` with ``slots``) or their sum (first come, first served)."""
    if isinstance(queued_tokens, int):
        tokens = max(0, queued_tokens) + max(0, own_tokens)
    else:
        tokens = shared_prefill_tokens(queued_tokens, own_tokens, slots)
    return _wait_of(tokens, decoding, step_ms, prefill_ms_per_token)


def session_cap(max_sessions: int, max_per_caller: int) -> int:
    """The sessions a worker holds for one orchestrator at most, from its ``Health``: the smaller of its
    ``max_sessions`` and ``max_sessions_per_caller`` that it reports (> 0); neither:
    :data:`~ethen.mesh.worker.limits.MAX_SESSIONS_PER_CALLER` (a worker older than the fields)."""
    known = [c for c in (max_sessions, max_per_caller) if c > 0]
    return min(known) if known else MAX_SESSIONS_PER_CALLER


def slot_wait_ms(sessions: int, max_sessions: int, generation_ms: float) -> float:
    """The wait for a session slot of a new request when ``sessions`` are in flight
    (:mod:`~ethen.mesh.orchestrator.load`)."""
    over = sessions + 1 - max(1, max_sessions)
    return math.ceil(over / max(1, max_sessions)) * generation_ms if over > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ChainCounts:
    """A chain's own generations (``waiting`` for a first token, ``decoding``) and, over its workers, the
    largest per-worker totals of every chain through them: ``queued_tokens``, ``busy_decoding``,
    ``sessions`` (the worker whose sessions are nearest its cap: ``slot_ms`` is its slot wait)."""

    waiting: int = 0
    decoding: int = 0
    queued_tokens: int = 0
    busy_decoding: int = 0
    sessions: int = 0
    max_sessions: int = MAX_SESSIONS_PER_CALLER
    slot_ms: float = 0.0


def chain_slot_wait_ms(chain: Chain, sessions: Mapping[Chain, int], caps: Mapping[str, int],
                       generation_ms: float, default_cap: int = MAX_SESSIONS_PER_CALLER) -> float:
    """The slot wait of a new request on ``chain``: the largest over its workers of :func:`slot_wait_ms` of
    the sessions of every chain through that worker (one per stage on it) against the worker's cap
    (``caps``, ``default_cap`` when unknown). The ``()`` chain (no route known) counts its own sessions
    against ``default_cap``."""
    return chain_counts(chain, {c: (0, n, 0) for c, n in sessions.items()}, caps, generation_ms,
                        default_cap).slot_ms


def chain_counts(chain: Chain, counts: Mapping[Chain, tuple[int, int, int]], caps: Mapping[str, int],
                 generation_ms: float, default_cap: int = MAX_SESSIONS_PER_CALLER) -> ChainCounts:
    """:class:`ChainCounts` of ``chain`` from every chain's ``(waiting, decoding, queued_tokens)`` and the
    workers' session ``caps`` (``default_cap`` for a worker not in it)."""
    own = counts.get(chain, (0, 0, 0))
    if not chain:
        sessions = own[0] + own[1]
        return ChainCounts(own[0], own[1], own[2], own[1], sessions, default_cap,
                           slot_wait_ms(sessions, default_cap, generation_ms))
    per: dict[str, list[int]] = {}
    for other, (waiting, decoding, queued) in counts.items():
        for node in other:
            acc = per.setdefault(node, [0, 0, 0])
            acc[0] += waiting + decoding
            acc[1] += decoding
            acc[2] += queued
    worst, worst_node = -1.0, chain[0]
    for node in chain:
        slot = slot_wait_ms(per.get(node, [0])[0], caps.get(node, default_cap), generation_ms)
        if slot > worst:
            worst, worst_node = slot, node
    at = per.get(worst_node, [0, 0, 0])
    return ChainCounts(own[0], own[1], max(per.get(n, [0, 0, 0])[2] for n in chain),
                       max(per.get(n, [0, 0, 0])[1] for n in chain), at[0],
                       caps.get(worst_node, default_cap), max(0.0, worst))


def queue_admits(waiting: int, max_queue: int | None) -> bool:
    """Whether a new generation may join ``waiting`` ones that wait for their first token (``None``: no
    bound)."""
    return max_queue is None or max(0, waiting) < max_queue


def pick_chain(chains: Sequence[Chain], waiting: Mapping[Chain, int], max_queue: int | None) -> int | None:
    """Index of the first of ``chains`` (the route candidates, preferred first) whose queue has room
    (:func:`queue_admits` of its ``waiting``), or ``None`` when every one is full (or none is offered)."""
    for i, chain in enumerate(chains):
        if queue_admits(waiting.get(chain, 0), max_queue):
            return i
    return None


def queue_retry_after_s(queue_ms: float) -> int:
    """Whole seconds until a request refused by a full queue may be taken: the queue's predicted wait
    (``queue_ms``, :meth:`MeshLoad.linear`), at least 1, at most 60."""
    return int(min(_MAX_RETRY_AFTER_S, max(1, math.ceil(max(0.0, queue_ms) / 1000.0))))


def prefill_ms_per_token_of(first_token_ms: float, queued_tokens: int | Sequence[int], own_tokens: int,
                            decoding: int, step_ms: float, slots: int = GATE_SLOTS) -> float:
    """The prefill cost per token that makes :func:`predicted_wait_ms` equal an observed first token (the
    queue and decoding sessions as they were when the request arrived); at least 0.01 ms."""
    if isinstance(queued_tokens, int):
        tokens = max(1, max(0, queued_tokens) + max(0, own_tokens))
    else:
        tokens = max(1, shared_prefill_tokens(queued_tokens, own_tokens, slots))
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    rest = first_token_ms - _turns(chunks) * _turn_ms(decoding, step_ms)
    return max(_MIN_PREFILL_MS_PER_TOKEN, rest / tokens)


@dataclass(frozen=True, slots=True)
class MeshLoad:
    """A chain's load now: its sessions in flight (``prefilling`` + ``decoding``), the prompt tokens queued
    and the sessions decoding on its busiest worker (``queued_tokens``, ``busy``: every chain through it),
    the measured step and prefill cost, the batch limit, the slot wait (``slot_wait``; ``None``: from
    ``sessions`` against ``max_sessions``)."""

    prefilling: int
    decoding: int
    queued_tokens: int
    step_ms: float
    prefill_ms_per_token: float
    batch_limit: int = MAX_DECODE_BATCH
    max_sessions: int = MAX_SESSIONS_PER_CALLER
    generation_ms: float = 0.0  # measured decode time of a generation (first token to end)
    chain: Chain = ()
    busy: int | None = None  # sessions decoding on the chain's busiest worker (None: ``decoding``)
    slot_wait: float | None = None
    ahead: tuple[int, ...] | None = None  # the prompts waiting on its workers, arrival order (None: FIFO)
    slots: int = GATE_SLOTS

    @property
    def sessions(self) -> int:
        return self.prefilling + self.decoding

    @property
    def busy_decoding(self) -> int:
        return self.decoding if self.busy is None else self.busy

    def wait_ms(self, own_tokens: int) -> float:
        queued = self.queued_tokens if self.ahead is None else self.ahead
        return predicted_wait_ms(queued, own_tokens, self.busy_decoding, self.step_ms,
                                 self.prefill_ms_per_token, self.slots) + self.slot_ms

    @property
    def ms_per_output_token(self) -> float:
        """The decode pace of one more session: ``ceil((decoding + 1) / batch_limit)`` steps per token."""
        return _round_ms(self.busy_decoding + 1, self.step_ms, self.batch_limit)

    @property
    def slot_ms(self) -> float:
        if self.slot_wait is not None:
            return self.slot_wait
        return slot_wait_ms(self.sessions, self.max_sessions, self.generation_ms)

    def linear(self) -> tuple[float, float]:
        """``(queue_ms, ms_per_own_token)`` with ``wait_ms(own) <= queue_ms + own x ms_per_own_token``: the
        token-times until the request gets a slot (``T0``) and, from then, ``k`` prefills sharing the worker
        (itself included: ``T(own) <= T0 + k x own``; first come, first served: ``T0`` the queue, ``k`` 1),
        the own prompt's chunks charged per token plus one turn for the chunk it starts; the slot wait
        (:func:`slot_wait_ms`) is in ``queue_ms``."""
        turn = _turn_ms(self.busy_decoding, self.step_ms)
        t0, k = (self.queued_tokens, 1) if self.ahead is None else _activation(self.ahead, self.slots)
        chunks = math.ceil(t0 / PREFILL_CHUNK_TOKENS) + 1
        queue = t0 * self.prefill_ms_per_token + _turns(chunks) * turn + self.slot_ms
        return queue, k * (self.prefill_ms_per_token + turn / PREFILL_CHUNK_TOKENS)
