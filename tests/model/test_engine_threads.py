"""The engine's thread count: the one given (``ethen worker --threads``), else the process's cores up to
``MAX_DEFAULT_THREADS``; no environment variable sets it."""

from __future__ import annotations

import os

import pytest

from ethen.model.engine import MAX_DEFAULT_THREADS, Engine, EngineError, default_threads


def test_default_is_the_cores_this_process_may_use_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_threads() == max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert default_threads() == MAX_DEFAULT_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert default_threads() == 1
    assert Engine("cpu").threads == 1


def test_the_thread_count_is_a_parameter_not_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from ethen.model.qmodel import onnx_engine

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("ETHEN_THREADS", "3")  # (read by nothing any more)
    assert default_threads() == 2 and Engine("cpu").threads == 2
    assert Engine("cpu", 3).threads == 3 and onnx_engine(3).threads == 3
    with pytest.raises(EngineError, match="threads = 0: must be >= 1"):
        Engine("cpu", 0)
