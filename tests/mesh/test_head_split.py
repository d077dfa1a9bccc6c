"""The orchestrator's head with its matmul split by vocabulary ranges over threads, on the real model's head:
SmolLM2's tied Q8_0 embedding through the block kernel (:class:`~ethen.model.qhead.BlockHead`, accuracy
``exact``), the head ``SplitHead`` splits (a head on one engine graph runs on the engine's own threads)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ethen.mesh.orchestrator.head import SplitHead
from ethen.model import open_weight_store
from ethen.model.errors import ModelInputError
from ethen.model.qmodel import QuantEmbedAndHead, onnx_engine


@pytest.fixture(scope="module")
def ends() -> Iterator[QuantEmbedAndHead]:
    # accuracy exact: the block kernel (auto: the engine's exact-int8 graph)
    head = QuantEmbedAndHead(open_weight_store(), onnx_engine(accuracy="exact"))
    assert head.block_head is not None and head.block_head.kind == "Q8_0"
    yield head


def test_split_head_gives_the_unsplit_logits(ends: QuantEmbedAndHead) -> None:
    head = SplitHead(ends, 2)
    try:
        assert head.split and len(head._parts) == 2 and head._parts[0][1] % 256 == 0
        assert head._parts[-1][1] == ends.config.vocab_size
        rng = np.random.default_rng(7)
        real = ends.embed([1, 42, 314, 2718])  # real embedding rows as hidden states
        for rows in (1, 2, 3, 4, 8):
            noise = rng.standard_normal(real[:1].shape).astype(np.float32)
            hidden = np.ascontiguousarray(np.repeat(real[:1], rows, axis=0) + noise)
            hidden[: min(rows, 4)] = real[: min(rows, 4)] + noise
            assert np.array_equal(head(hidden), ends.logits(hidden)), rows  # bitwise, 1-8 rows
        hidden = rng.standard_normal((12, ends.config.d_model)).astype(np.float32)  # prefill-sized
        got, want = head(hidden), ends.logits(hidden)
        assert got.shape == want.shape == (12, ends.config.vocab_size)
        np.testing.assert_array_equal(got, want)
    finally:
        head.close()


def test_one_thread_is_the_unsplit_head_and_bad_input_is_refused(ends: QuantEmbedAndHead) -> None:
    one = SplitHead(ends, 1)
    hidden = ends.embed([5])
    assert not one.split and np.array_equal(one(hidden), ends.logits(hidden))
    two = SplitHead(ends, 2)
    try:
        two.split = False  # switched off: the unsplit head itself
        wide = np.ascontiguousarray(np.repeat(hidden, 8, axis=0))
        assert np.array_equal(two(wide), ends.logits(wide))
        two.split = True
        with pytest.raises(ModelInputError, match="float32"):
            two(hidden.astype(np.float64))  # type: ignore[arg-type]
        with pytest.raises(ModelInputError, match=str(ends.config.d_model)):
            two(np.zeros((1, 3), np.float32))
    finally:
        two.close()
    with pytest.raises(ValueError, match="head_threads = 0"):
        SplitHead(ends, 0)


def test_batched_head_gives_each_row_its_one_row_logits(ends: QuantEmbedAndHead) -> None:
    """The kernel's 4-, 2- and 1-row paths: each row of a 2-8 row call agrees with its own one-row call to
    float32 rounding and picks the same greedy token, split over two threads or not."""
    rng = np.random.default_rng(3)
    hidden = ends.embed([7, 99, 1234, 4321, 17, 5, 3000, 12]) + rng.standard_normal((8, ends.config.d_model),
                                                                                  dtype=np.float32)
    split = SplitHead(ends, 2)
    try:
        for rows in (2, 5, 8):
            block = np.ascontiguousarray(hidden[:rows])
            for batch in (ends.logits(block), split(block)):
                for i in range(rows):
                    one = ends.logits(np.ascontiguousarray(hidden[i:i + 1]))[0]
                    np.testing.assert_allclose(batch[i], one, rtol=0, atol=1e-4)
                    assert int(batch[i].argmax()) == int(one.argmax())
    finally:
        split.close()
