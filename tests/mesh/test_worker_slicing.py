"""How a worker slices a step of several rows (issue 23, item 5), checked deterministically: the order in
which a recording backend computes layers, with no clock involved.

A step runs one layer at a time and its slice ends at the next layer as soon as another session's job is
queued: a decode step that arrives while a prefill's layer runs is computed right after that layer (not
after the prefill's chunk or fragment), and two prefills of two callers alternate layer by layer. Chunk rows
depend only on positions, and running a fragment's layers one by one gives the same bits as the fragment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from ethen.mesh.worker import ModelBackend, WorkerConfig, WorkerService
from ethen.mesh.worker.backend import F32, I64
from ethen.mesh.worker.batching import Job
from ethen.mesh.worker.limits import CHUNK_ROW_BUDGET, PREFILL_CHUNK_TOKENS, chunk_rows
from ethen.model.kv_cache import KVCache

D = 8
LAYERS = 4


class RecordingBackend:
    """Each layer adds 1 to the hidden state; records (session tag, layer, rows, first position) per layer
    computed, and calls ``hook`` with that record before computing it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []
        self.capacities: list[int] = []  # the cache's capacity at each forward_layer
        self.hook: Callable[[tuple[str, int, int, int]], None] = lambda call: None

    @property
    def hidden_size(self) -> int:
        return D

    @property
    def context_length(self) -> int:
        return 8192

    def new_cache(self, fragment: int) -> KVCache:
        return KVCache(LAYERS, 1, 2, 8192)

    def _layer(self, hidden: F32, layer: int, positions: I64) -> F32:
        call = (f"{hidden[0, 0] // 1000:.0f}", layer, hidden.shape[0], int(positions[0]))
        self.hook(call)
        self.calls.append(call)
        return hidden + np.float32(1)

    def forward(self, fragments: Sequence[int], hidden: F32, positions: I64,
                caches: Sequence[KVCache]) -> F32:
        x = hidden
        for kv in caches:
            for layer in range(LAYERS):
                x = self._layer(x, layer, positions)
            kv.reserve(len(positions))
            kv.commit(len(positions))
        return x

    def forward_batch(self, fragments: Sequence[int], hidden: F32, positions: I64,
                      caches: Sequence[Sequence[KVCache]]) -> F32:
        raise AssertionError("no batched step in these tests")

    def forward_layer(self, fragment: int, layer: int, hidden: F32, positions: I64, cache: KVCache) -> F32:
        self.capacities.append(cache.capacity)
        x = self._layer(hidden, layer, positions)
        if layer == LAYERS - 1:
            cache.reserve(len(positions))
            cache.commit(len(positions))
        return x


def _job(session: str, tag: int, rows: int, start: int = 0) -> Job:
    """A job whose hidden rows hold ``tag * 1000`` (so the backend's records name the job)."""
    hidden = np.full((rows, D), tag * 1000, dtype=np.float32)
    return Job(session_id=session, first_layer=0, last_layer=LAYERS - 1,
               positions=list(range(start, start + rows)), hidden=hidden, caller=f"caller-{session}")


def _service() -> tuple[WorkerService, RecordingBackend]:
    backend = RecordingBackend()
    return WorkerService(WorkerConfig("w", [(0, LAYERS - 1)]), backend), backend


def _arrive_during(service: WorkerService, backend: RecordingBackend, when: tuple[str, int, int, int],
                   job: Job, out: dict[str, F32]) -> threading.Thread:
    """When the backend is about to compute ``when``, submit ``job`` on another thread and let the
    computation go on only once ``job`` is queued (as if it arrived during that layer)."""

    def submit() -> None:
        out[job.session_id] = service.batcher.run(job)[0]

    thread = threading.Thread(target=submit)

    def hook(call: tuple[str, int, int, int]) -> None:
        if call == when and not thread.is_alive() and job.session_id not in out:
            thread.start()
            for _ in range(10_000):
                with service.batcher._cond:  # the batcher's queue, under its lock
                    if job in service.batcher._queue:
                        return
                threading.Event().wait(0.001)
            raise AssertionError(f"{job.session_id}'s job never got queued")

    backend.hook = hook
    return thread


def test_a_decode_step_arriving_during_a_prefill_layer_runs_right_after_that_layer() -> None:
    service, backend = _service()
    a = _job("a", 1, 300)  # chunks of chunk_rows(position): 64, 64, 64, 64, 44
    b = _job("b", 2, 1)
    out: dict[str, F32] = {}
    thread = _arrive_during(service, backend, ("1", 1, 64, 0), b, out)
    result = service.batcher.run(a)[0]
    thread.join(10)
    calls = backend.calls
    # A's layers 0 and 1 of its first chunk, then B's whole decode step, then A goes on at layer 2
    assert calls[:6] == [("1", 0, 64, 0), ("1", 1, 64, 0), ("2", 0, 1, 0), ("2", 1, 1, 0), ("2", 2, 1, 0),
                         ("2", 3, 1, 0)]
    assert calls[6] == ("1", 2, 64, 0)
    a_calls = [c for c in calls if c[0] == "1"]
    assert [(rows, start) for _, layer, rows, start in a_calls if layer == 0] == [
        (64, 0), (64, 64), (64, 128), (64, 192), (44, 256)]
    assert len(a_calls) == 5 * LAYERS
    np.testing.assert_array_equal(result, a.hidden + LAYERS)  # every row through every layer once
    np.testing.assert_array_equal(out["b"], b.hidden + LAYERS)
    assert service.store.length("a", [0]) == 300 and service.store.length("b", [0]) == 1
    # the cache had room for the whole step from its first slice on (no doubling copy inside a slice)
    assert backend.capacities[0] >= 300 and len(set(backend.capacities)) == 1


def test_two_callers_prefills_alternate_layer_by_layer() -> None:
    service, backend = _service()
    a = _job("a", 1, 128)  # one chunk each (at most PREFILL_CHUNK_TOKENS rows)
    b = _job("b", 2, 100)
    out: dict[str, F32] = {}
    thread = _arrive_during(service, backend, ("1", 1, 128, 0), b, out)
    result = service.batcher.run(a)[0]
    thread.join(10)
    order = [(tag, layer) for tag, layer, _, _ in backend.calls]
    assert order == [("1", 0), ("1", 1), ("2", 0), ("1", 2), ("2", 1), ("1", 3), ("2", 2), ("2", 3)]
    np.testing.assert_array_equal(result, a.hidden + LAYERS)
    np.testing.assert_array_equal(out["b"], b.hidden + LAYERS)


def test_alone_a_step_runs_to_its_end_in_one_turn() -> None:
    service, backend = _service()
    turns: list[float] = []
    service.batcher._on_step = lambda end, took: turns.append(took)
    out = service.batcher.run(_job("a", 1, 2048))[0]
    assert len(turns) == 1  # nobody else queued: no slice ends early
    np.testing.assert_array_equal(out, np.full((2048, D), 1000 + LAYERS, np.float32))
    chunks = [(rows, start) for _, layer, rows, start in backend.calls if layer == 0]
    assert all(rows == chunk_rows(start) for rows, start in chunks)  # 64 rows, then 32 from 1,088
    assert sum(rows for rows, _ in chunks) == 2048 and len(backend.calls) == LAYERS * len(chunks)


@pytest.mark.parametrize("start", [0, 1, 500, 1024, 1025, 2047, 4096, 4097, 6000, 8191])
def test_chunk_rows_depend_on_the_position_and_keep_within_the_budget(start: int) -> None:
    rows = chunk_rows(start)
    assert rows in (16, 32, 64) and rows < PREFILL_CHUNK_TOKENS
    assert rows == 16 or rows * (1 + start / 2048) <= CHUNK_ROW_BUDGET
    assert rows == 64 or 2 * rows * (1 + start / 2048) > CHUNK_ROW_BUDGET  # the largest that fits


def test_a_fragments_layers_one_by_one_give_the_fragments_bits() -> None:
    backend = ModelBackend.load([(0, 3)])
    rng = np.random.default_rng(1)
    whole, layered = backend.new_cache(0), backend.new_cache(0)
    for start, t in ((0, 70), (70, 100), (170, 1)):  # 100 rows from 70: the cache grows (reallocates)
        x = rng.standard_normal((t, backend.hidden_size)).astype(np.float32)
        pos = np.arange(start, start + t)
        expected = backend.forward([0], x, pos, [whole])
        y = x
        for layer in range(4):
            assert layered.length == start  # committed only after the fragment's last layer
            y = backend.forward_layer(0, layer, y, pos, layered)
        np.testing.assert_array_equal(y, expected)
        assert layered.length == whole.length == start + t
        np.testing.assert_array_equal(layered.k[:, :, : start + t], whole.k[:, :, : start + t])
        np.testing.assert_array_equal(layered.v[:, :, : start + t], whole.v[:, :, : start + t])


def test_a_step_queued_by_the_prefilling_session_itself_does_not_cut_its_slices() -> None:
    service, backend = _service()
    turns: list[float] = []
    service.batcher._on_step = lambda end, took: turns.append(took)
    a = _job("a", 1, 300)
    after = _job("a", 2, 1, start=300)  # the same session's next step: it can only run after A's prefill
    out: dict[str, F32] = {}
    thread = _arrive_during(service, backend, ("1", 1, 64, 0), after, out)
    service.batcher.run(a)
    thread.join(10)
    tags = [tag for tag, _, _, _ in backend.calls]
    assert tags == ["1"] * (5 * LAYERS) + ["2"] * LAYERS
    assert len(turns) == 2  # A in one turn (nothing else could run), then its next step
    np.testing.assert_array_equal(out["a"], after.hidden + LAYERS)
