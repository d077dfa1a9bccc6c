"""Tokenizer built from the GGUF vocab/merges: round trip, special tokens, digits, no BOS."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ethen.model import ModelInputError, Tokenizer, WeightStore

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
           "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
           "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
           "<empty_output>"]
# Bytes the SmolLM2 vocab has no token for (the reference tokenizer drops them too): six C0 controls, and the
# UTF-8 lead bytes F1/F2, i.e. code points U+40000..U+BFFFF.
MISSING_CHARS = "\x04\x06\x13\x14\x16\x1d"
REPRESENTABLE = st.text(
    alphabet=st.characters(max_codepoint=0x3FFFF, exclude_characters=MISSING_CHARS,
                           exclude_categories=("Cs",)),
    max_size=60,
)


@pytest.fixture(scope="module")
def tok(store: WeightStore) -> Tokenizer:
    return store.load_tokenizer()


@pytest.mark.parametrize("text", [
    "Hello, world!", "  two  spaces\tand\ttabs\n\nnewlines", "café naïve 東京 🚀", "x = [1, 2, 3]  # list",
    "", " ", "Ġ weird Ċ bytes",
])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(REPRESENTABLE)
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_bytes_missing_from_the_vocab_are_dropped(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("a\x04b")) == "ab"


def test_known_ids(tok: Tokenizer) -> None:
    assert tok.encode("Hello world") == [19556, 905]


def test_control_tokens_are_single_special_ids(tok: Tokenizer) -> None:
    for i, name in enumerate(CONTROL):
        assert tok.encode(name) == [i]
        assert tok.is_special(i)
    assert not tok.is_special(tok.encode("Hello")[0])
    assert tok.special_ids == frozenset(range(17))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    ids = tok.encode("2024")
    assert len(ids) == 4
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]
    assert [tok.decode([i]) for i in tok.encode("a 12")] == ["a", " ", "1", "2"]


def test_no_bos_prepended(tok: Tokenizer) -> None:
    ids = tok.encode("Hi")
    assert ids and ids[0] != 1 and 0 not in ids
    assert tok.hf.encode("Hi").ids == ids  # even with the library default add_special_tokens=True


def test_stops_on_im_end(tok: Tokenizer) -> None:
    assert tok.im_end_id == 2
    assert 2 in tok.stop_token_ids


def test_bad_ids_are_clear_errors(tok: Tokenizer) -> None:
    with pytest.raises(ModelInputError, match="49152"):
        tok.decode([1, 49152])
    with pytest.raises(ModelInputError, match="text must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
