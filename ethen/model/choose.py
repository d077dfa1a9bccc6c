"""Which engine runs a model's quantized layers and head: ggml (llama.cpp's kernels,
:mod:`ethen.model.glayer`) or onnxruntime (:mod:`ethen.model.qmodel`).

``$ETHEN_ENGINE`` (``ethen worker`` / ``ethen up`` ``--engine``): ``ggml``, ``onnx`` or ``auto`` (the
default). ``auto`` follows ``$ETHEN_ACCURACY`` (``--accuracy``) first: ``fast`` is ggml (int8 activations,
as llama.cpp), ``exact`` onnxruntime (float32-grade products); at accuracy ``auto`` (the
default) a model with a tensor type only ggml reads (``GGML_ONLY_TYPES``) runs on ggml, else the rule
:func:`auto_engine` picks by the model's size. ``$ETHEN_DEVICE=cuda`` (``--device``) runs onnxruntime
(the wheel's ggml is a CPU build: ``metal`` / ``vulkan`` are refused, :func:`check_device`).

The rule, measured (docs/decisions/0100-ggml-engine.md): int8 activations change SmolLM2-135M's greedy
answer to ``ethen up``'s banner question (llama.cpp's own answer is also wrong there), so a model under
:data:`GGML_MIN_PARAMS` parameters keeps the float32-compute engine; 1B-class models (TinyLlama's shape)
decode 2-4x faster on ggml, where the int8 activations are what llama.cpp serves them with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ethen.model.errors import ModelInputError
from ethen.model.ggml_lib import backends
from ethen.model.gguf_loader import GGML_ONLY_TYPES, TensorInfo

__all__ = ["ACCURACIES", "DEVICES", "ENGINES", "GGML_MIN_PARAMS", "accuracy_from_env", "auto_engine",
           "check_device", "check_onnx", "device_from_env", "engine_kind", "model_params"]

ENGINES = ("auto", "ggml", "onnx")
#: ``--device`` values (``$ETHEN_DEVICE`` carries the flag to the processes ``ethen up`` starts): ``cuda``
#: is onnxruntime-gpu's; ``metal`` / ``vulkan`` would be ggml backends (:func:`check_device`)
DEVICES = ("auto", "cpu", "cuda", "metal", "vulkan")
_GGML_GPUS = {"metal": "Metal", "vulkan": "Vulkan"}
#: ``--accuracy`` values (``$ETHEN_ACCURACY`` carries the flag to the processes ``ethen up`` starts)
ACCURACIES = ("auto", "exact", "fast")
#: ``auto``: models with at least this many parameters run on ggml
GGML_MIN_PARAMS = 500_000_000


def accuracy_from_env() -> str:
    """``$ETHEN_ACCURACY`` (default ``auto``), one of :data:`ACCURACIES`; anything else is refused, named
    (``exact-int8`` is no longer a user value: ``auto`` runs it for 8-bit blocks on the onnx engine)."""
    acc = os.environ.get("ETHEN_ACCURACY", "").strip() or "auto"
    if acc not in ACCURACIES:
        hint = " (auto runs exact-int8 where it applies)" if acc == "exact-int8" else ""
        raise ModelInputError(f"ETHEN_ACCURACY = {acc!r}: must be one of {', '.join(ACCURACIES)}{hint}")
    return acc


def device_from_env() -> str:
    """``$ETHEN_DEVICE`` (``--device``, default ``auto``), unchecked: see :func:`check_device`."""
    return os.environ.get("ETHEN_DEVICE", "").strip() or "auto"


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
                              "(--engine ggml, ETHEN_ENGINE=ggml)")


def engine_kind(tensors: Mapping[str, TensorInfo]) -> str:
    """The engine ``$ETHEN_ENGINE``, ``$ETHEN_ACCURACY`` and ``$ETHEN_DEVICE`` choose for the model whose
    tensor table is ``tensors``: ``ggml`` or ``onnx``."""
    kind = os.environ.get("ETHEN_ENGINE", "").strip() or "auto"
    if kind not in ENGINES:
        raise ModelInputError(f"ETHEN_ENGINE = {kind!r}: must be one of {', '.join(ENGINES)}")
    if kind != "auto":
        return kind
    device = device_from_env()
    check_device(device)
    if device == "cuda":
        return "onnx"
    if _ggml_only(tensors):
        return "ggml"
    acc = accuracy_from_env()
    if acc == "fast":
        return "ggml"
    if acc == "exact":
        return "onnx"
    return auto_engine(model_params(tensors))
