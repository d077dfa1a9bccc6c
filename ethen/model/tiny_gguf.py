"""Write small random-weight GGUF models with ``gguf.GGUFWriter``: the test and benchmark models of each
supported architecture, in every supported tensor type, with a real tokenizer and chat template.

Not a model anyone should chat with: the weights are random. What is real is the file - the same keys,
tensor names, layouts and quantized blocks a llama.cpp converter writes - so the loader, the forward pass,
the tokenizer and the mesh run on it exactly as on a downloaded model.

* Float and ``Q8_0`` / ``Q4_0`` / ``Q4_1`` / ``BF16`` tensors are quantized by ``gguf.quants.quantize``.
  The gguf library cannot quantize K-quants, so ``Q4_K`` / ``Q5_K`` / ``Q6_K`` tensors are random blocks
  whose super-block scales (the f16 ``d`` / ``dmin`` fields) are set to small values: every block is valid
  and its values stay in a sane range.
* ``llama`` weights are random, so they need no Q/K permutation to be a valid llama.cpp file (the loader
  un-permutes them as it would a converted model's).
* Dimensions: quantized tensors need their row length to be a multiple of the block size (32, and 256 for
  K-quants); the defaults (``d_model = 256``, ``d_ff = 512``) fit every type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from ethen.model.ggml_lib import lib

__all__ = ["TinySpec", "gpt2_vocab", "spm_vocab", "write_tiny_gguf"]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
ZEPHYR = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + "
          "message['content'] + eos_token + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
WORDS = ("the", "and", "hello", "world", "mesh", "layer", "token", "model", "is", "of", "to", "in", "a")

# K-quant block layouts: (bytes per 256 values, byte offsets of the f16 scale fields, value of each)
_KQUANT_SCALES = {"Q4_K": (144, ((0, 2e-4), (2, 1e-4))), "Q5_K": (176, ((0, 1e-4), (2, 1e-4))),
                  "Q6_K": (210, ((208, 4e-5),)), "Q2_K": (84, ((80, 4e-3), (82, 4e-3))),
                  "Q3_K": (110, ((108, 1.5e-3),)), "IQ4_XS": (136, ((0, 5e-5),)),
                  "IQ4_NL": (144, tuple((18 * i, 1.5e-3) for i in range(8))),  # 8 blocks of 32
                  "IQ2_XXS": (66, ((0, 1e-3),)), "IQ3_S": (110, ((0, 4e-4),))}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE tokens are written with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def gpt2_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 byte tokens, merges building :data:`WORDS` (with and without a
    leading space), and three CONTROL tokens. Returns (tokens, merges, token types)."""
    table = _bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    merges: list[str] = []
    for word in WORDS:
        for text in (word, " " + word):
            cur = table[ord(text[0])]
            for ch in text[1:]:
                nxt = cur + table[ord(ch)]
                if nxt not in tokens:
                    merges.append(f"{cur} {table[ord(ch)]}")
                    tokens.append(nxt)
                cur = nxt
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        types.append(3)
    return tokens, merges, types


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary (``<unk>``, ``<s>``, ``</s>``, 256 byte tokens, letters and pieces of
    :data:`WORDS` with ``▁`` for spaces). Returns (tokens, scores, token types)."""
    tokens = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    types = [2, 3, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces: list[str] = ["▁", *sorted({c for w in WORDS for c in w})]
    for word in WORDS:
        text = "▁" + word
        pieces += [text[:i] for i in range(2, len(text) + 1)]
    seen: set[str] = set()
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    scores = [0.0] * 262 + [-float(i) for i in range(len(tokens) - 262)]
    return tokens, scores, types


@dataclass(frozen=True)
class TinySpec:
    """Shape and content of one tiny model."""

    arch: str = "llama"  # "llama" or "qwen2"
    types: Sequence[str] = ("F32",)  # matrix tensor types, cycled over the layers' matrices
    embd_type: str = "F32"
    output_type: str | None = None  # None: tied output head (no output.weight)
    n_layers: int = 3
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 512
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    rope_freqs: Sequence[float] | None = None  # a rope_freqs.weight tensor (Llama 3.1-style scaling)
    rope_scaling_factor: float | None = None  # rope.scaling.type = linear with this factor
    tokenizer: str = "gpt2"  # "gpt2" (byte-level BPE, ChatML) or "llama" (SentencePiece, Zephyr template)
    name: str = "tiny"
    seed: int = 0
    extra: dict[str, object] = field(default_factory=dict)  # more metadata keys (e.g. a bad RoPE scaling)
    drop: Sequence[str] = ()  # tensor names left out (a broken file)
    #: block types gguf's quantizer cannot write: "random" blocks with small scales, or "ggml": the random
    #: float weights quantized by ggml's own quantizer (libggml-python; realistic, zero-mean weights)
    quantizer: str = "random"


def _tensor(writer: object, name: str, values: NDArray[np.float32], kind: str,
            rng: np.random.Generator, drop: Sequence[str] = (), quantizer: str = "random") -> None:
    """Add ``values`` ([rows, cols] or [n], numpy order) to the writer as ``kind``."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    assert isinstance(writer, GGUFWriter)
    if name in drop:
        return
    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, values.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif quantizer == "ggml" and values.ndim == 2 and kind not in ("BF16",):
        writer.add_tensor(name, lib().quantize(kind, values), raw_dtype=qtype)
    elif kind in _KQUANT_SCALES:
        block, fields = _KQUANT_SCALES[kind]
        rows, cols = values.shape
        if cols % 256:
            raise ValueError(f"{name}: {kind} needs rows of a multiple of 256 values, got {cols}")
        # random blocks (gguf's quantizer has no K-quant / IQ encoder), their scales set to small values
        raw = rng.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
        for offset, scale in fields:
            d = (scale * rng.uniform(0.5, 1.0, size=(rows, cols // 256))).astype(np.float16)
            raw[:, :, offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
        writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_gguf(path: str | Path, spec: TinySpec | None = None) -> Path:
    """Write the model ``spec`` describes to ``path`` and return the path."""
    from gguf import GGUFWriter

    s = spec or TinySpec()
    rng = np.random.default_rng(s.seed)
    out = Path(path)
    w = GGUFWriter(str(out), s.arch)
    w.add_name(s.name)
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.rope_scaling_factor is not None:
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.rope_scaling_factor)
    if s.tokenizer == "gpt2":
        tokens, merges, types = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if s.arch == "qwen2" else "default")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    else:
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_chat_template(ZEPHYR)
    for key, value in s.extra.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
    vocab, d, hd = len(tokens), s.d_model, s.d_model // s.n_heads
    qd, kvd, f = s.n_heads * hd, s.n_kv_heads * hd, s.d_ff

    def mat(rows: int, cols: int) -> NDArray[np.float32]:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def norm(n: int) -> NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    _tensor(w, "token_embd.weight", mat(vocab, d), s.embd_type, rng, s.drop, s.quantizer)
    _tensor(w, "output_norm.weight", norm(d), "F32", rng, s.drop)
    if s.output_type is not None:
        _tensor(w, "output.weight", mat(vocab, d), s.output_type, rng, s.drop, s.quantizer)
    if s.rope_freqs is not None:
        _tensor(w, "rope_freqs.weight", np.asarray(s.rope_freqs, dtype=np.float32), "F32", rng, s.drop)
    k = 0
    for i in range(s.n_layers):
        p = f"blk.{i}."
        _tensor(w, p + "attn_norm.weight", norm(d), "F32", rng, s.drop)
        _tensor(w, p + "ffn_norm.weight", norm(d), "F32", rng, s.drop)
        for name, rows, cols in (("attn_q", qd, d), ("attn_k", kvd, d), ("attn_v", kvd, d),
                                 ("attn_output", d, qd), ("ffn_gate", f, d), ("ffn_up", f, d),
                                 ("ffn_down", d, f)):
            _tensor(w, p + name + ".weight", mat(rows, cols), s.types[k % len(s.types)], rng, s.drop,
                    s.quantizer)
            k += 1
        if s.arch == "qwen2":
            for name, n in (("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)):
                bias = (0.1 * rng.standard_normal(n)).astype(np.float32)
                _tensor(w, p + name + ".bias", bias, "F32", rng, s.drop)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
