"""ctypes bindings of the few ggml functions the ggml engine uses (:mod:`ethen.model.glayer`), over the
shared libraries the ``libggml-python`` wheel ships (``libggml/lib64/libggml-base.so``, ``libggml-cpu.so``:
llama.cpp's CPU kernels, prebuilt, MIT).

The structs mirror ``libggml/include/ggml.h`` / ``ggml-cpu.h`` of the pinned wheel (0.20.2):
``tests/model/test_ggml_lib.py`` reads those headers and probes the library (``ggml_get_data``,
``ggml_nbytes``, ``ggml_get_name``, ``ggml_tensor_overhead``) so that a wheel whose layouts differ fails a
test instead of reading the wrong bytes.

What is used: contexts over caller-owned memory (``ggml_init`` with ``mem_buffer``), 2-D tensors whose
``data`` the caller points anywhere (the memory-mapped GGUF, NumPy arrays), ``ggml_mul_mat`` /
``ggml_rms_norm`` / ``ggml_mul`` / ``ggml_add`` / ``ggml_swiglu_split``, graphs run with
``ggml_graph_plan`` + ``ggml_graph_compute`` over a caller-owned work buffer and a persistent thread pool
(``ggml_graph_compute_with_ctx`` grows its context on every call).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np

from ethen.model.errors import ModelError

__all__ = ["GGML_TYPES", "MAX_DIMS", "MAX_NAME", "MAX_OP_PARAMS", "MAX_SRC", "GgmlCPlan", "GgmlError",
           "GgmlInitParams", "GgmlLib", "GgmlTensor", "backends", "bind", "include_dir", "lib", "library_dir"]

MAX_DIMS = 4
MAX_SRC = 10
MAX_OP_PARAMS = 64
MAX_NAME = 64
MAX_N_THREADS = 512

#: ``enum ggml_type`` values of the GGUF tensor types (names as :class:`gguf.GGMLQuantizationType`'s)
GGML_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
    "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19,
    "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "BF16": 30, "TQ1_0": 34, "TQ2_0": 35,
    "MXFP4": 39,
}


class GgmlError(ModelError):
    """ggml is not installed or refused (a failed graph compute, a library whose layout differs)."""


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * MAX_DIMS),
        ("nb", ctypes.c_size_t * MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class GgmlInitParams(ctypes.Structure):
    """``struct ggml_init_params``."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class GgmlCPlan(ctypes.Structure):
    """``struct ggml_cplan`` (ggml-cpu.h)."""

    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class GgmlThreadpoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params``."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


#: offset of ``ggml_tensor.data`` (the field the engine writes)
DATA_OFFSET = GgmlTensor.data.offset


def _package_dir() -> Path:
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlError("the ggml engine needs the libggml-python wheel "
                        "(pip install 'libggml-python>=0.20.2')")
    return Path(next(iter(spec.submodule_search_locations)))


def library_dir() -> Path:
    """``libggml/lib64`` of the installed wheel (its ``lib`` on other layouts)."""
    base = _package_dir()
    for sub in ("lib64", "lib"):
        if (base / sub / "libggml-base.so").exists():
            return base / sub
    raise GgmlError(f"no libggml-base.so under {base}")


def backends() -> tuple[str, ...]:
    """The ggml backends the installed wheel ships (``libggml-<name>.so`` beside ``libggml-base.so``:
    ``cpu``; a GPU build adds e.g. ``metal``, ``vulkan``, ``cuda``); none without the wheel."""
    try:
        directory = library_dir()
    except GgmlError:
        return ()
    names = {p.name.split(".so")[0].removeprefix("libggml-") for p in directory.glob("libggml-*.so*")}
    return tuple(sorted(names - {"base"}))


def include_dir() -> Path:
    """``libggml/include`` of the installed wheel (its headers)."""
    return _package_dir() / "include"


_P = ctypes.c_void_p
_I64 = ctypes.c_int64


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LOG = logging.getLogger("ethen.model.ggml")
_last_level = [0]


def _log(level: int, text: bytes | None, _user: Any) -> None:
    if level != 5:  # GGML_LOG_LEVEL_CONT: the previous line's level
        _last_level[0] = level
    if _last_level[0] >= 3 and text:  # WARN, ERROR
        _LOG.log(logging.WARNING if _last_level[0] == 3 else logging.ERROR, "ggml: %s",
                 text.decode("utf-8", "replace").rstrip())


def bind(target: object, sig: list[tuple[ctypes.CDLL, str, list[Any], Any]]) -> None:
    """Set each ``(library, name, argtypes, restype)`` function of ``sig`` as attribute ``name`` of
    ``target``, typed."""
    for so, name, args, res in sig:
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, res
        setattr(target, name, fn)


class GgmlLib:
    """The loaded libraries, with ``argtypes`` / ``restype`` set for each function used."""

    def __init__(self, directory: Path) -> None:
        try:
            self.base = ctypes.CDLL(str(directory / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
            self.cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise GgmlError(f"cannot load ggml from {directory}: {exc}") from exc
        b, c = self.base, self.cpu
        sig: list[tuple[ctypes.CDLL, str, list[Any], Any]] = [
            (b, "ggml_init", [GgmlInitParams], _P),
            (b, "ggml_free", [_P], None),
            (b, "ggml_tensor_overhead", [], ctypes.c_size_t),
            (b, "ggml_graph_overhead_custom", [ctypes.c_size_t, ctypes.c_bool], ctypes.c_size_t),
            (b, "ggml_new_tensor_1d", [_P, ctypes.c_int, _I64], _P),
            (b, "ggml_new_tensor_2d", [_P, ctypes.c_int, _I64, _I64], _P),
            (b, "ggml_nbytes", [_P], ctypes.c_size_t),
            (b, "ggml_nrows", [_P], _I64),
            (b, "ggml_nelements", [_P], _I64),
            (b, "ggml_get_data", [_P], _P),
            (b, "ggml_get_name", [_P], _P),
            (b, "ggml_set_name", [_P, ctypes.c_char_p], _P),
            (b, "ggml_row_size", [ctypes.c_int, _I64], ctypes.c_size_t),
            (b, "ggml_blck_size", [ctypes.c_int], _I64),
            (b, "ggml_type_name", [ctypes.c_int], ctypes.c_char_p),
            (b, "ggml_mul_mat", [_P, _P, _P], _P),
            (b, "ggml_add", [_P, _P, _P], _P),
            (b, "ggml_mul", [_P, _P, _P], _P),
            (b, "ggml_rms_norm", [_P, _P, ctypes.c_float], _P),
            (b, "ggml_swiglu_split", [_P, _P, _P], _P),
            (b, "ggml_new_graph_custom", [_P, ctypes.c_size_t, ctypes.c_bool], _P),
            (b, "ggml_build_forward_expand", [_P, _P], None),
            (b, "ggml_quantize_chunk", [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P], ctypes.c_size_t),
            (b, "ggml_threadpool_params_init", [ctypes.POINTER(GgmlThreadpoolParams), ctypes.c_int], None),
            (b, "ggml_backend_reg_dev_get", [_P, ctypes.c_size_t], _P),
            (b, "ggml_backend_reg_get_proc_address", [_P, ctypes.c_char_p], _P),
            (b, "ggml_backend_buft_name", [_P], ctypes.c_char_p),
            (b, "ggml_backend_alloc_ctx_tensors_from_buft", [_P, _P], _P),
            (b, "ggml_backend_tensor_set", [_P, _P, ctypes.c_size_t, ctypes.c_size_t], None),
            (b, "ggml_backend_buffer_get_size", [_P], ctypes.c_size_t),
            (b, "ggml_backend_buffer_free", [_P], None),
            (c, "ggml_backend_cpu_reg", [], _P),
            (c, "ggml_cpu_init", [], None),
            (c, "ggml_threadpool_new", [ctypes.POINTER(GgmlThreadpoolParams)], _P),
            (c, "ggml_threadpool_free", [_P], None),
            (c, "ggml_graph_plan", [_P, ctypes.c_int, _P], GgmlCPlan),
            (c, "ggml_graph_compute", [_P, ctypes.POINTER(GgmlCPlan)], ctypes.c_int),
        ]
        bind(self, sig)
        # ggml's log (e.g. one INFO line per repacked tensor) into Python's logging: warnings and errors only
        self._log_cb = _LOG_CALLBACK(_log)  # (kept alive with the library)
        b.ggml_log_set.argtypes, b.ggml_log_set.restype = [_LOG_CALLBACK, _P], None
        b.ggml_log_set(self._log_cb, None)
        self.ggml_cpu_init()

    def __getattr__(self, name: str) -> Any:  # the functions set in __init__ (for the type checker)
        raise AttributeError(name)

    def tensor(self, ptr: int) -> GgmlTensor:
        """The struct at ``ptr`` (a view: writes go to ggml's tensor)."""
        return GgmlTensor.from_address(ptr)

    def set_data(self, ptr: int, data: int) -> None:
        """Point tensor ``ptr``'s ``data`` at address ``data``."""
        ctypes.c_void_p.from_address(ptr + DATA_OFFSET).value = data

    def quantize(self, kind: str, values: Any) -> Any:
        """``values [rows, cols]`` float32 quantized to ``kind`` by ggml's own quantizer (llama.cpp's
        ``llama-quantize`` rounding, an all-ones importance matrix) -> ``uint8 [rows, row_bytes]``."""
        src = np.ascontiguousarray(values, dtype=np.float32)
        rows, cols = src.shape
        t = GGML_TYPES[kind]
        out = np.empty((rows, int(self.ggml_row_size(t, cols))), np.uint8)
        ones = np.ones(cols, np.float32)
        self.ggml_quantize_chunk(t, src.ctypes.data, out.ctypes.data, 0, rows, cols, ones.ctypes.data)
        return out

    def extra_buffer_type(self, name: str) -> int | None:
        """The CPU backend's extra buffer type ``name`` (``CPU_REPACK``: weights repacked at load into the
        layouts of ggml's faster kernels), None when this build has none."""
        reg = self.ggml_backend_cpu_reg()
        dev = self.ggml_backend_reg_dev_get(reg, 0)
        addr = self.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not reg or not dev or not addr:
            return None
        bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)(dev)
        i = 0
        while bufts and bufts[i]:
            if self.ggml_backend_buft_name(bufts[i]) == name.encode():
                return int(bufts[i])
            i += 1
        return None

    def threadpool(self, n_threads: int, poll: int | None = None) -> int:
        """A persistent pool of ``n_threads``; ``poll`` (0-100, default ggml's 50): how long its threads
        spin for work after a graph (llama.cpp's ``--poll``) before they sleep; 0: they sleep at once."""
        params = GgmlThreadpoolParams()
        self.ggml_threadpool_params_init(ctypes.byref(params), n_threads)
        if poll is not None:
            params.poll = poll
        pool = self.ggml_threadpool_new(ctypes.byref(params))
        if not pool:
            raise GgmlError(f"ggml_threadpool_new({n_threads}) failed")
        return int(pool)


@functools.cache
def lib() -> GgmlLib:
    """The process's ggml (loaded on first use)."""
    return GgmlLib(library_dir())
