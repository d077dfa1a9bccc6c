"""Give the C heap's free pages back to the operating system after a long step.

A prefill's intermediate buffers (onnxruntime's, NumPy's: tens of MB each at 512 rows) are freed when the
step ends, but glibc's malloc keeps most of that memory in the process: it raises its mmap threshold after
freeing a large mapped block, so the next large buffers come from the heap, and freed heap pages stay
resident. Measured, SmolLM2's 20 layers after a 512-row prefill: 202-264 MiB of anonymous memory, 148 MiB
after ``malloc_trim(0)``, which took 1.7-8.4 ms (``bench/model_decode.py`` prefill is ~2 s). Decode steps
do not call it (their buffers are small and reused). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["TRIM_ROWS", "trim", "trim_after"]

#: a step of at least this many rows is followed by a trim (a prefill; a decode step has one row per session)
TRIM_ROWS = 128


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_after(rows: int) -> bool:
    """After a step of ``rows`` rows: return the heap's free pages to the OS when the step was long
    (:data:`TRIM_ROWS`). True when it trimmed."""
    return rows >= TRIM_ROWS and trim()


def trim() -> bool:
    """Return the heap's free pages to the OS now (after loading layers: the packing's temporary arrays,
    ~6 MiB of 81 for SmolLM2's 20 layers). True when it trimmed."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
