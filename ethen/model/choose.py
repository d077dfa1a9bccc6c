"""Which engine runs a model's quantized layers and head: ggml (llama.cpp's kernels,
:mod:`ethen.model.glayer`) or onnxruntime (:mod:`ethen.model.qmodel`).

The choice is an :class:`EngineOptions` value, given as a parameter (``ethen worker`` / ``ethen up``
``--engine`` / ``--accuracy`` / ``--device``; nothing here reads the environment). ``engine``: ``ggml``,
``onnx`` or ``auto`` (the default). ``auto`` follows ``accuracy`` first: ``fast`` is ggml (int8
activations, as llama.cpp), ``exact`` onnxruntime (float32-grade products); at accuracy ``auto`` (the
default) a model with a tensor type only ggml reads (``GGML_ONLY_TYPES``) runs on ggml, else the rule
:func:`auto_engine` picks by the model's size. ``device="cuda"`` runs onnxruntime (the wheel's ggml is a
CPU build: ``metal`` / ``vulkan`` are refused, :func:`check_device`).

The rule, measured (docs/decisions/0100-ggml-engine.md): int8 activations change SmolLM2-135M's greedy
answer to ``ethen up``'s banner question (llama.cpp's own answer is also wrong there), so a model under
:data:`GGML_MIN_PARAMS` parameters keeps the float32-compute engine; 1B-class models (TinyLlama's shape)
decode 2-4x faster on ggml, where the int8 activations are what llama.cpp serves them with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ethen.model.errors import ModelInputError
from ethen.model.ggml_lib import backends
from ethen.model.gguf_loader import GGML_ONLY_TYPES, TensorInfo

__all__ = ["ACCURACIES", "DEFAULT_OPTIONS", "DEVICES", "ENGINES", "GGML_MIN_PARAMS", "EngineOptions",
           "auto_engine", "check_device", "check_onnx", "engine_kind", "model_params"]

ENGINES = ("auto", "ggml", "onnx")
#: ``--device`` values: ``cuda`` is onnxruntime-gpu's; ``metal`` / ``vulkan`` would be ggml backends
#: (:func:`check_device`)
DEVICES = ("auto", "cpu", "cuda", "metal", "vulkan")
_GGML_GPUS = {"metal": "Metal", "vulkan": "Vulkan"}
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


def check_device(device: str) -> None:
    """Refuse (naming it) a device outside :data:`DEVICES`, and ``metal`` / ``vulkan``, which no installed
    engine runs: the ggml engine computes on ggml's CPU backend (the ``libggml-python`` wheel is a CPU
    build; a build with the device's backend, ``libggml-<device>.so``, is named as what is missing) and
    onnxruntime has neither. ``cuda`` is checked where the onnx engine starts
    (:class:`~ethen.model.engine.Engine`)."""
    if device not in DEVICES:
        raise ModelInputError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device in _GGML_GPUS:
        have = backends()
        if device not in have:
            raise ModelInputError(
                f"device {device!r} needs a libggml build with the {_GGML_GPUS[device]} backend "
                f"(libggml-{device}.so); the installed ggml backends: {', '.join(have) or 'none'}")
        raise ModelInputError(f"device {device!r}: the ggml engine runs on ggml's CPU backend only (its "
                              f"{_GGML_GPUS[device]} backend is installed but not used yet)")


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


def engine_kind(tensors: Mapping[str, TensorInfo], options: EngineOptions = DEFAULT_OPTIONS) -> str:
    """The engine ``options`` choose for the model whose tensor table is ``tensors``: ``ggml`` or
    ``onnx``."""
    if options.engine != "auto":
        return options.engine
    check_device(options.device)
    if options.device == "cuda":
        return "onnx"
    if _ggml_only(tensors):
        return "ggml"
    if options.accuracy == "fast":
        return "ggml"
    if options.accuracy == "exact":
        return "onnx"
    return auto_engine(model_params(tensors))
