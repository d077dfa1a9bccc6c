"""What a new request would wait for on this mesh before its first token (issue 44): the capacity signal the
gateway's router reads (:mod:`ethen.gateway.routing.capacity`).

**Chains.** A generation runs on a chain: the ids of its route's workers in pipeline order (``Route.nodes``;
``()`` for a book used without routes). :class:`LoadBook` (the shell, thread-safe) counts the generations of
this orchestrator per chain: those waiting for their first token with their prompt tokens (the chain's
prefill queue) and those decoding, and keeps measurements as EWMAs per chain (the book-wide EWMA stands in
for a chain not measured yet): the decode step time (the time between two tokens of one session, per
batched step) and the prefill cost per token (calibrated from first tokens, below:
:func:`prefill_ms_per_token_of`). A worker serves every chain it is on, so a chain's load is that of its
busiest worker (:func:`chain_counts`): the prefill tokens queued and the sessions decoding on each of its
workers, summed over the chains through that worker, the largest of its workers. A generation stays counted
on the chain it began on (a failover's new route is not re-counted).

**Wait model** (:mod:`~ethen.mesh.orchestrator.wait_model`, pure; :func:`predicted_wait_ms`), for a
request of ``own`` prompt tokens arriving now on a chain, three parts:

- *The prefills waiting* (the prompts of the generations waiting for a first token on the chain's workers,
  in arrival order) and its own: the orchestrator's gate lets 2 prefills into a worker at once (in arrival
  order, :data:`~ethen.mesh.orchestrator.admission.GATE_SLOTS`) and the worker computes their slices round
  robin, so they share it: :func:`shared_prefill_tokens` (processor sharing over 2 slots, first come first
  served beyond) gives the token-times ``T`` until its own prefill ends, ``x prefill_ms_per_token``. (It was
  first come, first served: a short prompt behind one long one was predicted at the long one's time, 2.2 s,
  where it took 0.2 s.)
- *The decoding sessions*: for every chunk of :data:`~ethen.mesh.worker.limits.PREFILL_CHUNK_TOKENS` of
  those ``T`` they get a turn of one batched step (``step_ms``, when anything decodes). One step per chunk,
  not ``ceil(decoding / batch_limit)`` (the earlier model): a worker alternates a prefill's slices with one
  batched decode step of what is queued on it *now*, and a decode round is on one stage of the chain at a
  time, so a prefill crosses about one batched step per chunk whatever the number of sessions. The first
  turn counts half a step: a request arrives on average halfway through the step in progress (a full step
  over-predicted a short prompt among 48 decoding sessions by 1.7-2.1x: CI measured 92 ms against 196).
- *The prefill cost per token* is calibrated from the first tokens of requests that ran alone (nothing
  waiting ahead, nothing decoding); one that arrived while others ran measures mostly them (calibrating from
  it let the model's errors flow into the per-token cost, down to its 0.01 ms floor) and stands in only
  until a clean measurement exists.

Measured on three real workers (SmolLM2-135M, ``tests/mesh/test_wait_tracks_ttft.py``), predicted against
measured first token: a 42-token prompt behind one ~1,200-token prompt 189 / 163 ms, behind three 5.7 /
5.9 s; with 48 sessions decoding 232-237 / 151-169 ms, a fresh ~900-token prompt 4.9 / 4.8 s (the former
model: 2.2 s / 200 ms, 5.9 / 5.3 s, 319-326 / 128-185 ms, 4.0 / 5.9 s). Linear in ``own`` as the router
wants it: :meth:`MeshLoad.linear` gives ``(queue_ms, ms_per_own_token)``, an upper bound: the token-times
until the request gets a slot, then ``k`` prefills sharing the worker with it (``T <= T0 + k x own``).
Before any measurement the prefill cost is :data:`DEFAULT_PREFILL_MS_PER_TOKEN` and the step
:data:`DEFAULT_STEP_MS` (SmolLM2-135M on three CPU workers, ``ethen up``). Not modelled: how far the
prefills ahead have got (each counts its whole prompt: an over-estimate, within 2x in the test).

**Session slots** (:func:`slot_wait_ms`, per chain :func:`chain_slot_wait_ms`): a worker holds at most a
number of sessions of this orchestrator, the one it reports in its ``Health`` (:func:`session_cap`: the
smaller of its ``max_sessions`` and ``max_sessions_per_caller``; a worker that does not say:
:data:`~ethen.mesh.worker.limits.MAX_SESSIONS_PER_CALLER`, 64); a request beyond them is refused
(``RESOURCE_EXHAUSTED``, then ``mesh_saturated`` or a fallback). So a request that would be session ``cap +
k`` of a worker waits for ``ceil(k / cap)`` generations to end, each the measured decode time of a generation
(EWMA, first token to end); a chain waits for its fullest worker.

**Bounded queue per chain** (issue 44 item 3, the mesh provider's ``max_queue``): at most that many
generations wait for their first token on each chain. The orchestrator offers its route candidates in its
order of preference (:func:`~ethen.mesh.orchestrator.planning.route_options`); a generation takes the first
whose chain's queue has room (:func:`pick_chain`, atomically in :meth:`LoadBook.try_begin_any`); with every
chain full it is refused at once, with a ``Retry-After`` of the queue's predicted wait
(:func:`queue_retry_after_s`), instead of waiting up to ``admission_timeout_s`` for worker slots. ``None``
(the default): no bound. The snapshot the gateway reads (:meth:`LoadBook.snapshot` with the candidates) is
the load of the chain a new request would take, so the wait, the bound and the route agree.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ethen.mesh.orchestrator.wait_model import (
    DEFAULT_PREFILL_MS_PER_TOKEN,
    DEFAULT_STEP_MS,
    Chain,
    ChainCounts,
    MeshLoad,
    chain_counts,
    chain_slot_wait_ms,
    pick_chain,
    predicted_wait_ms,
    prefill_ms_per_token_of,
    queue_admits,
    queue_retry_after_s,
    session_cap,
    shared_prefill_tokens,
    slot_wait_ms,
)
from ethen.mesh.worker.limits import MAX_DECODE_BATCH, MAX_SESSIONS_PER_CALLER

HISTORY_S = 600.0  # the load book keeps a sample per second (when something happens) for this long

__all__ = ["DEFAULT_PREFILL_MS_PER_TOKEN", "DEFAULT_STEP_MS", "HISTORY_S", "Chain", "ChainCounts", "LoadBook",
           "LoadSample", "MeshLoad", "chain_counts", "chain_slot_wait_ms", "pick_chain", "predicted_wait_ms",
           "prefill_ms_per_token_of", "queue_admits", "queue_retry_after_s", "session_cap",
           "shared_prefill_tokens", "slot_wait_ms"]


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The load at wall time ``at`` (the dashboard's Mesh tab): sessions, queued prefill tokens, the
    predicted wait before a new request's own prefill (``queue_ms``, the least of the chains),
    generations started so far, and per chain ``(chain, waiting, decoding, queue_ms)``."""

    at: float
    prefilling: int
    decoding: int
    queued_tokens: int
    queue_ms: float
    started: int
    chains: tuple[tuple[Chain, int, int, float], ...] = ()


class _Measured:
    """EWMAs of one chain (or the whole book)."""

    __slots__ = ("generation_ms", "prefill_busy", "prefill_ms_per_token", "step_ms")

    def __init__(self) -> None:
        self.step_ms: float | None = None
        self.prefill_ms_per_token: float | None = None  # from first tokens of requests that ran alone
        self.prefill_busy: float | None = None  # from the others (used until a clean one)
        self.generation_ms: float | None = None


class LoadBook:
    """The generations of one orchestrator per chain and the measurements (module docstring), and a
    history of :class:`LoadSample` (at most one a second, when a generation starts, gets its first token or
    ends; the last :data:`HISTORY_S`). ``caps``: worker id -> its session cap (:func:`session_cap`), set by
    the orchestrator from its workers' ``Health``. Thread-safe."""

    def __init__(self, alpha: float = 0.2, batch_limit: int = MAX_DECODE_BATCH,
                 clock: Callable[[], float] = time.time, max_sessions: int = MAX_SESSIONS_PER_CALLER) -> None:
        self.alpha = alpha
        self.max_sessions = max_sessions  # the cap of a worker that does not say (and of the () chain)
        self.batch_limit = batch_limit
        self.clock = clock
        self.started = 0
        self.caps: Mapping[str, int] = {}
        self._history: deque[LoadSample] = deque()
        self._lock = threading.Lock()
        # ticket -> (chain, own, the prompts waiting ahead on its workers, decoding on its busiest worker),
        # in arrival order
        self._prefilling: dict[object, tuple[Chain, int, tuple[int, ...], int]] = {}
        self._decoding: dict[object, tuple[Chain, float]] = {}  # ticket -> (chain, wall time of first token)
        self._counts: dict[Chain, list[int]] = {}  # chain -> [waiting, decoding, queued tokens]
        self._book = _Measured()
        self._chains: dict[Chain, _Measured] = {}

    # the book-wide EWMAs (a chain not measured yet uses them)
    @property
    def step_ms(self) -> float | None:
        return self._book.step_ms

    @property
    def prefill_ms_per_token(self) -> float | None:
        return self._book.prefill_ms_per_token

    @property
    def generation_ms(self) -> float | None:
        return self._book.generation_ms

    def begin(self, prompt_tokens: int, chain: Chain = ()) -> object:
        """A generation arrived with ``prompt_tokens`` on ``chain``; returns its ticket."""
        ticket = self.try_begin(prompt_tokens, None, chain)
        assert ticket is not None
        return ticket

    def try_begin(self, prompt_tokens: int, max_queue: int | None, chain: Chain = ()) -> object | None:
        """:meth:`begin` unless ``max_queue`` generations already wait for their first token on ``chain``
        (:func:`queue_admits`): then ``None``, and nothing is counted (one check, under the lock)."""
        got = self.try_begin_any(prompt_tokens, max_queue, (chain,))
        return None if got is None else got[0]

    def try_begin_any(self, prompt_tokens: int, max_queue: int | None,
                      chains: Sequence[Chain]) -> tuple[object, int] | None:
        """Begin on the first of ``chains`` with room (:func:`pick_chain`): ``(ticket, its index)``, or
        ``None`` (nothing counted) when every one is full."""
        with self._lock:
            i = pick_chain(chains, {c: n[0] for c, n in self._counts.items()}, max_queue)
            if i is None:
                return None
            chain = tuple(chains[i])
            at = self._chain_counts(chain)
            ticket = object()
            self._prefilling[ticket] = (chain, prompt_tokens, self._ahead(chain), at.busy_decoding)
            self._add(chain, 1, 0, prompt_tokens)
            self.started += 1
            self._sample()
        return ticket, i

    def first_token(self, ticket: object, first_token_ms: float) -> None:
        with self._lock:
            entry = self._prefilling.pop(ticket, None)
            if entry is None:
                return
            chain, own, ahead, decoding = entry
            self._add(chain, -1, 1, -own)
            self._decoding[ticket] = (chain, self.clock())
            obs = prefill_ms_per_token_of(first_token_ms, ahead, own, decoding, self._measured(chain)[0])
            for m in (self._book, self._chain(chain)):
                if not any(ahead) and decoding == 0:  # a clean measurement: nothing else ran meanwhile
                    m.prefill_ms_per_token = self._ewma(m.prefill_ms_per_token, obs)
                else:  # stands in until a clean one (module docstring)
                    m.prefill_busy = self._ewma(m.prefill_busy, obs)
            self._sample()

    def step(self, token_to_token_ms: float, ticket: object | None = None) -> None:
        """A session (``ticket``'s) got its next token ``token_to_token_ms`` after the previous one: with D
        sessions decoding on its chain's busiest worker, that is ``ceil(D / batch_limit)`` batched steps, so
        one step took that share of it."""
        with self._lock:
            entry = self._decoding.get(ticket) if ticket is not None else None
            chain = entry[0] if entry is not None else ()
            busy = (self._chain_counts(chain).busy_decoding if entry is not None
                    else sum(n[1] for n in self._counts.values()))
            steps = max(1, math.ceil(busy / max(1, self.batch_limit)))
            for m in (self._book, self._chain(chain)) if entry is not None else (self._book,):
                m.step_ms = self._ewma(m.step_ms, token_to_token_ms / steps)

    def end(self, ticket: object) -> None:
        with self._lock:
            entry = self._prefilling.pop(ticket, None)
            if entry is not None:
                self._add(entry[0], -1, 0, -entry[1])
            first = self._decoding.pop(ticket, None)
            if first is not None:
                self._add(first[0], 0, -1, 0)
                ms = (self.clock() - first[1]) * 1000.0
                for m in (self._book, self._chain(first[0])):
                    m.generation_ms = self._ewma(m.generation_ms, ms)
            self._sample()

    def load(self, chain: Chain = ()) -> MeshLoad:
        """The load of ``chain`` now."""
        with self._lock:
            return self._load(tuple(chain))

    def snapshot(self, chains: Sequence[Chain] | None = None, max_queue: int | None = None) -> MeshLoad:
        """The load of the chain a new request would take: the first of ``chains`` (the route candidates,
        preferred first) with queue room, or the first when all are full; without ``chains``, the chains
        with generations in flight (the ``()`` chain when none), the least predicted wait."""
        with self._lock:
            if chains:
                i = pick_chain(chains, {c: n[0] for c, n in self._counts.items()}, max_queue)
                return self._load(tuple(chains[0 if i is None else i]))
            busy = [c for c, n in self._counts.items() if n[0] or n[1]] or [()]
            return min((self._load(c) for c in busy), key=lambda x: (x.linear()[0], x.chain))

    def chains(self) -> dict[Chain, MeshLoad]:
        """Every chain this book has seen, its load now (the dashboard)."""
        with self._lock:
            return {c: self._load(c) for c in sorted(set(self._counts) | set(self._chains))}

    def history(self) -> list[LoadSample]:
        with self._lock:
            return list(self._history)

    # ---- under self._lock -------------------------------------------------------------------------------

    def _add(self, chain: Chain, waiting: int, decoding: int, tokens: int) -> None:
        n = self._counts.setdefault(chain, [0, 0, 0])
        n[0] += waiting
        n[1] += decoding
        n[2] += tokens

    def _chain(self, chain: Chain) -> _Measured:
        m = self._chains.get(chain)
        if m is None:
            m = self._chains[chain] = _Measured()
        return m

    def _measured(self, chain: Chain) -> tuple[float, float, float]:
        """``(step_ms, prefill_ms_per_token, generation_ms)`` of ``chain``, the book's where it has none."""
        m, b = self._chains.get(chain, self._book), self._book
        step = m.step_ms if m.step_ms is not None else b.step_ms
        pers = (m.prefill_ms_per_token, b.prefill_ms_per_token, m.prefill_busy, b.prefill_busy)
        per = next((x for x in pers if x is not None), None)
        gen = m.generation_ms if m.generation_ms is not None else b.generation_ms
        return (DEFAULT_STEP_MS if step is None else step, per or DEFAULT_PREFILL_MS_PER_TOKEN, gen or 0.0)

    def _chain_counts(self, chain: Chain) -> ChainCounts:
        counts = {c: (n[0], n[1], n[2]) for c, n in self._counts.items()}
        return chain_counts(chain, counts, self.caps, self._measured(chain)[2], self.max_sessions)

    def _load(self, chain: Chain) -> MeshLoad:
        c = self._chain_counts(chain)
        step, per, gen = self._measured(chain)
        return MeshLoad(c.waiting, c.decoding, c.queued_tokens, step, per, self.batch_limit, c.max_sessions,
                        gen, chain, c.busy_decoding, c.slot_ms, self._ahead(chain))

    def _ahead(self, chain: Chain) -> tuple[int, ...]:
        """The prompt tokens of the generations waiting for a first token on a worker of ``chain`` (the
        ``()`` chain: on it), in arrival order."""
        mine = set(chain)
        return tuple(own for c, own, _, _ in self._prefilling.values() if (mine & set(c) if chain else not c))

    def _sample(self) -> None:
        now = self.clock()
        h = self._history
        per = tuple((c, n[0], n[1], self._load(c).linear()[0]) for c, n in sorted(self._counts.items())
                    if n[0] or n[1])
        sample = LoadSample(now, sum(n[0] for n in self._counts.values()),
                            sum(n[1] for n in self._counts.values()),
                            sum(n[2] for n in self._counts.values()),
                            min((x[3] for x in per), default=self._load(()).linear()[0]), self.started, per)
        if h and math.floor(now) == math.floor(h[-1].at):
            h[-1] = sample  # the latest state of this wall-clock second
        else:
            h.append(sample)
        while h and now - h[0].at > HISTORY_S:
            h.popleft()

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
