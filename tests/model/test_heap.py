"""``ethen.model.heap``: only long steps trim (a decode step's buffers are small and reused), and loading
layers ends with a trim; long steps and loading release the engine files' mapped pages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ethen.model import load_layer_stacks, open_weight_store, qmodel
from ethen.model.engine import ACCURACY_AUTO, Engine
from ethen.model.heap import TRIM_ROWS, mapped_rss, release_mapped, trim, trim_after
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_only_a_step_of_trim_rows_or_more_trims() -> None:
    assert trim_after(1) is False
    assert trim_after(TRIM_ROWS - 1) is False
    assert trim_after(TRIM_ROWS) is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_trim_trims_on_glibc() -> None:
    assert trim() is True


def test_loading_layers_ends_with_a_trim(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``load_quant_layers`` gives the packing's freed temporaries back (``ethen.model.qmodel`` calls
    :func:`trim` once the graphs are built)."""
    calls: list[int] = []
    monkeypatch.setattr(qmodel, "trim", lambda: calls.append(1) or True)
    path = write_tiny_gguf(tmp_path / "t.gguf", TinySpec(types=("Q8_0",), n_layers=1, name="t"))
    store = open_weight_store(path, cache_root=tmp_path / "cache")
    qmodel.load_quant_layers([(0, 0)], store, Engine("cpu", 1, ACCURACY_AUTO))
    assert calls == [1]


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, madvise")


@linux_only
def test_release_mapped_drops_the_pages_of_files_under_a_folder_and_they_read_back(tmp_path: Path) -> None:
    mine, other = tmp_path / "engine", tmp_path / "elsewhere"
    mine.mkdir()
    other.mkdir()
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    data.tofile(mine / "a.bin")
    data.tofile(other / "b.bin")
    a = np.memmap(mine / "a.bin", dtype=np.float32, mode="r")
    b = np.memmap(other / "b.bin", dtype=np.float32, mode="r")
    assert float(a.sum()) == float(b.sum()) == float(data.sum())  # every page read
    assert mapped_rss(mine) >= 0.9 * data.nbytes
    released = release_mapped(mine)
    assert released >= 0.9 * data.nbytes
    assert mapped_rss(mine) <= 64 * 1024  # gone from the process ...
    assert mapped_rss(other) >= 0.9 * data.nbytes  # ... and only under that folder
    np.testing.assert_array_equal(a, data)  # read back from the page cache


@linux_only
def test_mapped_rss_of_one_file_counts_that_file_alone(tmp_path: Path) -> None:
    """What Q8_0 kernel layers read in place is the GGUF itself (``bench/model_decode.py`` counts it)."""
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    data.tofile(tmp_path / "m.gguf")
    data.tofile(tmp_path / "m.gguf2")  # a name the first one's is a prefix of
    a = np.memmap(tmp_path / "m.gguf", dtype=np.float32, mode="r")
    b = np.memmap(tmp_path / "m.gguf2", dtype=np.float32, mode="r")
    assert float(a.sum()) == float(b.sum())  # every page read
    assert 0.9 * data.nbytes <= mapped_rss(tmp_path / "m.gguf") <= 1.1 * data.nbytes
    assert mapped_rss(tmp_path) >= 1.8 * data.nbytes  # (the folder: both)


def test_a_mapping_with_private_copies_of_written_pages_is_left_alone(tmp_path: Path) -> None:
    """``MADV_DONTNEED`` would discard a copy-on-write mapping's written pages: such a mapping is skipped."""
    np.arange(1 << 18, dtype=np.float32).tofile(tmp_path / "c.bin")
    c = np.memmap(tmp_path / "c.bin", dtype=np.float32, mode="c")
    float(c.sum())
    c[0] = -1.0  # a private copy of that page
    assert release_mapped(tmp_path) == 0
    assert c[0] == -1.0 and mapped_rss(tmp_path) > 0


@linux_only
def test_a_long_step_releases_the_engine_files_pages_and_outputs_stay_the_same(tmp_path: Path) -> None:
    """A step of ``TRIM_ROWS`` rows or more over 8-bit layers runs their long variants, which read the
    engine layout's file in place; the step ends with those pages released (``LayerStack.forward_batch``
    -> ``trim_after`` -> ``release_mapped``), and the steps after it give the same outputs."""
    path = write_tiny_gguf(tmp_path / "t.gguf", TinySpec(types=("Q8_0",), n_layers=2, d_model=512, d_ff=1536,
                                                          n_heads=8, n_kv_heads=4, context_length=512,
                                                          name="t8", seed=3))
    store = open_weight_store(path, cache_root=tmp_path / "cache")
    (stack,) = load_layer_stacks([(0, 1)], store, Engine("cpu", 1, ACCURACY_AUTO, long_prefill=True))
    engine_dir = store.directory / "engine"
    files = sum(f.stat().st_size for f in engine_dir.glob("*.bin"))
    x = np.random.default_rng(0).standard_normal((TRIM_ROWS + 8, 512)).astype(np.float32)
    before = stack.forward(x[:1], np.array([0]), stack.new_kv_cache())  # [1, d] a decode step
    kv = stack.new_kv_cache()
    stack.forward(x, np.arange(len(x)), kv)  # the long variants read the weights in place
    assert mapped_rss(engine_dir) <= 0.05 * files, (mapped_rss(engine_dir), files)
    after = stack.forward(x[:1], np.array([0]), stack.new_kv_cache())
    np.testing.assert_array_equal(before, after)
    stack._mapped = ()  # without the release the long step's pages stay
    stack.forward(x, np.arange(len(x)), stack.new_kv_cache())
    assert mapped_rss(engine_dir) >= 0.5 * files


@linux_only
def test_a_stack_without_long_variants_keeps_the_pages_its_kernels_read(tmp_path: Path) -> None:
    """4-bit layers have no long variant (nothing reads their weights in place beyond what every step reads,
    such as Q4_1's scales): a long step does not release their pages, which the next step would fault back
    in (+2.5 ms on SmolLM2)."""
    path = write_tiny_gguf(tmp_path / "t.gguf", TinySpec(types=("Q4_1",), n_layers=2, context_length=512,
                                                          name="t4", seed=4))
    store = open_weight_store(path, cache_root=tmp_path / "cache")
    (stack,) = load_layer_stacks([(0, 1)], store, Engine("cpu", 1, ACCURACY_AUTO, long_prefill=True))
    engine_dir = store.directory / "engine"
    assert mapped_rss(engine_dir) <= 64 * 1024  # released once, at load
    x = np.random.default_rng(0).standard_normal((TRIM_ROWS, store.config.d_model)).astype(np.float32)
    stack.forward(x, np.arange(len(x)), stack.new_kv_cache())
    assert mapped_rss(engine_dir) > 64 * 1024  # the scales and minimums the step read stay
