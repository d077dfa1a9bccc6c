"""``ethen.model.heap``: only long steps trim (a decode step's buffers are small and reused), and loading
layers ends with a trim."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ethen.model import open_weight_store, qmodel
from ethen.model.engine import ACCURACY_AUTO, Engine
from ethen.model.heap import TRIM_ROWS, trim, trim_after
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
