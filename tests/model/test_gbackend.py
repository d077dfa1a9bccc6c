"""The ggml engine on a device of ggml's backend registry (:mod:`ethen.model.gbackend`) against the direct CPU
engine (:mod:`ethen.model.glayer`) on tiny random models, and the device choice (:func:`ethen.model.choose.
ggml_device`).

On ggml's CPU backend device (``BackendEngine("CPU")``: the generic API's path a GPU takes, but for the
device) the layer outputs are the CPU engine's within 1e-5 of the largest |output| (measured: 0 for Q8_0 /
F16, 3e-7 for Q4_K, whose matrices the CPU engine repacks into its 8x8 kernels' layout and the device's plain
buffer does not) and a greedy generation is the same tokens. On a GPU (where the installed libggml has the
backend; the ``libggml-python`` wheel is a CPU build, so here they skip) the kernels differ (their own
activation quantization and summation order): within 2e-2, the head's logits too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ethen.model import ModelInputError, load_layer_stacks, load_model, open_weight_store
from ethen.model.choose import (
    DEVICES,
    GGML_BACKEND_NAMES,
    EngineOptions,
    GgmlDevice,
    check_device,
    engine_kind,
    ggml_device,
)
from ethen.model.gbackend import BackendEngine, device_engine, devices, ggml_engine
from ethen.model.ggml_lib import backends
from ethen.model.gguf_loader import WeightStore
from ethen.model.glayer import GgmlEngine, GgmlLayer, process_engine
from ethen.model.gqhead import GgmlEmbedAndHead
from ethen.model.model import engine_for
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf

pytest.importorskip("libggml")

PROMPT = list(range(3, 40))
CPU_TOLERANCE = 1e-5
GPU_TOLERANCE = 2e-2


def _store(tmp_path: Path, kind: str) -> WeightStore:
    spec = TinySpec(arch="llama", types=(kind,), embd_type="Q8_0", name=f"tiny-{kind}", quantizer="ggml")
    path = write_tiny_gguf(tmp_path / f"{kind}.gguf", spec)
    return open_weight_store(path, cache_root=tmp_path / "cache")


def _greedy(model: object, n: int = 8) -> list[int]:
    kv = model.new_kv_cache()  # type: ignore[attr-defined]
    logits, out = model.logits(PROMPT[:12], kv), []  # type: ignore[attr-defined]
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.logits([out[-1]], kv)  # type: ignore[attr-defined]
    return out


def _compare(store: WeightStore, engine: BackendEngine, tolerance: float) -> None:
    """Layer outputs (a 9-row prefill, then 3 decode rows) and the head's logits of ``engine`` against the
    direct CPU engine's."""
    cpu = process_engine(1)
    ours, ref = (load_layer_stacks("0-2", store, e)[0] for e in (engine, cpu))
    assert all(isinstance(w, GgmlLayer) and w.weights.engine is engine for w in ours.layers)
    x = np.random.default_rng(2).standard_normal((12, store.config.d_model)).astype(np.float32)
    kv_o, kv_r = ours.new_kv_cache(), ref.new_kv_cache()
    steps = [(0, 9), (9, 10), (10, 11), (11, 12)]
    for lo, hi in steps:
        o = ours.forward(x[lo:hi], np.arange(lo, hi), kv_o)
        r = ref.forward(x[lo:hi], np.arange(lo, hi), kv_r)
        assert float(np.abs(o - r).max()) <= tolerance * float(np.abs(r).max()), (lo, hi)
    heads = [GgmlEmbedAndHead(store, e) for e in (engine, cpu)]
    lo_o, lo_r = (h.logits(x[:5]) for h in heads)
    assert float(np.abs(lo_o - lo_r).max()) <= tolerance * float(np.abs(lo_r).max())


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "F16"])
def test_the_cpu_backend_device_gives_the_cpu_engines_outputs(tmp_path: Path, kind: str) -> None:
    store = _store(tmp_path, kind)
    engine = BackendEngine("CPU", 1)
    assert engine.device.kind == "cpu" and engine.buffer_type
    _compare(store, engine, CPU_TOLERANCE)
    stack = load_layer_stacks("0-2", store, engine)[0]
    held = {w.weights.repacked_bytes for w in stack.layers if isinstance(w, GgmlLayer)}
    assert held == {sum(store.tensors[f"blk.{i}.{n}.weight"].nbytes for i in range(3) for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"))
        + 3 * 2 * 4 * store.config.d_model}  # the matrices and the norms, in the device's buffer


def test_a_greedy_generation_on_the_cpu_device_is_the_cpu_engines(tmp_path: Path) -> None:
    store = _store(tmp_path, "Q4_K")
    engine = device_engine("cpu", 1)
    assert device_engine("CPU", 1) is engine and repr(engine) == "BackendEngine(device='CPU', threads=1)"
    ours = load_model(store, engine)
    assert isinstance(ours.ends, GgmlEmbedAndHead) and ours.ends.engine is engine
    assert _greedy(ours) == _greedy(load_model(store, process_engine(1)))


def test_an_unknown_device_is_refused_naming_ggmls_devices() -> None:
    from ethen.model.ggml_lib import GgmlError

    with pytest.raises(GgmlError, match=r"ggml has no device 'TPU0' \(its devices: CPU"):
        BackendEngine("TPU0")


@pytest.mark.parametrize("device", ["cuda", "vulkan", "metal"])
def test_each_gpu_backend_gives_the_cpu_engines_outputs(tmp_path: Path, device: str) -> None:
    if device not in backends():
        pytest.skip(f"no libggml-{device}.so: the libggml-python wheel is a CPU build")
    dev = ggml_device(device, devices(), backends())
    assert dev is not None and dev.backend in GGML_BACKEND_NAMES[device]
    engine = ggml_engine(1, "session", device)
    assert isinstance(engine, BackendEngine) and engine.device == dev
    for kind in ("Q4_K", "Q8_0", "F16"):
        _compare(_store(tmp_path, kind), engine, GPU_TOLERANCE)
    assert engine_kind({}, EngineOptions(device=device), devices()) == "ggml"  # (cuda too: ggml has it)


def test_the_cpu_paths_stay_the_direct_engine(tmp_path: Path) -> None:
    """``--device cpu``, and ``auto`` where ggml has no GPU (here), keep the direct CPU engine; the registry
    here has the CPU backend's device only."""
    store = _store(tmp_path, "Q8_0")
    assert type(ggml_engine(1, "session", "cpu")) is GgmlEngine
    if not any(d.kind in ("gpu", "igpu") for d in devices()):
        assert ggml_engine(1, "session", "auto") is process_engine(1)
        ggml = EngineOptions(engine="ggml")
        assert type(engine_for(store, options=ggml)) is GgmlEngine
        layers = load_layer_stacks("0-0", store, options=ggml)[0].layers
        assert all(isinstance(w, GgmlLayer) and type(w.weights.engine) is GgmlEngine for w in layers)
    assert [d.name for d in devices() if d.kind == "cpu"] == ["CPU"]


def test_a_missing_gpu_backend_is_refused_naming_it(tmp_path: Path) -> None:
    """``metal`` / ``vulkan`` pass ``check_device`` where the backend is installed (they were refused as
    "not used yet"), and are refused naming the missing ``libggml-<x>.so`` where it is not; ``cuda`` with the
    ggml engine likewise; with the onnx engine ``metal`` / ``vulkan`` are refused."""
    check_device("vulkan", installed=("cpu", "vulkan"))
    check_device("metal", installed=("metal",))
    missing = r"device 'vulkan' needs a libggml build with the Vulkan backend \(libggml-vulkan.so\); the "
    with pytest.raises(ModelInputError, match=missing + "installed ggml backends: cpu"):
        check_device("vulkan", installed=("cpu",))
    with pytest.raises(ModelInputError, match="device 'tpu' is not one of auto, cpu, cuda, metal, vulkan"):
        check_device("tpu")
    cpu = (GgmlDevice("CPU", "CPU", "cpu"),)
    with pytest.raises(ModelInputError, match=r"device 'cuda' needs a libggml build with the CUDA backend "
                                              r"\(libggml-cuda.so\); the installed ggml backends: cpu"):
        ggml_device("cuda", cpu, ("cpu",))
    with pytest.raises(ModelInputError, match=r"device 'cuda': ggml's CUDA backend found no device \(ggml's "
                                              r"devices: CPU\)"):
        ggml_device("cuda", cpu, ("cpu", "cuda"))
    with pytest.raises(ModelInputError, match="device 'vulkan' runs on the ggml engine only"):
        engine_kind({}, EngineOptions(engine="onnx", device="vulkan"))
    if "cuda" not in backends():
        store = _store(tmp_path, "Q8_0")
        with pytest.raises(ModelInputError, match=r"device 'cuda' needs a libggml build with the CUDA"):
            load_layer_stacks("0-0", store, options=EngineOptions(engine="ggml", device="cuda"))
        assert engine_kind(store.tensors, EngineOptions(device="cuda"), devices()) == "onnx"  # as before


# -- the device choice (pure) against a brute-force oracle -----------------------------------------------

_BACKENDS = ("CPU", "CUDA", "Vulkan", "MTL", "Metal", "BLAS", "RPC")
_devices = st.lists(st.builds(lambda b, k, i: GgmlDevice(f"{b}{i}", b, k), st.sampled_from(_BACKENDS),
                              st.sampled_from(("cpu", "gpu", "igpu", "accel", "meta")),
                              st.integers(0, 3)), max_size=6)
_installed = st.lists(st.sampled_from(("cpu", "cuda", "vulkan", "metal", "blas")), unique=True)


def _oracle(device: str, available: list[GgmlDevice]) -> GgmlDevice | str | None:
    """Every device scored, the best kept (lowest score, then earliest); "refused" where none may serve."""
    if device == "cpu":
        return None
    if device == "auto":
        scored = [({"gpu": 0, "igpu": 1}[d.kind], i, d) for i, d in enumerate(available)
                  if d.kind in ("gpu", "igpu")]
        return min(scored, key=lambda s: (s[0], s[1]))[2] if scored else None
    names = {"cuda": {"CUDA"}, "metal": {"MTL", "Metal"}, "vulkan": {"Vulkan"}}[device]
    ok = [d for d in available if d.backend in names]
    return ok[0] if ok else "refused"


@given(st.sampled_from(DEVICES), _devices, _installed)
def test_the_device_choice_matches_the_oracle(device: str, available: list[GgmlDevice],
                                              installed: list[str]) -> None:
    want = _oracle(device, available)
    if want == "refused":
        with pytest.raises(ModelInputError, match=f"device {device!r}"):
            ggml_device(device, available, installed)
        return
    got = ggml_device(device, available, installed)
    assert got is want or got == want
    if got is not None:  # a GPU-kind device for auto, the named backend's otherwise
        assert got.kind in ("gpu", "igpu") if device == "auto" else got.backend in GGML_BACKEND_NAMES[device]


@given(_devices)
def test_cuda_takes_ggml_where_ggml_has_a_cuda_device(available: list[GgmlDevice]) -> None:
    kind = engine_kind({}, EngineOptions(device="cuda"), available)
    assert kind == ("ggml" if any(d.backend == "CUDA" for d in available) else "onnx")
    assert engine_kind({}, EngineOptions(engine="onnx", device="cuda"), available) == "onnx"
