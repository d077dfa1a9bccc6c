"""``ethen.model.heap.trim_after``: only long steps trim (a decode step's buffers are small and reused)."""

from __future__ import annotations

import sys

import pytest

from ethen.model.heap import TRIM_ROWS, trim, trim_after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_only_a_step_of_trim_rows_or_more_trims() -> None:
    assert trim_after(1) is False
    assert trim_after(TRIM_ROWS - 1) is False
    assert trim_after(TRIM_ROWS) is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_trim_trims_on_glibc() -> None:
    assert trim() is True
