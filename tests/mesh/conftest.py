"""Mesh tests run the NumPy model in the test process (in-process workers, the orchestrator's head, the
single-process reference): BLAS is limited to one thread there, as in ``tests/model`` (spinning OpenBLAS
threads made decode-heavy tests several times slower on the shared 2-core machine). Worker processes get the
same setting from :func:`ethen.mesh.worker.launch.worker_env`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # dev extra not installed: run with the BLAS defaults
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield
