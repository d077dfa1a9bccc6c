"""The few ONNX protobuf messages the engine's graphs need, written straight in the protobuf wire format.

Why not the ``onnx`` package: importing it costs ~1.1-1.4 s of CPU per process here (it imports
``ml_dtypes``, whose extension alone took 0.9 s of user time), paid by every worker and by the orchestrator
on each ``ethen up`` (three workers: ~4 s of a ~14 s start on the 2-core VM). The graphs use a handful of
fields (ONNX's ``onnx.proto``, field numbers below), so writing them is a few lines; the tests check that
``onnx`` parses the bytes into the same model :mod:`onnx.helper` builds.

Only what :mod:`ethen.model.engine` uses: float32 ``[N, cols]`` inputs and outputs, nodes with int, float or
int-list attributes, and tensors given as raw little-endian bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

__all__ = ["DTYPES", "Node", "Tensor", "model_bytes"]

#: numpy dtype name -> ONNX TensorProto.DataType
DTYPES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7,
          "float16": 10, "float64": 11}
BFLOAT16 = 16
_FLOAT = 1


@dataclass(slots=True)
class Node:
    op_type: str
    inputs: list[str]
    outputs: list[str]
    domain: str = ""
    attrs: dict[str, int | float | list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class Tensor:
    name: str
    dims: tuple[int, ...]
    data_type: int
    raw: bytes
    # (file name, offset, length) of the data in an external file (``Engine.session``'s backing), not here
    external: tuple[str, int, int] | None = None

    @classmethod
    def of(cls, name: str, arr: NDArray[np.generic], data_type: int | None = None) -> Tensor:
        """``arr`` as an initializer (its dtype's ONNX type unless ``data_type`` is given)."""
        a = np.ascontiguousarray(arr)
        kind = DTYPES[a.dtype.name] if data_type is None else data_type
        return cls(name, tuple(int(d) for d in a.shape), kind, a.astype(a.dtype.newbyteorder("<")).tobytes())


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf writes it (two's complement, 10 bytes when negative)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _int(fieldno: int, n: int) -> bytes:
    return _varint(fieldno << 3) + _varint(n)


def _bytes(fieldno: int, data: bytes) -> bytes:
    return _varint(fieldno << 3 | 2) + _varint(len(data)) + data


def _str(fieldno: int, s: str) -> bytes:
    return _bytes(fieldno, s.encode())


def _attribute(name: str, value: int | float | list[int]) -> bytes:
    if isinstance(value, int):  # (a bool is an int)
        return _str(1, name) + _int(3, int(value)) + _int(20, 2)  # i, type INT
    if isinstance(value, float):
        return _str(1, name) + _varint(2 << 3 | 5) + struct.pack("<f", value) + _int(20, 1)  # f, FLOAT
    return _str(1, name) + b"".join(_int(8, v) for v in value) + _int(20, 7)  # ints, INTS


def _node(n: Node) -> bytes:
    out = b"".join(_str(1, i) for i in n.inputs) + b"".join(_str(2, o) for o in n.outputs)
    out += _str(4, n.op_type)
    out += b"".join(_bytes(5, _attribute(k, v)) for k, v in sorted(n.attrs.items()))  # as onnx.helper
    return out + (_str(7, n.domain) if n.domain else b"")


def _tensor(t: Tensor) -> bytes:
    head = b"".join(_int(1, d) for d in t.dims) + _int(2, t.data_type) + _str(8, t.name)
    if t.external is not None:  # external_data {location, offset, length} + data_location EXTERNAL
        name, offset, length = t.external
        entries = (("location", name), ("offset", str(offset)), ("length", str(length)))
        return head + b"".join(_bytes(13, _str(1, k) + _str(2, v)) for k, v in entries) + _int(14, 1)
    return head + _bytes(9, t.raw)


def _value_info(name: str, dims: Sequence[int | str]) -> bytes:
    shape = b"".join(_bytes(1, _str(2, d) if isinstance(d, str) else _int(1, d)) for d in dims)
    tensor_type = _int(1, _FLOAT) + _bytes(2, shape)
    return _str(1, name) + _bytes(2, _bytes(1, tensor_type))


Dims = Sequence[int | str]


def model_bytes(name: str, nodes: Sequence[Node], inits: Sequence[Tensor], inputs: Sequence[tuple[str, Dims]],
                outputs: Sequence[tuple[str, Dims]], opsets: Sequence[tuple[str, int]],
                ir_version: int) -> bytes:
    """A serialized ``ModelProto``: float32 ``inputs`` / ``outputs`` as ``(name, dims)``, ``opsets`` as
    ``(domain, version)``."""
    graph = b"".join(_bytes(1, _node(n)) for n in nodes) + _str(2, name)
    graph += b"".join(_bytes(5, _tensor(t)) for t in inits)
    graph += b"".join(_bytes(11, _value_info(n, d)) for n, d in inputs)
    graph += b"".join(_bytes(12, _value_info(n, d)) for n, d in outputs)
    out = _int(1, ir_version) + _bytes(7, graph)
    return out + b"".join(_bytes(8, _str(1, dom) + _int(2, ver)) for dom, ver in opsets)
