"""Shared, session-scoped model fixtures: the weights are loaded (mmap) once per test session.

BLAS is limited to one thread for the model tests: OpenBLAS's worker threads spin while they wait, and on a
shared 2-core machine two of them made the decode-heavy tests ~10x slower (124 s against 14 s measured here).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ethen.model import Model, WeightStore, load_model, open_weight_store


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
