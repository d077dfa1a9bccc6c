"""Shared, session-scoped model fixtures: the weights are loaded (mmap) once per test session."""

from __future__ import annotations

import pytest

from ethen.model import Model, WeightStore, load_model, open_weight_store


@pytest.fixture(scope="session")
def store() -> WeightStore:
    return open_weight_store()


@pytest.fixture(scope="session")
def model(store: WeightStore) -> Model:
    return load_model(store)
