"""Issue 44 item 3, a bounded queue per chain: the load book counts per chain (a chain: the route's workers
in order), ``max_queue`` bounds each chain's queue, a generation takes the first route option with room, a
chain's predicted wait is its own (its busiest worker's, every chain through that worker counted), and the
slot wait uses the session caps the workers report. The pure functions against brute-force oracles."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.mesh.errors import MeshError
from ethen.mesh.orchestrator.load import (
    Chain,
    LoadBook,
    MeshLoad,
    chain_counts,
    chain_slot_wait_ms,
    pick_chain,
    predicted_wait_ms,
    session_cap,
    shared_prefill_tokens,
)
from ethen.mesh.orchestrator.planning import mark_dead, plan_route, route_options
from ethen.mesh.routing import NodeState, RouteWeights
from ethen.mesh.worker.limits import MAX_SESSIONS_PER_CALLER

A: Chain = ("w0", "w1")
B: Chain = ("w2", "w3")
SHARED: Chain = ("w0", "w4")  # shares w0 with A

_NODES = ["w0", "w1", "w2", "w3"]
_CHAINS = st.lists(st.sampled_from(_NODES), min_size=1, max_size=3).map(tuple)
# (chain, decoding, prompt tokens) per generation
_GENS = st.lists(st.tuples(_CHAINS, st.booleans(), st.integers(0, 500)), max_size=40)
_CAPS = st.dictionaries(st.sampled_from(_NODES), st.integers(1, 8))


# ---- pure functions against brute force ----------------------------------------------------------------

@given(st.lists(_CHAINS, max_size=6), st.dictionaries(_CHAINS, st.integers(0, 5)),
       st.one_of(st.none(), st.integers(1, 5)))
def test_pick_chain_is_the_first_offered_chain_with_room(chains: list[Chain], waiting: dict[Chain, int],
                                                         max_queue: int | None) -> None:
    room = [max_queue is None or waiting.get(c, 0) + 1 <= max_queue for c in chains]
    oracle = room.index(True) if True in room else None
    assert pick_chain(chains, waiting, max_queue) == oracle


def _brute_slot(sessions: int, cap: int, gen_ms: float) -> float:
    waves, ahead = 0, sessions
    while ahead + 1 > cap:
        ahead -= cap
        waves += 1
    return waves * gen_ms


@given(_CHAINS, _GENS, _CAPS, st.floats(0, 10_000), st.integers(1, 8))
def test_chain_counts_match_a_walk_of_every_generation(chain: Chain, gens: list[tuple[Chain, bool, int]],
                                                       caps: dict[str, int], gen_ms: float,
                                                       default_cap: int) -> None:
    """Oracle: per worker of the chain, walk every generation and count one session per stage it has on
    that worker (a waiting one also its prompt tokens, a decoding one a decode step); the chain's figures
    are its own generations and, over its workers, the largest per-worker totals; the slot wait is the
    largest per-worker wave count x the generation time."""
    counts: dict[Chain, tuple[int, int, int]] = {}
    for c, decoding, tokens in gens:
        w, d, q = counts.get(c, (0, 0, 0))
        counts[c] = (w + (not decoding), d + decoding, q + (0 if decoding else tokens))
    got = chain_counts(chain, counts, caps, gen_ms, default_cap)
    own = [(d, t) for c, d, t in gens if c == chain]
    assert (got.waiting, got.decoding) == (sum(not d for d, _ in own), sum(d for d, _ in own))
    per_node = {}
    for node in chain:
        sessions = sum(c.count(node) for c, _, _ in gens)
        decoding = sum(c.count(node) for c, d, _ in gens if d)
        queued = sum(c.count(node) * t for c, d, t in gens if not d)
        per_node[node] = (sessions, decoding, queued)
    assert got.queued_tokens == max(q for _, _, q in per_node.values())
    assert got.busy_decoding == max(d for _, d, _ in per_node.values())
    slot = max(_brute_slot(s, caps.get(n, default_cap), gen_ms) for n, (s, _, _) in per_node.items())
    assert got.slot_ms == pytest.approx(slot)
    assert chain_slot_wait_ms(chain, {c: w + d for c, (w, d, _) in counts.items()}, caps, gen_ms,
                              default_cap) == pytest.approx(slot)


def _rounds(ahead: list[int], own: int, slots: int) -> int:
    """Brute force: round by round, every prefill with a slot (at most ``slots``, taken in arrival order)
    computes one token; a round costs one token-time per prefill in it. The token-times until own's last."""
    jobs = [*ahead, own]
    left = list(jobs)
    active: list[int] = []
    nxt, t = 0, 0
    while True:
        while len(active) < slots and nxt < len(jobs):
            active.append(nxt)
            nxt += 1
        done = [j for j in active if left[j] == 0]
        if len(jobs) - 1 in done:
            return t
        if done:
            active = [j for j in active if left[j] > 0]
            continue
        for j in active:
            left[j] -= 1
        t += len(active)


@given(st.lists(st.integers(0, 60), max_size=6), st.integers(0, 60), st.integers(1, 4))
def test_shared_prefill_matches_round_robin(ahead: list[int], own: int, slots: int) -> None:
    got = shared_prefill_tokens(ahead, own, slots)
    assert got == _rounds(ahead, own, slots)
    assert own <= got <= sum(ahead) + own  # never better than alone, never worse than first come first served
    assert shared_prefill_tokens(ahead, own, 1) == sum(ahead) + own


@given(st.lists(st.integers(0, 3000), max_size=6), st.integers(0, 2000), st.integers(0, 40),
       st.floats(0, 200), st.floats(0, 5), st.integers(1, 4))
def test_the_linear_form_bounds_the_shared_wait(ahead: list[int], own: int, decoding: int, step: float,
                                                per_tok: float, slots: int) -> None:
    """The router's linear form ``queue_ms + own x ms_per_own_token`` is an upper bound of the wait with
    prefills sharing the worker, and within ``slots`` times the prefill part plus two decode turns of it."""
    load = MeshLoad(len(ahead), decoding, sum(ahead), step, per_tok, ahead=tuple(ahead), slots=slots)
    got = load.wait_ms(own)
    assert got == pytest.approx(predicted_wait_ms(ahead, own, decoding, step, per_tok, slots))
    q, k = load.linear()
    turn = step if decoding else 0.0
    assert got - 1e-6 <= q + own * k <= slots * got + 2 * turn + 1e-6


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_session_cap_is_the_smaller_reported_limit_else_the_default(total: int, per_caller: int) -> None:
    reported = [x for x in (total, per_caller) if x > 0]
    assert session_cap(total, per_caller) == (min(reported) if reported else MAX_SESSIONS_PER_CALLER)


# ---- the book: per chain -----------------------------------------------------------------------------------

def test_max_queue_bounds_each_chain_not_the_orchestrator() -> None:
    book = LoadBook()
    assert book.try_begin(100, 1, A) is not None
    assert book.try_begin(100, 1, A) is None  # A's queue is full
    assert book.try_begin(100, 1, B) is not None  # B's is not: another chain, its own bound
    assert book.try_begin(100, 1, B) is None
    assert (book.load(A).prefilling, book.load(B).prefilling) == (1, 1)


def test_a_generation_takes_the_first_route_option_with_room() -> None:
    book = LoadBook()
    first = book.try_begin_any(300, 1, [A, B])
    assert first is not None and first[1] == 0  # the preferred chain while it has room
    second = book.try_begin_any(50, 1, [A, B])
    assert second is not None and second[1] == 1  # A full: B
    assert book.try_begin_any(50, 1, [A, B]) is None  # both full: refused, nothing counted
    assert (book.load(A).queued_tokens, book.load(B).queued_tokens) == (300, 50)
    book.first_token(first[0], 100.0)
    got = book.try_begin_any(10, 1, [A, B])
    assert got is not None and got[1] == 0  # A has room again


def test_the_predicted_wait_is_the_chain_s_own() -> None:
    """Two long prompts queued on A (its slots full): A's wait grows, B's (other workers) does not; a chain
    sharing A's first worker waits behind them too. The snapshot is the chain a new request would take."""
    book = LoadBook(alpha=1.0)
    book.begin(2000, A)
    book.begin(2000, A)
    a, b, shared = book.load(A), book.load(B), book.load(SHARED)
    assert a.wait_ms(10) > 1000.0
    assert b.wait_ms(10) == pytest.approx(10 * b.prefill_ms_per_token)  # nothing ahead on B
    assert shared.queued_tokens == 4000 and shared.wait_ms(10) == pytest.approx(a.wait_ms(10))
    assert book.snapshot([A, B]).chain == A  # A has room (no bound): a new request goes to A
    assert book.snapshot([A, B], max_queue=2).chain == B  # A full: B's load
    assert book.snapshot([B, A]).wait_ms(10) == pytest.approx(b.wait_ms(10))
    assert set(book.chains()) == {A}


def test_decode_steps_are_measured_per_chain() -> None:
    book = LoadBook(alpha=1.0)
    ta = book.begin(10, A)
    book.first_token(ta, 30.0)
    book.step(50.0, ta)
    assert book.load(A).step_ms == 50.0
    tb = book.begin(10, B)
    assert book.load(B).step_ms == 50.0  # not measured yet: the book's
    book.first_token(tb, 30.0)
    book.step(200.0, tb)
    assert (book.load(A).step_ms, book.load(B).step_ms) == (50.0, 200.0)


def test_the_slot_wait_uses_the_worker_s_reported_cap() -> None:
    """A worker started with --max-sessions-per-caller 2 says so in Health: a third session on it waits
    for a generation to end; a chain through other workers does not. Without caps: 64 per worker."""
    now = [0.0]
    book = LoadBook(alpha=1.0, clock=lambda: now[0])
    t = book.begin(10, A)
    book.first_token(t, 10.0)
    now[0] = 4.0
    book.end(t)  # a generation of 4 s
    book.begin(10, A)
    book.begin(10, A)
    assert book.load(A).slot_ms == 0.0  # 2 of 64
    book.caps = {"w1": session_cap(256, 2)}
    assert book.load(A).slot_ms == pytest.approx(4000.0)
    assert book.load(A).max_sessions == 2
    assert book.load(B).slot_ms == 0.0
    assert book.load(SHARED).slot_ms == 0.0  # w0 and w4: no cap reported, 2 sessions on w0
    assert book.load(A).wait_ms(0) >= 4000.0


def test_a_busy_first_token_does_not_recalibrate_the_prefill_cost() -> None:
    """The prefill cost per token comes from first tokens of requests that ran alone; one that arrived
    while others decoded or were queued (its time mostly theirs) stands in only until a clean one exists."""
    book = LoadBook(alpha=1.0)
    first = book.begin(100, A)
    behind = book.begin(60, A)  # shares the worker with the 100 tokens ahead: 2 x 60 token-times
    book.first_token(behind, 240.0)  # 120 x 2 ms: no clean measurement yet, it stands in
    assert book.load(A).prefill_ms_per_token == pytest.approx(2.0)
    book.first_token(first, 100.0)  # arrived alone: 1 ms per token
    assert book.load(A).prefill_ms_per_token == pytest.approx(1.0)
    book.step(100.0, first)  # sessions decoding, a step of 100 ms
    probe = book.begin(40, A)
    book.first_token(probe, 101.0)  # arrived while 2 decode: 100 ms turn + 1 ms (would say 0.025 ms/token)
    assert book.load(A).prefill_ms_per_token == pytest.approx(1.0)
    load = book.load(A)  # 3 decoding: one turn (one batched step) per chunk, the first half a step
    assert load.wait_ms(500) == pytest.approx(500 * 1.0 + (math.ceil(500 / 128) - 0.5) * 100.0)


def test_the_history_keeps_the_queue_per_chain() -> None:
    now = [10.0]
    book = LoadBook(clock=lambda: now[0])
    book.begin(500, A)
    book.begin(500, A)
    now[0] = 11.0
    book.begin(20, B)
    last = book.history()[-1]
    assert {c: (w, d) for c, w, d, _ in last.chains} == {A: (2, 0), B: (1, 0)}
    per = {c: q for c, _, _, q in last.chains}
    assert per[A] > per[B] and last.queue_ms == pytest.approx(per[B])
    assert (last.prefilling, last.queued_tokens) == (3, 1020)


# ---- route options -----------------------------------------------------------------------------------------

def _node(node_id: str, latency: float, *layers: tuple[int, int]) -> NodeState:
    return NodeState(node_id, latency, 0.0, 1.0, list(layers))


def test_route_options_offer_the_other_chains_cheapest_first() -> None:
    states = [_node("fast", 1.0, (0, 29)), _node("mid", 5.0, (0, 14)), _node("tail", 5.0, (15, 29)),
              _node("slow", 500.0, (0, 29))]
    options = route_options(states, 30, 8, RouteWeights(), "m")
    assert options[0].nodes == ("fast",)
    # without fast: the next cheapest chain; without fast and mid (or tail): slow
    assert [r.nodes for r in options[1:]] == [("mid", "tail"), ("slow",)]
    assert [r.nodes for r in route_options(states, 30, 8, RouteWeights(), "m", limit=2)] == [
        ("fast",), ("mid", "tail")]
    assert len({r.nodes for r in options}) == len(options)
    only = route_options([_node("solo", 1.0, (0, 29))], 30, 8, RouteWeights(), "m")
    assert [r.nodes for r in only] == [("solo",)]  # no other chain: the bound refuses


_LAYERS = 6
_SPANS = st.sampled_from([(0, 5), (0, 2), (3, 5), (0, 3), (4, 5), (2, 5), (0, 1)])
_MESH = st.lists(st.tuples(st.floats(1, 100), st.lists(_SPANS, min_size=1, max_size=2)), min_size=1,
                 max_size=5)


@given(_MESH, st.integers(1, 8))
def test_route_options_are_the_chains_of_every_dead_set(mesh: list[tuple[float, list[tuple[int, int]]]],
                                                        limit: int) -> None:
    """Brute force: plan with every subset of the workers left out; the chains found (non-degraded) are the
    options with no limit, the planned route first, then by cost; with a limit, as many of them (the first
    ones found, breadth first), in the same order."""
    states = [NodeState(f"n{i}", lat, 0.0, 1.0, sorted(set(spans))) for i, (lat, spans) in enumerate(mesh)]
    ids = [x.node_id for x in states]
    try:
        best = plan_route(states, _LAYERS, 4, RouteWeights(), "m")
    except MeshError:
        with pytest.raises(MeshError):
            route_options(states, _LAYERS, 4, RouteWeights(), "m")
        return
    every: dict[tuple[str, ...], float] = {}
    for mask in range(1 << len(ids)):
        dead = [n for i, n in enumerate(ids) if mask >> i & 1]
        try:
            r = plan_route(mark_dead(states, dead), _LAYERS, 4, RouteWeights(), "m")
        except MeshError:
            continue
        if not r.degraded:
            every[r.nodes] = r.cost
    oracle = [best.nodes, *sorted((c for c in every if c != best.nodes), key=lambda c: (every[c], c))]
    got = [r.nodes for r in route_options(states, _LAYERS, 4, RouteWeights(), "m", limit=64)]
    assert got == oracle
    few = [r.nodes for r in route_options(states, _LAYERS, 4, RouteWeights(), "m", limit=limit)]
    assert len(few) == min(limit, len(oracle)) and few[0] == best.nodes
    assert few == [c for c in oracle if c in few]
