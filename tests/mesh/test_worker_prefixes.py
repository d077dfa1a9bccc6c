"""The worker's prefix cache (issue 45 item 3): LRU bounded by bytes, copies (never shared rows), and the
Forward fields that fill and use it, over real gRPC on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from ethen.mesh.proto import mesh_pb2
from ethen.mesh.worker.prefixes import PREFIX_BLOCK, PrefixCache
from ethen.model.kv_cache import KVCache
from tests.mesh.test_worker_grpc import Worker, _code, _hidden

HASHES = tuple(f"h{k}" for k in range(8))


def _filled(n: int, value: float) -> KVCache:
    kv = KVCache(2, 1, 4, 1024)
    kv.reserve(n)
    kv.k[:, :, :n] = value
    kv.v[:, :, :n] = -value
    kv.commit(n)
    return kv


def test_an_entry_answers_every_block_of_its_chain_and_seeds_a_copy() -> None:
    cache = PrefixCache(1 << 20)
    src = _filled(3 * PREFIX_BLOCK + 5, 1.5)  # 3 whole blocks
    cache.remember(HASHES, 0, src)
    assert cache.holds("h2", [0]) and cache.holds("h0", [0])
    assert not cache.holds("h3", [0]) and not cache.holds("h2", [10])
    assert cache.names() == ["h2@0", "h1@0", "h0@0"]
    dst = KVCache(2, 1, 4, 1024)
    assert cache.seed("h1", 2 * PREFIX_BLOCK, 0, dst)
    assert dst.length == 2 * PREFIX_BLOCK
    assert np.all(dst.k[:, :, : dst.length] == 1.5) and np.all(dst.v[:, :, : dst.length] == -1.5)
    src.k[:] = 9.0  # the session's later writes never reach the entry, nor the entry's the seeded copy
    dst.k[:] = 7.0
    again = KVCache(2, 1, 4, 1024)
    assert cache.seed("h2", 3 * PREFIX_BLOCK, 0, again)
    assert np.all(again.k[:, :, : again.length] == 1.5)
    assert not cache.seed("h2", 2 * PREFIX_BLOCK, 0, KVCache(2, 1, 4, 1024))  # h2 names 3 blocks, not 2
    assert not cache.seed("h0", PREFIX_BLOCK, 0, again)  # only into an empty cache


def test_least_recently_used_entries_go_first_past_the_byte_bound() -> None:
    one = 2 * 2 * 1 * PREFIX_BLOCK * 4 * 4  # K and V of one block: 2 layers, 1 head, 4 dims, float32
    cache = PrefixCache(2 * one)
    cache.remember(("x0",), 0, _filled(PREFIX_BLOCK, 1.0))
    cache.remember(("y0",), 0, _filled(PREFIX_BLOCK, 2.0))
    assert cache.seed("x0", PREFIX_BLOCK, 0, KVCache(2, 1, 4, 1024))  # x is the most recent now
    cache.remember(("z0",), 0, _filled(PREFIX_BLOCK, 3.0))
    assert cache.nbytes == 2 * one
    assert cache.holds("x0", [0]) and cache.holds("z0", [0]) and not cache.holds("y0", [0])
    cache.remember(("w0", "w1", "w2"), 0, _filled(3 * PREFIX_BLOCK, 4.0))  # larger than the bound: not kept
    assert not cache.holds("w0", [0]) and cache.nbytes == 2 * one


def test_dropping_a_longer_entry_keeps_a_shorter_one_naming_a_shared_block() -> None:
    cache = PrefixCache(1 << 20)
    cache.remember(("s0", "s1"), 0, _filled(2 * PREFIX_BLOCK, 1.0))
    cache.remember(("s0",), 0, _filled(PREFIX_BLOCK, 2.0))  # the newest entry answers for s0
    cache._drop(("s0", 0))
    assert cache.holds("s0", [0]) and cache.holds("s1", [0])  # s0 answered by the longer entry again
    kv = KVCache(2, 1, 4, 1024)
    assert cache.seed("s0", PREFIX_BLOCK, 0, kv) and np.all(kv.k[:, :, :PREFIX_BLOCK] == 1.0)
    cache._drop(("s1", 0))
    assert not cache.holds("s0", [0]) and len(cache) == 0 and cache.nbytes == 0


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker([(0, 4)])
    yield w
    w.close()


def _forward(w: Worker, sid: str, hidden: np.ndarray, start: int, hashes: tuple[str, ...] = (),
             prefix_length: int = 0) -> Any:
    req = mesh_pb2.ForwardRequest(
        session_id=sid, first_layer=0, last_layer=4, positions=list(range(start, start + len(hidden))),
        hidden=mesh_pb2.Tensor(data=hidden.tobytes(), shape=list(hidden.shape), dtype="float32"),
        prefix_hashes=list(hashes), prefix_length=prefix_length)
    reply = w.stub.Forward(req, timeout=30)
    return np.frombuffer(reply.hidden.data, np.float32).reshape(tuple(reply.hidden.shape))


def test_a_seeded_session_computes_the_suffix_as_a_full_prefill_does(worker: Worker) -> None:
    prompt = _hidden(2 * PREFIX_BLOCK + 10)
    full = _forward(worker, "full", prompt, 0, ("p0", "p1"))
    before = worker.health()
    assert "p1@0" in before.cached_prefixes
    suffix = _forward(worker, "seeded", prompt[2 * PREFIX_BLOCK:], 2 * PREFIX_BLOCK, ("p0", "p1"),
                      2 * PREFIX_BLOCK)
    np.testing.assert_allclose(suffix, full[2 * PREFIX_BLOCK:], rtol=1e-4, atol=1e-4)
    after = worker.health()
    assert after.prefix_hits == before.prefix_hits + 1
    assert after.prefix_tokens_reused == before.prefix_tokens_reused + 2 * PREFIX_BLOCK
    # the seeded session goes on like any other
    assert _forward(worker, "seeded", _hidden(1), len(prompt)).shape == (1, 576)


def test_a_prefix_the_worker_does_not_hold_is_failed_precondition(worker: Worker) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        _forward(worker, "nope", _hidden(3), PREFIX_BLOCK, ("never",), PREFIX_BLOCK)
    assert _code(excinfo) == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not hold the prefix 'never'" in excinfo.value.details()


@pytest.mark.parametrize(("hashes", "length", "start", "message"), [
    (("a",), 10, 10, "prefix_length=10 must be a positive multiple of 64"),
    (("a",), 128, 128, "prefix_length=128 must be a positive multiple of 64 named by prefix_hashes (1"),
    (("a",), 64, 0, "prefix_length=64 but positions start at 0"),
    (("",), 0, 0, "prefix_hashes entries must be 1 to 128 characters"),
])
def test_bad_prefix_fields_are_invalid_argument(worker: Worker, hashes: tuple[str, ...], length: int,
                                                start: int, message: str) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        _forward(worker, "bad", _hidden(2), start, hashes, length)
    assert _code(excinfo) == grpc.StatusCode.INVALID_ARGUMENT
    assert message in excinfo.value.details()
