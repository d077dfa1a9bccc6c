"""Model hyper-parameters, read from the GGUF metadata (``{arch}.*`` keys).

Nothing is hard-coded to one model: every value comes from the file, and
:meth:`ModelConfig.from_gguf_metadata` names the missing (or unsupported) key and value when the file lacks
one. Supported architectures (:data:`ARCHITECTURES`):

* ``llama`` - Llama 2/3, SmolLM, TinyLlama, Mistral-style models without a sliding window. llama.cpp's
  converter permutes their Q/K rows (the loader undoes it).
* ``qwen2`` - the same block with Q/K/V biases; its Q/K rows are not permuted.

RoPE: base ``{arch}.rope.freq_base`` (10000 when absent, as llama.cpp), ``{arch}.rope.scaling.type``
``none`` or ``linear`` (positions divided by ``rope.scaling.factor``), and per-frequency divisors from a
``rope_freqs.weight`` tensor - the way llama.cpp's converter stores Llama-3.1's ``llama3`` rope scaling
(``rope_freq_factors``). YaRN and other scalings are refused with :class:`UnsupportedModelError`, as is a
partial rotary dimension (``rope.dimension_count`` below the head size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ethen.model.errors import ModelInputError, UnsupportedModelError

__all__ = ["ARCHITECTURES", "ModelConfig"]

#: architecture -> whether llama.cpp's converter permuted its Q/K rows for the "adjacent pairs" RoPE
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False}
ROPE_SCALINGS = ("none", "linear")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of one Llama-family model."""

    n_layers: int  # transformer blocks (30 for SmolLM2-135M)
    d_model: int  # hidden size (576)
    n_heads: int  # query heads (9)
    n_kv_heads: int  # key/value heads, grouped-query attention (3)
    head_dim: int  # per-head size (64)
    d_ff: int  # SwiGLU inner size (1536)
    rope_theta: float  # RoPE base frequency (100000)
    rms_eps: float  # RMSNorm epsilon (1e-5)
    vocab_size: int  # tokens (49152)
    context_length: int  # maximum positions (8192)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"  # general.architecture
    name: str = ""  # general.name (the loader falls back to the file stem)
    attn_bias: bool = False  # Q/K/V projections carry biases (qwen2)
    rope_scaling_factor: float = 1.0  # linear RoPE scaling: positions / factor (1.0: none)
    rope_freq_factors: tuple[float, ...] | None = None  # [head_dim / 2] divisors of the RoPE frequencies

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                     "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelInputError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelInputError(
                f"ModelConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ModelInputError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")
        if not self.rope_scaling_factor > 0:
            raise ModelInputError(
                f"ModelConfig.rope_scaling_factor must be > 0, got {self.rope_scaling_factor}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelInputError(
                f"rope_freqs has {len(self.rope_freq_factors)} entries, expected head_dim / 2 = "
                f"{self.head_dim // 2}")

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim

    @property
    def qk_permuted(self) -> bool:
        """llama.cpp's converter permuted this architecture's Q/K rows (the loader undoes it)."""
        return ARCHITECTURES[self.architecture]

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """float32 bytes one position costs in a KV cache, per layer (K and V)."""
        return 2 * self.kv_dim * 4

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        d = dict(data)
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(float(f) for f in d["rope_freq_factors"])
        return cls(**d)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, attn_bias: bool = False,
                           rope_freq_factors: Sequence[float] | None = None) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python scalars). ``attn_bias`` and
        ``rope_freq_factors`` come from the file's tensors (``attn_q.bias``, ``rope_freqs.weight``)."""
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF general.architecture = {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")

        def need(key: str) -> Any:
            if key not in meta:
                raise ModelInputError(f"GGUF metadata lacks key {key!r}")
            return meta[key]

        def as_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UnsupportedModelError(
                    f"GGUF {key} = {value!r}: only one value for every layer is supported")
            return value

        def num(suffix: str, default: Any = None) -> Any:
            key = f"{arch}.{suffix}"
            return need(key) if default is None else meta.get(key, default)

        d_model = as_int(f"{arch}.embedding_length", num("embedding_length"))
        n_heads = as_int(f"{arch}.attention.head_count", num("attention.head_count"))
        head_dim = as_int(f"{arch}.attention.key_length", num("attention.key_length", d_model // n_heads))
        rope_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise UnsupportedModelError(
                f"GGUF {arch}.rope.dimension_count = {rope_dim!r}: partial rotary embeddings are not "
                f"supported (head size {head_dim})")
        scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ROPE_SCALINGS:
            raise UnsupportedModelError(
                f"GGUF {arch}.rope.scaling.type = {scaling!r} is not supported (supported: "
                f"{', '.join(ROPE_SCALINGS)})")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(need("tokenizer.ggml.tokens"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        name = meta.get("general.name")
        return cls(
            n_layers=as_int(f"{arch}.block_count", num("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=as_int(f"{arch}.attention.head_count_kv", num("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ff=as_int(f"{arch}.feed_forward_length", num("feed_forward_length")),
            rope_theta=float(num("rope.freq_base", 10000.0)),
            rms_eps=float(num("attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
            context_length=as_int(f"{arch}.context_length", num("context_length")),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            architecture=str(arch),
            name=name if isinstance(name, str) else "",
            attn_bias=attn_bias,
            rope_scaling_factor=factor if scaling == "linear" else 1.0,
            rope_freq_factors=None if rope_freq_factors is None else tuple(
                float(f) for f in rope_freq_factors),
        )
