"""The engine's thread count: ``$ETHEN_THREADS``, else the process's cores up to ``MAX_DEFAULT_THREADS``."""

from __future__ import annotations

import os

import pytest

from ethen.model.engine import MAX_DEFAULT_THREADS, Engine, EngineError, default_threads


def test_default_is_the_cores_this_process_may_use_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETHEN_THREADS", raising=False)
    assert default_threads() == max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert default_threads() == MAX_DEFAULT_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert default_threads() == 1
    assert Engine("cpu").threads == 1


def test_ethen_threads_overrides_and_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_THREADS", "3")
    assert default_threads() == 3 and Engine("cpu").threads == 3
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("ETHEN_THREADS", bad)
        with pytest.raises(EngineError, match=f"ETHEN_THREADS = '{bad}'"):
            default_threads()
