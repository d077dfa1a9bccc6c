"""The ctypes structs of :mod:`ethen.model.ggml_lib` against the installed wheel: the headers it ships
(field names, order, array sizes) and the library itself (offsets probed through its API). A wheel whose
layouts differ fails here instead of the engine reading the wrong bytes."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from ethen.model.ggml_lib import (
    GGML_TYPES,
    GgmlCPlan,
    GgmlInitParams,
    GgmlTensor,
    GgmlThreadpoolParams,
    include_dir,
    lib,
)

pytest.importorskip("libggml")


def _header_struct(header: str, name: str) -> list[tuple[str, str | None]]:
    """``(field, array size or None)`` of ``struct name { ... };`` in the wheel's ``header``."""
    text = (include_dir() / header).read_text()
    body = re.search(r"struct " + name + r" \{(.*?)\n\s*\};", text, re.S)
    assert body is not None, f"struct {name} not in {header}"
    out = []
    for line in body.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code or not code.endswith(";"):
            continue
        m = re.search(r"\**(\w+)\s*(?:\[([^\]]+)\])?\s*;$", code)
        assert m is not None, code
        out.append((m.group(1), m.group(2)))
    return out


def _defines() -> dict[str, int]:
    text = (include_dir() / "ggml.h").read_text()
    return {k: int(v) for k, v in re.findall(r"#\s*define (GGML_MAX_\w+)\s+(\d+)", text)}


@pytest.mark.parametrize(("header", "name", "struct"), [
    ("ggml.h", "ggml_tensor", GgmlTensor), ("ggml.h", "ggml_init_params", GgmlInitParams),
    ("ggml-cpu.h", "ggml_cplan", GgmlCPlan), ("ggml.h", "ggml_threadpool_params", GgmlThreadpoolParams)])
def test_struct_fields_match_the_headers(header: str, name: str, struct: type[ctypes.Structure]) -> None:
    want = _header_struct(header, name)
    got = [f[0] for f in struct._fields_]
    assert [w[0] for w in want] == got
    defines = _defines()
    for (field, size), (_, ctype) in zip(want, struct._fields_, strict=True):
        if size is None:
            continue
        if size in defines:
            n = defines[size]
        elif size.isdigit():
            n = int(size)
        else:  # op_params: GGML_MAX_OP_PARAMS / sizeof(int32_t)
            assert size == "GGML_MAX_OP_PARAMS / sizeof(int32_t)", size
            n = defines["GGML_MAX_OP_PARAMS"] // 4
        assert ctype._length_ == n, field


def test_type_enum_matches_the_header() -> None:
    text = (include_dir() / "ggml.h").read_text()
    enum = dict(re.findall(r"GGML_TYPE_(\w+)\s*=\s*(\d+),", text))
    for name, value in GGML_TYPES.items():
        assert int(enum[name]) == value, name


def test_tensor_offsets_probed_through_the_library() -> None:
    g = lib()
    assert g.ggml_tensor_overhead() == ctypes.sizeof(GgmlTensor) + 32  # + sizeof(struct ggml_object)
    buf = np.zeros(1 << 16, np.uint8)
    ctx = g.ggml_init(GgmlInitParams(buf.nbytes, buf.ctypes.data, False))
    try:
        t = g.ggml_new_tensor_2d(ctx, GGML_TYPES["Q4_K"], 512, 3)
        g.ggml_set_name(t, b"probe")
        s = g.tensor(t)
        assert s.type == GGML_TYPES["Q4_K"]
        assert list(s.ne) == [512, 3, 1, 1]
        assert s.nb[1] == 2 * 144 and g.ggml_nbytes(t) == 3 * 2 * 144 == s.nb[3]
        assert s.data == g.ggml_get_data(t) and buf.ctypes.data <= s.data < buf.ctypes.data + buf.nbytes
        assert g.ggml_get_name(t) == t + GgmlTensor.name.offset and s.name == b"probe"
        arr = np.zeros(4, np.float32)
        g.set_data(t, arr.ctypes.data)
        assert g.ggml_get_data(t) == arr.ctypes.data
        a = g.ggml_new_tensor_2d(ctx, GGML_TYPES["Q8_0"], 64, 64)
        b = g.ggml_new_tensor_2d(ctx, GGML_TYPES["F32"], 64, 4)
        graph = g.ggml_new_graph_custom(ctx, 8, False)
        g.ggml_build_forward_expand(graph, g.ggml_mul_mat(ctx, a, b))
        pool = g.threadpool(3)
        try:
            plan = g.ggml_graph_plan(graph, 3, pool)
            # b's rows quantized to Q8_0 in the work buffer (4 rows of 2 blocks of 34 bytes, + padding)
            assert plan.n_threads == 3 and plan.threadpool == pool and 4 * 2 * 34 <= plan.work_size < 1 << 16
            assert not plan.use_ref and plan.work_data is None and plan.abort_callback is None
        finally:
            g.ggml_threadpool_free(pool)
    finally:
        g.ggml_free(ctx)
