"""An independent reference forward pass for the tiny GGUF models, written the way llama.cpp computes it.

It shares nothing with ``ethen.model`` but ``gguf``'s reader and dequantizer: weights are used exactly as
stored in the file (no un-permutation, no fusion, no transposed cache), RoPE is llama.cpp's mode for the
architecture - adjacent pairs (``NORM``) for ``llama``, whose converter permuted Q/K for it, and halves
(``NEOX``) for ``qwen2`` - and everything runs in float64 over the whole sequence with a dense causal mask.
If the loader un-permuted the wrong architecture, dropped a bias, or mis-read a RoPE setting, the logits
would differ. It runs the real SmolLM2 GGUF too (~5 s, ~1.2 GB of float64 weights).

:func:`greedy_gaps` turns reference logits into a check of greedy tokens (teacher forcing: one forward pass
over prompt + generated tokens instead of a reference generation), :func:`reference_head_logits` /
:func:`reference_embeddings` are the orchestrator's ends alone.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

F64 = np.ndarray


def _weights(path: Path) -> tuple[dict[str, Any], dict[str, F64]]:
    return _load(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1)  # the last file's (SmolLM2's: ~1.2 GB, ~4 s to dequantize)
def _load(path: str, _mtime_ns: int) -> tuple[dict[str, Any], dict[str, F64]]:
    reader = GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            meta[key] = field.contents()
    tensors = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(
        [int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    return meta, tensors


def _rope(x: F64, positions: F64, inv_freq: F64, neox: bool) -> F64:
    """x [T, heads, hd] rotated by position * inv_freq [hd/2]."""
    ang = positions[:, None, None] * inv_freq[None, None, :]  # [T, 1, hd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    if neox:  # pairs (i, i + hd/2)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]  # pairs (2i, 2i + 1)
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def _norm(x: F64, g: F64, eps: float) -> F64:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _eps(meta: dict[str, Any]) -> float:
    return float(meta[f"{meta['general.architecture']}.attention.layer_norm_rms_epsilon"])


def reference_embeddings(path: Path, token_ids: list[int]) -> F64:
    """Rows ``token_ids`` of the dequantized token embedding ``[T, d]``."""
    return _weights(path)[1]["token_embd.weight"][token_ids]


def reference_head_logits(path: Path, hidden: F64) -> F64:
    """The final RMSNorm and the head (``output.weight``, else the tied embedding) of ``hidden[N, d]``."""
    meta, w = _weights(path)
    head = w.get("output.weight", w["token_embd.weight"])
    return np.asarray(_norm(np.asarray(hidden, np.float64), w["output_norm.weight"], _eps(meta)) @ head.T)


def greedy_gaps(ref: F64, prompt_len: int, tokens: list[int]) -> F64:
    """For reference logits ``ref`` of prompt + ``tokens`` (fed at once), how far below the reference's
    best logit each generated token's logit is, at the position that chose it: all zeros iff the
    reference's own greedy decoding gives ``tokens``; a generation within logit error ``e`` of the
    reference has gaps <= 2e."""
    rows = ref[prompt_len - 1:prompt_len - 1 + len(tokens)]  # [n, V] the logits each token was chosen from
    return np.asarray(rows.max(axis=1) - rows[np.arange(len(tokens)), tokens])


def reference_logits(path: Path, token_ids: list[int]) -> F64:
    """Logits [T, V] of ``token_ids`` fed from position 0."""
    meta, w = _weights(path)
    arch = meta["general.architecture"]
    n_layers = int(meta[f"{arch}.block_count"])
    d = int(meta[f"{arch}.embedding_length"])
    n_heads = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    hd = d // n_heads
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if "rope_freqs.weight" in w:
        inv_freq = inv_freq / w["rope_freqs.weight"]
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        inv_freq = inv_freq / float(meta[f"{arch}.rope.scaling.factor"])
    neox = arch == "qwen2"

    def norm(x: F64, g: F64) -> F64:
        return _norm(x, g, eps)

    t = len(token_ids)
    pos = np.arange(t, dtype=np.float64)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    x = w["token_embd.weight"][token_ids]  # [T, d]
    for i in range(n_layers):
        p = f"blk.{i}."
        a = norm(x, w[p + "attn_norm.weight"])
        q = a @ w[p + "attn_q.weight"].T + w.get(p + "attn_q.bias", 0.0)
        k = a @ w[p + "attn_k.weight"].T + w.get(p + "attn_k.bias", 0.0)
        v = a @ w[p + "attn_v.weight"].T + w.get(p + "attn_v.bias", 0.0)
        q = _rope(q.reshape(t, n_heads, hd), pos, inv_freq, neox)
        k = _rope(k.reshape(t, n_kv, hd), pos, inv_freq, neox)
        v = v.reshape(t, n_kv, hd)
        heads = []
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            s = q[:, h] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        m = norm(x, w[p + "ffn_norm.weight"])
        g = m @ w[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (m @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ head.T
