"""Give the C heap's free pages back to the operating system after a long step.

A prefill's intermediate buffers (onnxruntime's, NumPy's: tens of MB each at 512 rows) are freed when the
step ends, but glibc's malloc keeps most of that memory in the process: it raises its mmap threshold after
freeing a large mapped block, so the next large buffers come from the heap, and freed heap pages stay
resident. Measured, SmolLM2's 20 layers after a 512-row prefill: 202-264 MiB of anonymous memory, 148 MiB
after ``malloc_trim(0)``, which took 1.7-8.4 ms (``bench/model_decode.py`` prefill is ~2 s). Decode steps
do not call it (their buffers are small and reused). Elsewhere than glibc it does nothing.

:func:`release_mapped` does the same for the file-backed pages of the engine layout (``<cache>/engine/
*.bin``, which onnxruntime maps): a kernel that reads weights in place (the float32-compute 8-bit kernel of
a long prefill step, ``engine.PREFILL_ROWS``) leaves every page it read resident in the process, 1.1x the
layers' file bytes for TinyLlama-shape Q8_0 layers. ``madvise(MADV_DONTNEED)`` drops them from the process
(they stay in the page cache: the kernel keeps or reclaims them like any cached file); a page read again
faults back in. Measured, 8 such layers, a 512-row prefill then 16 decode steps: process RSS 2.83x the
layers' file bytes after the prefill -> 1.65x (of which ~0.25x is shared libraries), decode 59.4 against
59.9 ms per step, prefill unchanged. Reading ``/proc/self/smaps`` takes ~13 ms in a process with ~930
mappings, and pages a kernel reads on every step (Q4_1's float32 scales) fault back in on the next one
(+2.5 ms for SmolLM2's 30 layers), so a stack releases after long steps only when it has long variants
(:class:`ethen.model.model.LayerStack`); loading layers releases once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["TRIM_ROWS", "mapped_rss", "release_mapped", "trim", "trim_after"]

_MADV_DONTNEED = 4  # Linux

#: a step of at least this many rows is followed by a trim (a prefill; a decode step has one row per session)
TRIM_ROWS = 128


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    try:
        fn = None if libc is None else libc.malloc_trim
    except AttributeError:  # not glibc (musl, macOS): nothing to do
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_after(rows: int, mapped: Iterable[Path] = ()) -> bool:
    """After a step of ``rows`` rows: return the heap's free pages to the OS when the step was long
    (:data:`TRIM_ROWS`), and release the pages of files under each of ``mapped`` (:func:`release_mapped`).
    True when it trimmed."""
    if rows < TRIM_ROWS:
        return False
    for directory in mapped:
        release_mapped(directory)
    return trim()


def _file_mappings(directory: Path) -> list[tuple[int, int, int, int]]:
    """``(start, end, Rss bytes, Anonymous bytes)`` of this process's mappings of files under
    ``directory`` (or of the file ``directory`` itself) (``/proc/self/smaps``); empty where there is none."""
    real = os.path.realpath(directory)
    prefix = os.path.join(real, "")
    found: list[list[int]] = []
    mine = False  # the mapping whose fields follow is of a file under ``directory``
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # a mapping: start-end perms offset dev inode [path]
                    fields = rest.split(maxsplit=4)
                    # (a file replaced since it was mapped reads "path (deleted)": it matches too)
                    mine = len(fields) == 5 and (fields[4].startswith(prefix)
                                                 or fields[4].rstrip().removesuffix(" (deleted)") == real)
                    if mine:
                        found.append([int(v, 16) for v in head.split("-")] + [0, 0])
                elif mine and head in ("Rss:", "Anonymous:"):
                    found[-1][2 if head == "Rss:" else 3] = int(rest.split()[0]) * 1024
    except OSError:
        return []
    return [(m[0], m[1], m[2], m[3]) for m in found]


def mapped_rss(directory: Path) -> int:
    """Resident bytes of this process's mappings of files under ``directory`` (or of that file)."""
    return sum(rss for _lo, _hi, rss, _anon in _file_mappings(directory))


def release_mapped(directory: Path) -> int:
    """Drop this process's resident pages of files under ``directory`` (``madvise(MADV_DONTNEED)``; what is
    read again faults back in from the page cache). A mapping holding pages of its own (``Anonymous`` in
    smaps: private copies of written pages, which ``MADV_DONTNEED`` would discard) is left alone. Returns
    the resident bytes released; 0 off Linux."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    if libc is None:
        return 0
    released = 0
    for lo, hi, rss, anon in _file_mappings(directory):
        if rss and not anon and libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            released += rss
    return released


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (with ``madvise`` typed), or None where it cannot be found."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def trim() -> bool:
    """Return the heap's free pages to the OS now (after loading layers: the packing's temporary arrays,
    ~6 MiB of 81 for SmolLM2's 20 layers). True when it trimmed."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
