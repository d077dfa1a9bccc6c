"""Which engine runs a model's quantized layers and head: ggml (llama.cpp's kernels,
:mod:`ethen.model.glayer`) or onnxruntime (:mod:`ethen.model.qmodel`), and on which device.

The choice is an :class:`EngineOptions` value, given as a parameter (``ethen worker`` / ``ethen up``
``--engine`` / ``--accuracy`` / ``--device``; nothing here reads the environment). ``engine``: ``ggml``,
``onnx`` or ``auto`` (the default). ``auto`` follows ``accuracy`` first: ``fast`` is ggml (int8
activations, as llama.cpp), ``exact`` onnxruntime (float32-grade products); at accuracy ``auto`` (the
default) a model with a tensor type only ggml reads (``GGML_ONLY_TYPES``) runs on ggml, else the rule
:func:`auto_engine` picks by the model's size.

Devices (:func:`ggml_device`, over the devices the installed libggml's backends offer,
:func:`ethen.model.gbackend.devices`): the ggml engine at ``--device auto`` computes on the best GPU device
ggml has (a discrete GPU over an integrated one, the first of a kind), else on the CPU through the direct CPU
engine (:class:`~ethen.model.glayer.GgmlEngine`); ``--device cpu`` is always that engine. ``--device cuda``,
``metal``, ``vulkan`` with the ggml engine: that backend's first device, refused (naming the missing
``libggml-<device>.so``, :func:`check_device`) when the backend is absent. ``metal`` / ``vulkan`` choose the
ggml engine at ``--engine auto`` (onnxruntime has neither); ``cuda`` chooses ggml where ggml has a CUDA
device, else onnxruntime-gpu as before.

The rule, measured (docs/decisions/0100-ggml-engine.md): int8 activations change SmolLM2-135M's greedy
answer to ``ethen up``'s banner question (llama.cpp's own answer is also wrong there), so a model under
:data:`GGML_MIN_PARAMS` parameters keeps the float32-compute engine; 1B-class models (TinyLlama's shape)
decode 2-4x faster on ggml, where the int8 activations are what llama.cpp serves them with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ethen.model.errors import ModelInputError
from ethen.model.ggml_lib import backends
from ethen.model.gguf_loader import GGML_ONLY_TYPES, TensorInfo

__all__ = ["ACCURACIES", "DEFAULT_OPTIONS", "DEVICES", "ENGINES", "GGML_BACKEND_NAMES", "GGML_MIN_PARAMS",
           "EngineOptions", "GgmlDevice", "auto_engine", "check_device", "check_onnx", "engine_kind",
           "ggml_device", "model_params"]

ENGINES = ("auto", "ggml", "onnx")
#: ``--device`` values: ``cuda`` is ggml's CUDA backend or onnxruntime-gpu's; ``metal`` / ``vulkan`` are ggml
#: backends (:func:`check_device`, :func:`ggml_device`)
DEVICES = ("auto", "cpu", "cuda", "metal", "vulkan")
_GGML_GPUS = {"cuda": "CUDA", "metal": "Metal", "vulkan": "Vulkan"}
#: devices only the ggml engine runs (onnxruntime has neither)
_GGML_ONLY_DEVICES = ("metal", "vulkan")
#: the registry names ggml gives each ``--device``'s backend (its devices: ``CUDA0``, ``MTL0``, ``Vulkan0``)
GGML_BACKEND_NAMES: dict[str, tuple[str, ...]] = {"cuda": ("CUDA",), "metal": ("MTL", "Metal"),
                                                  "vulkan": ("Vulkan",)}
#: ggml device kinds ``--device auto`` takes, best first (``enum ggml_backend_dev_type``'s GPU, IGPU)
_AUTO_KINDS = ("gpu", "igpu")
#: ``--accuracy`` values
ACCURACIES = ("auto", "exact", "fast")
#: ``auto``: models with at least this many parameters run on ggml
GGML_MIN_PARAMS = 500_000_000


@dataclass(frozen=True)
class EngineOptions:
    """What the user chose (``--engine`` / ``--accuracy`` / ``--device``), each ``auto`` by default; a value
    outside :data:`ENGINES` / :data:`ACCURACIES` / :data:`DEVICES` is refused here, naming the flag and the
    value (``exact-int8`` is no longer a user value: ``auto`` runs it for 8-bit blocks on the onnx engine).
    Whether ``device`` is usable is :func:`check_device`'s question."""

    engine: str = "auto"
    accuracy: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ModelInputError(f"--engine {self.engine!r}: must be one of {', '.join(ENGINES)}")
        if self.accuracy not in ACCURACIES:
            hint = " (auto runs exact-int8 where it applies)" if self.accuracy == "exact-int8" else ""
            raise ModelInputError(
                f"--accuracy {self.accuracy!r}: must be one of {', '.join(ACCURACIES)}{hint}")
        if self.device not in DEVICES:
            raise ModelInputError(f"--device {self.device!r}: must be one of {', '.join(DEVICES)}")

    def args(self) -> list[str]:
        """The ``ethen worker`` flags that carry these options (``ethen up``'s worker command lines)."""
        return ["--engine", self.engine, "--accuracy", self.accuracy, "--device", self.device]


#: ``auto`` everywhere: what a caller that chose nothing gets
DEFAULT_OPTIONS = EngineOptions()


@dataclass(frozen=True)
class GgmlDevice:
    """A device of ggml's backend registry: ``name`` as ggml names it (``CPU``, ``CUDA0``, ``Vulkan0``,
    ``MTL0``), its backend's registry name (``CPU``, ``CUDA``, ``Vulkan``, ``MTL``), its ``kind``
    (``cpu``, ``gpu``, ``igpu``, ``accel``, ``meta``) and ggml's description of it."""

    name: str
    backend: str
    kind: str
    description: str = ""


def _missing(device: str, installed: Sequence[str]) -> str:
    return (f"device {device!r} needs a libggml build with the {_GGML_GPUS[device]} backend "
            f"(libggml-{device}.so); the installed ggml backends: {', '.join(installed) or 'none'}")


def check_device(device: str, installed: Sequence[str] | None = None) -> None:
    """Refuse (naming it) a device outside :data:`DEVICES`, and ``metal`` / ``vulkan`` where the installed
    libggml lacks the backend (``installed``: :func:`~ethen.model.ggml_lib.backends`, read when not given;
    the ``libggml-python`` wheel is a CPU build: a build with the device's backend, ``libggml-<device>.so``,
    is named as what is missing; onnxruntime has neither). ``cuda`` is checked where its engine starts
    (:func:`ggml_device`, :class:`~ethen.model.engine.Engine`)."""
    if device not in DEVICES:
        raise ModelInputError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device in _GGML_ONLY_DEVICES:
        have = backends() if installed is None else installed
        if device not in have:
            raise ModelInputError(_missing(device, have))


def ggml_device(device: str, available: Sequence[GgmlDevice], installed: Sequence[str] = ()) -> (
        GgmlDevice | None):
    """The device of ``available`` (ggml's, in its registry's order) the ggml engine computes on for
    ``--device device``; None: the direct CPU engine (:class:`~ethen.model.glayer.GgmlEngine`). ``auto``:
    the first ``gpu`` device, else the first ``igpu``, else None; ``cpu``: None; ``cuda`` / ``metal`` /
    ``vulkan``: the first device of that backend (:data:`GGML_BACKEND_NAMES`), refused without one, naming
    the missing ``libggml-<device>.so`` when ``installed`` (the backends' files) lacks it too."""
    if device not in DEVICES:
        raise ModelInputError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        for kind in _AUTO_KINDS:
            for d in available:
                if d.kind == kind:
                    return d
        return None
    if device == "cpu":
        return None
    names = GGML_BACKEND_NAMES[device]
    for d in available:
        if d.backend in names:
            return d
    if device not in installed:
        raise ModelInputError(_missing(device, installed))
    raise ModelInputError(f"device {device!r}: ggml's {_GGML_GPUS[device]} backend found no device (ggml's "
                          f"devices: {', '.join(d.name for d in available) or 'none'})")


def model_params(tensors: Mapping[str, TensorInfo]) -> int:
    """The model's parameter count (every tensor's elements)."""
    total = 0
    for t in tensors.values():
        n = 1
        for s in t.shape:
            n *= int(s)
        total += n
    return total


def auto_engine(params: int) -> str:
    """``ggml`` for a model of ``params`` parameters at or over :data:`GGML_MIN_PARAMS`, else ``onnx``."""
    return "ggml" if params >= GGML_MIN_PARAMS else "onnx"


def _ggml_only(tensors: Mapping[str, TensorInfo]) -> TensorInfo | None:
    return next((t for t in tensors.values() if t.kind in GGML_ONLY_TYPES), None)


def check_onnx(tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse (naming the tensor and type) a model the onnxruntime engine cannot pack."""
    t = _ggml_only(tensors)
    if t is not None:
        raise ModelInputError(f"tensor {t.name!r} has type {t.kind}, which only the ggml engine reads "
                              "(--engine ggml)")


def engine_kind(tensors: Mapping[str, TensorInfo], options: EngineOptions = DEFAULT_OPTIONS,
                ggml_devices: Sequence[GgmlDevice] = ()) -> str:
    """The engine ``options`` choose for the model whose tensor table is ``tensors``: ``ggml`` or
    ``onnx``; ``ggml_devices``: the devices ggml's backends offer (a CUDA one takes ``--device cuda``)."""
    if options.engine == "onnx" and options.device in _GGML_ONLY_DEVICES:
        raise ModelInputError(f"device {options.device!r} runs on the ggml engine only (--engine ggml or "
                              "auto); onnxruntime has no such device")
    if options.engine != "auto":
        return options.engine
    check_device(options.device)
    if options.device in _GGML_ONLY_DEVICES:
        return "ggml"
    if options.device == "cuda":
        return "ggml" if any(d.backend in GGML_BACKEND_NAMES["cuda"] for d in ggml_devices) else "onnx"
    if _ggml_only(tensors):
        return "ggml"
    if options.accuracy == "fast":
        return "ggml"
    if options.accuracy == "exact":
        return "onnx"
    return auto_engine(model_params(tensors))
