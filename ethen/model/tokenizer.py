"""Tokenizer built with the ``tokenizers`` library from the GGUF's own ``tokenizer.ggml.*`` metadata.

Two GGUF tokenizer models (``tokenizer.ggml.model``):

* ``gpt2`` - byte-level BPE from ``tokens`` + ``merges``. Its pre-tokenizer depends on
  ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`), following llama.cpp's regexes: ``smollm`` splits every
  digit on its own then applies the GPT-2 byte-level regex (SmolLM2), ``llama-bpe`` is Llama 3's regex
  (digits in runs of up to 3), ``qwen2`` Qwen2's (digits one by one), ``default`` / ``gpt-2`` the GPT-2 regex.
  Any other ``pre`` is refused (:class:`UnsupportedModelError`) rather than tokenized differently in silence.
* ``llama`` - SentencePiece BPE (Llama 2, TinyLlama, Mistral): GGUF stores no merges, so they are derived from
  the vocabulary and scores the way transformers' GGUF converter does (every split of a token into two
  tokens, ranked by the merged token's score); ``▁`` marks spaces, a ``▁`` is prepended to the text, and
  bytes missing from the vocabulary fall back to ``<0xNN>`` tokens.

Tokens whose GGUF ``token_type`` is CONTROL (3) are registered as special tokens, so ``<|im_start|>`` in a
rendered chat prompt is one id and ``decode(skip_special_tokens=True)`` drops them.

BOS: :meth:`Tokenizer.encode` prepends ``tokenizer.ggml.bos_token_id`` when ``tokenizer.ggml.add_bos_token``
is true (llama.cpp's default is true for ``llama`` and false for ``gpt2`` tokenizers), unless the text
already starts with the BOS token (chat templates such as Llama 3's write ``{{ bos_token }}`` themselves): a
prompt never gets two. SmolLM2 sets ``add_bos_token = false``.

Generation stops (:attr:`Tokenizer.stop_token_ids`) on the EOS, EOT and EOM ids of the metadata and on the
special tokens that end a turn in the common chat formats (``<|im_end|>``, ``<|eot_id|>``, ``<|eom_id|>``,
``<|end|>``, ``<end_of_turn>``, ``<|endoftext|>``) when the vocabulary has them.

SmolLM2's vocab has no token for the bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and for the UTF-8 lead bytes
F1/F2 (code points U+40000..U+BFFFF): such characters are dropped, as transformers' GGUF tokenizer does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from ethen.model.errors import ModelInputError, UnsupportedModelError

__all__ = ["CONTROL_TOKEN_TYPE", "PRE_TOKENIZERS", "TURN_END_TOKENS", "Tokenizer", "build_hf_tokenizer",
           "tokenizer_settings"]

CONTROL_TOKEN_TYPE = 3  # gguf.TokenType.CONTROL
IM_END = "<|im_end|>"
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(regex: str | None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=regex is None))
    return pre_tokenizers.Sequence(steps)


#: ``tokenizer.ggml.pre`` -> pre-tokenizer of a ``gpt2`` (byte-level BPE) tokenizer
PRE_TOKENIZERS = {
    "smollm": lambda: _byte_level(None, digits=True),
    "llama-bpe": lambda: _byte_level(_LLAMA3),
    "llama3": lambda: _byte_level(_LLAMA3),
    "qwen2": lambda: _byte_level(_QWEN2),
    "default": lambda: _byte_level(None),
    "gpt-2": lambda: _byte_level(None),
}


def _pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelInputError(f"tokenizer.ggml.merges[{i}] is not 'left right': {merge!r}")
        pairs.append((left, right))
    return pairs


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: each split of a token into two tokens, best score first."""
    rank = {t: float(scores[i]) for i, t in enumerate(tokens)}
    found: list[tuple[float, float, float, str, str]] = []
    for merged, score in rank.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in rank and right in rank:
                found.append((score, rank[left], rank[right], left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in found]


def build_hf_tokenizer(
    tokens: Sequence[str], merges: Sequence[str] | None, token_types: Sequence[int],
    model: str = "gpt2", pre: str | None = "smollm", scores: Sequence[float] | None = None,
    unk_token_id: int | None = None,
) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's tokenizer for this GGUF metadata."""
    if len(tokens) != len(token_types):
        raise ModelInputError(
            f"tokenizer.ggml.tokens has {len(tokens)} entries but token_type has {len(token_types)}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if model == "gpt2":
        pre_name = pre or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"GGUF tokenizer.ggml.pre = {pre_name!r} is not supported (supported: "
                f"{', '.join(PRE_TOKENIZERS)})")
        if merges is None:
            raise ModelInputError("GGUF tokenizer.ggml.model = 'gpt2' needs tokenizer.ggml.merges")
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_pairs(merges), fuse_unk=False,
                                              byte_fallback=False))
        tok.pre_tokenizer = PRE_TOKENIZERS[pre_name]()
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        if scores is None or len(scores) != len(tokens):
            raise ModelInputError(
                "GGUF tokenizer.ggml.model = 'llama' needs one tokenizer.ggml.scores per token")
        pairs = _pairs(merges) if merges else _spm_merges(tokens, scores)
        unk = tokens[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(tokens) else None
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True,
                                              byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer.ggml.model = {model!r} is not supported (supported: gpt2, llama)")
    specials = [
        tokenizers.AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if int(t) == CONTROL_TOKEN_TYPE
    ]
    tok.add_special_tokens(specials)
    return tok


def tokenizer_settings(meta: Mapping[str, Any], tokens: Sequence[str]) -> dict[str, Any]:
    """BOS handling and stop ids from the GGUF metadata (stored next to ``tokenizer.json``)."""
    model = str(meta.get("tokenizer.ggml.model", "gpt2"))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
    stops = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                    "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)}
    stops |= {i for i, t in enumerate(tokens) if t in TURN_END_TOKENS}
    return {
        "bos_token_id": None if bos is None else int(bos),
        "add_bos": bool(add_bos) and bos is not None,
        "stop_token_ids": sorted(i for i in stops if 0 <= i < len(tokens)),
    }


class Tokenizer:
    """Text <-> token ids (thin wrapper over a ``tokenizers.Tokenizer``)."""

    def __init__(self, hf: tokenizers.Tokenizer, settings: Mapping[str, Any] | None = None) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        im_end = hf.token_to_id(IM_END)
        self.im_end_id: int | None = None if im_end is None else int(im_end)
        s = dict(settings or {})
        if "stop_token_ids" in s:
            stops = {int(i) for i in s["stop_token_ids"]}
        else:
            stops = {int(i) for i in (hf.token_to_id(t) for t in TURN_END_TOKENS) if i is not None}
        if not stops:
            raise ModelInputError("the tokenizer has no stop token (EOS, EOT or a turn-end token)")
        #: Generation stops when one of these is sampled.
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        bos = s.get("bos_token_id")
        self.bos_token_id: int | None = None if bos is None else int(bos)
        #: Prepend BOS in :meth:`encode` (``tokenizer.ggml.add_bos_token``).
        self.add_bos: bool = bool(s.get("add_bos", False)) and self.bos_token_id is not None
        #: Ids of the special (GGUF CONTROL) tokens.
        self.special_ids: frozenset[int] = frozenset(
            int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_file(cls, path: str | Path, settings_path: str | Path | None = None) -> Tokenizer:
        settings = None
        if settings_path is not None and Path(settings_path).is_file():
            settings = json.loads(Path(settings_path).read_text(encoding="utf-8"))
        return cls(tokenizers.Tokenizer.from_file(str(path)), settings)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single ids. BOS is prepended when
        the model asks for it and ``text`` does not already start with it."""
        if not isinstance(text, str):
            raise ModelInputError(f"text must be a str, got {type(text).__name__}")
        ids = list(self.hf.encode(text, add_special_tokens=False).ids)
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        for i, t in enumerate(ids):
            if not 0 <= int(t) < self.vocab_size:
                raise ModelInputError(f"token id ids[{i}]={t} is outside [0, {self.vocab_size})")
        return str(self.hf.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        result = self.hf.token_to_id(token)
        return None if result is None else int(result)

    def id_to_token(self, token_id: int) -> str | None:
        result = self.hf.id_to_token(int(token_id))
        return None if result is None else str(result)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self.special_ids
