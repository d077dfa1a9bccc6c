"""Which model file a mesh process serves: a cheap fingerprint of a GGUF, compared through ``Health``.

:func:`model_fingerprint` is the SHA-256 of the file's header, metadata and tensor infos (everything before
the tensor data: architecture, shapes, tensor types and offsets, tokenizer, chat template) followed by the
file size as decimal text. It reads only that prefix (1.8 MB of SmolLM2's 98 MB file, a few ms), never the
weights: two files that differ only inside the tensor data (e.g. the same model re-quantized to the same
types with different values, or random weights from another seed) get the same fingerprint. That is the
price of not hashing gigabytes at every worker start; every file that differs in architecture, shape,
tensor type, vocabulary, template, name or size is told apart.

A worker reports it in ``HealthResponse.model_sha256``; the orchestrator compares it with its own file's and
routes no request to a worker that serves another file (:mod:`ethen.mesh.orchestrator.telemetry`).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path

__all__ = ["model_fingerprint"]

_MAGIC = b"GGUF"
# GGUF value types -> fixed size in bytes (8: string, 9: array are variable)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 32  # bounds every declared count: a corrupt header fails, never loops for hours


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"GGUF {self.path}: truncated header (offset {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return int(value)

    def count(self) -> int:
        n = self.take("<Q")
        if n > _MAX_COUNT:
            raise ValueError(f"GGUF {self.path}: implausible count {n} at offset {self.pos - 8}")
        return n

    def skip(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise ValueError(f"GGUF {self.path}: truncated header (offset {self.pos})")
        self.pos += size

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.skip(_FIXED[kind])
        elif kind == _STRING:
            self.skip(self.count())
        elif kind == _ARRAY:
            item = self.take("<I")
            n = self.count()
            if item in _FIXED:
                self.skip(_FIXED[item] * n)
            else:
                for _ in range(n):
                    self.skip_value(item)
        else:
            raise ValueError(f"GGUF {self.path}: unknown value type {kind} at offset {self.pos}")


def _header_end(buf: mmap.mmap, path: Path) -> int:
    """Offset just past the last tensor info."""
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path)
    cur.skip(4)
    version = cur.take("<I")
    if version < 2:
        raise ValueError(f"GGUF {path}: version {version} is not supported (2 or later)")
    n_tensors, n_kv = cur.count(), cur.count()
    for _ in range(n_kv):
        cur.skip(cur.count())  # key
        cur.skip_value(cur.take("<I"))
    for _ in range(n_tensors):
        cur.skip(cur.count())  # name
        cur.skip(8 * cur.take("<I"))  # dims
        cur.skip(4 + 8)  # type, offset
    return cur.pos


def model_fingerprint(path: str | Path) -> str:
    """``sha256:<hex>`` of the GGUF's header + metadata + tensor infos and its size (module docstring).
    Raises ``ValueError`` (naming the file) for a file that is not a readable GGUF, ``OSError`` if
    unreadable."""
    p = Path(path)
    with open(p, "rb") as fh:
        size = p.stat().st_size
        if size < 24:
            raise ValueError(f"GGUF {p}: truncated header ({size} bytes)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            end = _header_end(buf, p)
            digest = hashlib.sha256(buf[:end])
    digest.update(f"\nsize={size}".encode())
    return f"sha256:{digest.hexdigest()}"
