"""Model hyper-parameters, read from the GGUF metadata (``llama.*`` keys).

Nothing is hard-coded for SmolLM2: the values below come from the file, and
:meth:`ModelConfig.from_gguf_metadata` names the missing key when the file lacks one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ethen.model.errors import ModelInputError

__all__ = ["ModelConfig"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama hyper-parameters of one model."""

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

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """float32 bytes one position costs in a KV cache, per layer (K and V)."""
        return 2 * self.kv_dim * 4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        return cls(**dict(data))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python scalars)."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ModelInputError(f"GGUF general.architecture must be 'llama', got {arch!r}")

        def need(key: str) -> Any:
            if key not in meta:
                raise ModelInputError(f"GGUF metadata lacks key {key!r}")
            return meta[key]

        d_model = int(need("llama.embedding_length"))
        n_heads = int(need("llama.attention.head_count"))
        head_dim = int(meta.get("llama.rope.dimension_count", d_model // n_heads))
        vocab = meta.get("llama.vocab_size")
        if vocab is None:
            vocab = len(need("tokenizer.ggml.tokens"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            n_layers=int(need("llama.block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ff=int(need("llama.feed_forward_length")),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rms_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
            context_length=int(need("llama.context_length")),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
        )
