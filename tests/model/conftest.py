"""Shared, session-scoped model fixtures: the weights are loaded (mmap) once per test session.

BLAS is limited to one thread for the model tests: OpenBLAS's worker threads spin while they wait, and on a
shared 2-core machine two of them made the decode-heavy tests ~10x slower (124 s against 14 s measured here).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ethen.model import Model, WeightStore, load_model, open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf


@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # dev extra not installed: run with the BLAS defaults
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def store() -> WeightStore:
    return open_weight_store()


@pytest.fixture(scope="session")
def model(store: WeightStore) -> Model:
    return load_model(store)


ALL_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "F32")
#: The tiny random-weight models (``ethen.model.tiny_gguf``): between them every supported architecture,
#: tensor type, tokenizer kind, tied/untied head and RoPE variant.
TINY_SPECS = {
    "llama-mixed": TinySpec(types=ALL_TYPES, embd_type="Q8_0", name="tiny-llama-mixed"),
    "qwen2": TinySpec(arch="qwen2", types=ALL_TYPES[::-1], embd_type="F16", output_type="Q6_K", n_kv_heads=1,
                      rope_theta=1e6, rms_eps=1e-6, name="tiny-qwen2"),
    "llama-spm-ropefreqs": TinySpec(tokenizer="llama", types=("Q4_K", "Q5_K", "Q6_K"), output_type="F16",
                                    rope_theta=500000.0,
                                    rope_freqs=[1.0] * 12 + [float(f) for f in np.linspace(1, 8, 20)],
                                    name="tiny-llama-spm"),
    "llama-linear": TinySpec(types=("BF16", "Q4_0"), rope_scaling_factor=4.0, n_layers=2, seed=3),
}


@dataclass(frozen=True)
class Tiny:
    path: Path
    spec: TinySpec
    store: WeightStore
    model: Model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    out = {}
    for name, spec in TINY_SPECS.items():
        path = write_tiny_gguf(root / f"{name}.gguf", spec)
        store = open_weight_store(path, cache_root=root / "cache")
        out[name] = Tiny(path, spec, store, load_model(store))
    return out
