"""Tokenizer built with the ``tokenizers`` library from the GGUF vocab and merges.

GGUF ``tokenizer.ggml.model = gpt2`` / ``pre = smollm`` means: byte-level BPE whose pre-tokenizer first
splits every digit on its own (``Digits(individual_digits=True)``) and then applies the GPT-2 byte-level
regex, with no prefix space. Tokens whose GGUF ``token_type`` is CONTROL (3) - the 17 tokens
``<|endoftext|>`` .. ``<empty_output>`` - are registered as special tokens, so ``<|im_start|>`` in a
rendered chat prompt is one id and ``decode(skip_special_tokens=True)`` drops them. No BOS is prepended
(``tokenizer.ggml.add_bos_token = false``): there is no post-processor. Generation stops on ``<|im_end|>``
(see :attr:`Tokenizer.stop_token_ids`).

The vocab has no token for the bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and for the UTF-8 lead bytes F1/F2
(code points U+40000..U+BFFFF): such characters are dropped, exactly as transformers' GGUF tokenizer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ethen.model.errors import ModelInputError

__all__ = ["CONTROL_TOKEN_TYPE", "Tokenizer", "build_hf_tokenizer"]

CONTROL_TOKEN_TYPE = 3  # gguf.TokenType.CONTROL
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def build_hf_tokenizer(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int]
) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's ``smollm`` byte-level BPE."""
    if not (len(tokens) == len(token_types)):
        raise ModelInputError(
            f"tokenizer.ggml.tokens has {len(tokens)} entries but token_type has {len(token_types)}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelInputError(f"tokenizer.ggml.merges[{i}] is not 'left right': {merge!r}")
        pairs.append((left, right))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [
        tokenizers.AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if int(t) == CONTROL_TOKEN_TYPE
    ]
    tok.add_special_tokens(specials)
    return tok


class Tokenizer:
    """Text <-> token ids for SmolLM2 (thin wrapper over a ``tokenizers.Tokenizer``)."""

    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        im_end = hf.token_to_id(IM_END)
        eot = hf.token_to_id(ENDOFTEXT)
        if im_end is None:
            raise ModelInputError(f"tokenizer has no {IM_END!r} token")
        self.im_end_id: int = im_end
        #: Generation stops when one of these is sampled (``<|im_end|>``, and ``<|endoftext|>`` = EOS).
        self.stop_token_ids: frozenset[int] = frozenset(i for i in (im_end, eot) if i is not None)
        #: Ids of the special (GGUF CONTROL) tokens.
        self.special_ids: frozenset[int] = frozenset(
            int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single ids. No BOS."""
        if not isinstance(text, str):
            raise ModelInputError(f"text must be a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False).ids)

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
