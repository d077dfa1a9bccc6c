"""``ethen worker --max-memory SIZE``: refuse, before loading, fragments whose layers' bytes exceed SIZE.

A layer's bytes are its tensors' bytes in the GGUF: what the ggml engine holds resident (it reads them in
place), and the order of what the onnxruntime engine holds (its packed copy, 1.0-1.4x). The KV cache has its
own cap (``--max-cache-mb``).

:func:`resident_bytes` is the process's resident set (``VmRSS``): the worker logs it just before its layers
load (``resident N bytes before loading layers`` on stderr), so what the layers cost can be measured from
outside (``tests/mesh/test_capped_workers.py`` reads ``/proc/<pid>/status`` after a generation)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (no NumPy import here: the worker's command imports it after its BLAS defaults)
    from ethen.model.gguf_loader import TensorInfo

__all__ = ["fragment_bytes", "memory_refusal", "parse_size", "resident_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"300M"``, ``"1.5GiB"``, ``"2g"``, ``"123456"`` -> bytes (K/M/G/T: powers of 1000, KiB/MiB/GiB/TiB:
    of 1024); ValueError naming the value otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--max-memory {text!r}: use a positive size like 800M, 1.5G or 512MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def fragment_bytes(tensors: Mapping[str, TensorInfo], fragments: Sequence[tuple[int, int]]) -> int:
    """Bytes in the GGUF of the layers of ``fragments`` (inclusive ranges)."""
    layers = {i for lo, hi in fragments for i in range(lo, hi + 1)}
    total = 0
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) in layers:
            total += t.nbytes
    return total


def memory_refusal(tensors: Mapping[str, TensorInfo], fragments: Sequence[tuple[int, int]],
                   limit: int) -> str | None:
    """The refusal message when the fragments' layers exceed ``limit`` bytes, else None."""
    need = fragment_bytes(tensors, fragments)
    if need <= limit:
        return None
    layers = ",".join(f"{lo}-{hi}" for lo, hi in fragments)
    return (f"layers {layers} hold {need / 2**20:.1f} MiB ({need} bytes) of weights, over --max-memory "
            f"{limit / 2**20:.1f} MiB ({limit} bytes): serve fewer layers on this worker")


def resident_bytes(status: str = "/proc/self/status") -> int | None:
    """``VmRSS`` of ``status`` (a ``/proc/<pid>/status`` file) in bytes; None where there is none (not
    Linux)."""
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # "VmRSS:  123456 kB"
    except OSError:
        return None
    return None
