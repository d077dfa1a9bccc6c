"""The ggml engine on any device of ggml's backends: :class:`BackendEngine` runs the layers' and the head's
graphs (:class:`~ethen.model.glayer.GgmlLayer`, :class:`~ethen.model.gqhead.GgmlEmbedAndHead`: the same
graph-building code) on a device of the installed libggml's backend registry (``libggml.so``): a CUDA,
Metal or Vulkan GPU where the libggml build has that backend (``libggml-<name>.so``; the ``libggml-python``
wheel is a CPU build), or the CPU backend's own device (``BackendEngine("CPU")``, the generic API's path a
GPU takes but for the device: what the tests compare with the direct CPU engine).

At load a fragment's weights are copied from the mapped GGUF into one buffer of the device's buffer type
(``ggml_backend_alloc_ctx_tensors_from_buft`` + ``ggml_backend_tensor_set``, as the CPU engine's
``CPU_REPACK`` buffer; :attr:`BackendEngine.buffer_type` tells :class:`~ethen.model.glayer.GgmlWeights`).
A graph is built in a no-alloc context (tensor metadata only), allocated by one graph allocator on the
device's buffer type (``ggml_gallocr``), its inputs copied in (``ggml_backend_tensor_set``), run
(``ggml_backend_graph_compute``) and its outputs copied out (``ggml_backend_tensor_get``). RoPE, the KV cache
and attention stay on the host as with the CPU engine (:func:`~ethen.model.glayer.ggml_block`), so the
mesh's wire format and replay are the same.

The direct CPU engine (:class:`~ethen.model.glayer.GgmlEngine`: tensors over the map and NumPy arrays, a
persistent thread pool) stays the CPU's engine: on the CPU the generic path only adds copies.
Which device ``--device`` takes is :func:`ethen.model.choose.ggml_device`'s rule; :func:`ggml_engine`
applies it to the devices here.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.choose import GgmlDevice, ggml_device
from ethen.model.engine import default_threads
from ethen.model.ggml_lib import GgmlError, GgmlInitParams, GgmlLib, backends, bind, lib, library_dir
from ethen.model.glayer import GgmlEngine, pool_threads, process_engine

__all__ = ["DEVICE_KINDS", "BackendApi", "BackendEngine", "api", "device_engine", "devices", "ggml_engine"]

F32 = NDArray[np.float32]
#: ``enum ggml_backend_dev_type``'s values, in order (:attr:`ethen.model.choose.GgmlDevice.kind`)
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
_GRAPH_NODES = 32  # (as the CPU engine's graphs: a layer's larger graph has 13 nodes)
_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t


class BackendApi:
    """``libggml.so`` (the backend registry, which loads the backends' libraries) and the generic backend
    functions of ``libggml-base.so`` the engine uses, typed."""

    def __init__(self, g: GgmlLib, directory: Path) -> None:
        try:
            self.registry = ctypes.CDLL(str(directory / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise GgmlError(f"cannot load ggml's backend registry from {directory}: {exc}") from exc
        r, b = self.registry, g.base
        bind(self, [
            (r, "ggml_backend_load_all_from_path", [ctypes.c_char_p], None),
            (r, "ggml_backend_dev_count", [], _SIZE),
            (r, "ggml_backend_dev_get", [_SIZE], _P),
            (r, "ggml_backend_dev_by_name", [ctypes.c_char_p], _P),
            (b, "ggml_backend_dev_name", [_P], ctypes.c_char_p),
            (b, "ggml_backend_dev_description", [_P], ctypes.c_char_p),
            (b, "ggml_backend_dev_type", [_P], ctypes.c_int),
            (b, "ggml_backend_dev_backend_reg", [_P], _P),
            (b, "ggml_backend_reg_name", [_P], ctypes.c_char_p),
            (b, "ggml_backend_dev_init", [_P, ctypes.c_char_p], _P),
            (b, "ggml_backend_dev_buffer_type", [_P], _P),
            (b, "ggml_backend_free", [_P], None),
            (b, "ggml_backend_graph_compute", [_P, _P], ctypes.c_int),
            (b, "ggml_backend_tensor_get", [_P, _P, _SIZE, _SIZE], None),
            (b, "ggml_gallocr_new", [_P], _P),
            (b, "ggml_gallocr_alloc_graph", [_P, _P], ctypes.c_bool),
            (b, "ggml_gallocr_free", [_P], None),
            (b, "ggml_set_input", [_P], None),
            (b, "ggml_set_output", [_P], None),
        ])
        # backends built as loadable libraries (GGML_BACKEND_DL) register here; linked ones already have
        self.ggml_backend_load_all_from_path(str(directory).encode())

    def __getattr__(self, name: str) -> Any:  # the functions set in __init__ (for the type checker)
        raise AttributeError(name)

    def describe(self, dev: int) -> GgmlDevice:
        """Device ``dev`` (a ``ggml_backend_dev_t``) as :class:`~ethen.model.choose.GgmlDevice`."""
        kind = int(self.ggml_backend_dev_type(dev))
        return GgmlDevice(self.ggml_backend_dev_name(dev).decode(),
                          self.ggml_backend_reg_name(self.ggml_backend_dev_backend_reg(dev)).decode(),
                          DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else f"type {kind}",
                          (self.ggml_backend_dev_description(dev) or b"").decode(errors="replace"))


@functools.cache
def api() -> BackendApi:
    """The process's backend registry (loaded on first use, with :func:`~ethen.model.ggml_lib.lib`)."""
    return BackendApi(lib(), library_dir())


def devices() -> tuple[GgmlDevice, ...]:
    """The devices of the installed libggml's backends, in its registry's order (here: ``CPU``); none
    without the wheel."""
    try:
        a = api()
    except GgmlError:
        return ()
    return tuple(a.describe(a.ggml_backend_dev_get(i)) for i in range(int(a.ggml_backend_dev_count())))


class BackendEngine(GgmlEngine):
    """The ggml engine on ggml device ``device`` (its name as :func:`devices` gives it, e.g. ``CUDA0``,
    ``Vulkan0``, ``MTL0``, ``CPU``; case-insensitive) with ``threads`` for the ops its backend runs on the
    CPU (the CPU device's graphs; default :func:`~ethen.model.engine.default_threads`)."""

    def __init__(self, device: str, threads: int | None = None) -> None:
        self.lib = lib()
        self.api = api()
        a = self.api
        dev = a.ggml_backend_dev_by_name(device.encode())
        if not dev:
            raise GgmlError(f"ggml has no device {device!r} (its devices: "
                            f"{', '.join(d.name for d in devices()) or 'none'})")
        self.device = a.describe(dev)
        # (GgmlEngine.__init__ is not called: no CPU thread pool, scratch or work buffers here)
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise GgmlError(f"threads = {threads!r}: must be >= 1")
        self.spin = False
        self.lock = threading.Lock()
        self.backend = int(a.ggml_backend_dev_init(dev, None) or 0)
        if not self.backend:
            raise GgmlError(f"ggml could not start device {self.device.name!r} ({self.device.description})")
        self.buffer_type = int(a.ggml_backend_dev_buffer_type(dev))
        reg = a.ggml_backend_dev_backend_reg(dev)
        set_threads = self.lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
        if set_threads:  # (the CPU backend's, BLAS's)
            ctypes.CFUNCTYPE(None, _P, ctypes.c_int)(set_threads)(self.backend, self.threads)
        self._galloc = int(a.ggml_gallocr_new(self.buffer_type) or 0)
        if not self._galloc:
            raise GgmlError("ggml_gallocr_new failed")
        g = self.lib
        meta = int(g.ggml_graph_overhead_custom(_GRAPH_NODES, False)) + 2 * _GRAPH_NODES * int(
            g.ggml_tensor_overhead()) + 4096
        self._meta = np.empty(meta, np.uint8)  # the graphs' tensor metadata (their data: the allocator's)
        self._inputs: list[tuple[int, F32]] = []

    def __repr__(self) -> str:
        return f"BackendEngine(device={self.device.name!r}, threads={self.threads})"

    def input(self, ctx: int, arr: F32) -> int:
        """A float32 input tensor ``[N, cols]`` copied from ``arr`` (C-contiguous) once allocated."""
        t = int(self.lib.ggml_new_tensor_2d(ctx, 0, arr.shape[1], arr.shape[0]))
        self.api.ggml_set_input(t)
        self._inputs.append((t, arr))
        return t

    def run(self, data_bytes: int, build: Callable[[int], Sequence[int]],
            outputs: Sequence[F32]) -> None:
        """As :meth:`GgmlEngine.run <ethen.model.glayer.GgmlEngine.run>`, on the device (``data_bytes``:
        unused, the allocator sizes the graph)."""
        g, a = self.lib, self.api
        with self.lock:
            ctx = g.ggml_init(GgmlInitParams(self._meta.nbytes, self._meta.ctypes.data, True))
            if not ctx:
                raise GgmlError("ggml_init failed")
            self._inputs = []
            try:
                outs = build(ctx)
                graph = g.ggml_new_graph_custom(ctx, _GRAPH_NODES, False)
                for t in outs:
                    a.ggml_set_output(t)
                    g.ggml_build_forward_expand(graph, t)
                if not a.ggml_gallocr_alloc_graph(self._galloc, graph):
                    raise GgmlError(f"allocating a graph on ggml device {self.device.name!r} failed")
                for t, arr in self._inputs:
                    g.ggml_backend_tensor_set(t, arr.ctypes.data, 0, arr.nbytes)
                status = a.ggml_backend_graph_compute(self.backend, graph)
                if status != 0:
                    raise GgmlError(f"ggml_backend_graph_compute on {self.device.name!r} failed (status "
                                    f"{status})")
                for t, out in zip(outs, outputs, strict=True):
                    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
                    a.ggml_backend_tensor_get(t, dst.ctypes.data, 0, dst.nbytes)
                    if dst is not out:
                        out[...] = dst
            finally:
                self._inputs = []
                g.ggml_free(ctx)

    def close(self) -> None:
        """Free the graph allocator and the device's backend (the engine is unusable after)."""
        with self.lock:
            if self._galloc:
                self.api.ggml_gallocr_free(self._galloc)
                self._galloc = 0
            if self.backend:
                self.api.ggml_backend_free(self.backend)
                self.backend = 0


_LOCK = threading.Lock()
_ENGINES: dict[tuple[str, int], BackendEngine] = {}


def device_engine(device: str, threads: int = 1) -> BackendEngine:
    """The process's engine on ggml device ``device`` with ``threads``, one per device and thread count."""
    with _LOCK:
        key = (device.upper(), threads)
        if key not in _ENGINES:
            _ENGINES[key] = BackendEngine(device, threads)
        return _ENGINES[key]


def ggml_engine(threads: int | None = None, pool: str = "session", device: str = "auto") -> GgmlEngine:
    """The ggml engine for ``--device device`` (:func:`~ethen.model.choose.ggml_device` over
    :func:`devices`): a GPU device's :class:`BackendEngine`, else the direct CPU engine
    (:func:`~ethen.model.glayer.process_engine` of ``threads`` and ``pool``; ``cpu`` reads no registry)."""
    if device == "cpu":
        return process_engine(threads, pool)
    dev = ggml_device(device, devices(), backends())
    if dev is None:
        return process_engine(threads, pool)
    return device_engine(dev.name, pool_threads(threads, pool))
