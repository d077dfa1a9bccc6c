"""Sampling, streaming text with stop strings, and single-process generation with the real model."""

from __future__ import annotations

import numpy as np
import pytest

from ethen.model import (
    Model,
    ModelInputError,
    SamplingParams,
    TextStream,
    generate,
    generate_chat,
    generate_stream,
    make_rng,
    model_step,
    sample_token,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def test_greedy_answer_mentions_paris(model: Model) -> None:
    """Checks the RoPE convention end to end: a mixed convention gives fluent garbage, not Paris."""
    out = generate_chat(model, [{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.prompt_tokens > 10 and out.completion_tokens == len(out.token_ids) > 0
    assert "<|im_end|>" not in out.text


def test_greedy_is_deterministic_and_english(model: Model) -> None:
    msgs = [{"role": "user", "content": "Name a primary colour. One word."}]
    a, b = generate_chat(model, msgs, GREEDY), generate_chat(model, msgs, GREEDY)
    assert a == b
    assert any(c in a.text.lower() for c in ("red", "blue", "yellow"))


def test_seeded_sampling_is_reproducible(model: Model) -> None:
    msgs = [{"role": "user", "content": "Tell me a story."}]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12)
    assert generate_chat(model, msgs, p).token_ids == generate_chat(model, msgs, p).token_ids


def test_max_tokens_gives_length(model: Model) -> None:
    out = generate_chat(model, [{"role": "user", "content": "Write a long essay about rivers."}],
                        SamplingParams(temperature=0.0, max_tokens=5))
    assert out.finish_reason == "length" and out.completion_tokens == 5


def test_stop_string_cuts_the_text(model: Model) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = generate_chat(model, msgs, GREEDY)
    assert "Paris" in full.text
    cut = generate_chat(model, msgs, SamplingParams(temperature=0.0, max_tokens=40, stop=("Paris",)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("Paris")]


def test_stream_chunks_concatenate_to_the_text(model: Model) -> None:
    ids = model.tokenizer.encode(model.chat_template.render([{"role": "user", "content": "Say hello."}]))
    chunks = list(generate_stream(model_step(model), model.tokenizer, ids, GREEDY))
    assert chunks[-1].finish_reason is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    whole = generate(model_step(model), model.tokenizer, ids, GREEDY)
    assert "".join(c.text for c in chunks) == whole.text


def test_context_limit_gives_length(model: Model) -> None:
    ids = model.tokenizer.encode("One two three")
    out = generate(model_step(model), model.tokenizer, ids, GREEDY, context_length=len(ids) + 2)
    assert out.finish_reason == "length" and out.completion_tokens == 2
    with pytest.raises(ModelInputError, match="context holds"):
        generate(model_step(model), model.tokenizer, ids, GREEDY, context_length=len(ids))


def test_sample_token_greedy_temperature_top_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert sample_token(logits, SamplingParams(temperature=0.0), make_rng(0)) == 0
    rng = make_rng(1)
    draws = [sample_token(logits, SamplingParams(top_p=0.7), rng) for _ in range(400)]
    assert set(draws) == {0, 1}  # 0.5 < 0.7 <= 0.8: the token that crosses the threshold is kept
    rng = make_rng(2)
    draws = [sample_token(logits, SamplingParams(temperature=1.0), rng) for _ in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    cold = [sample_token(logits, SamplingParams(temperature=0.1), make_rng(s)) for s in range(50)]
    assert cold.count(0) >= 48
    a = [sample_token(logits, SamplingParams(seed=7), make_rng(7)) for _ in range(20)]
    b = [sample_token(logits, SamplingParams(seed=7), make_rng(7)) for _ in range(20)]
    assert a == b


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
    ({"stop": ("",)}, "stop"),
    ({"stop": 5}, "stop"),
])
def test_bad_sampling_params_are_clear_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ModelInputError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_may_be_a_single_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]


def test_text_stream_holds_partial_utf8_and_stop_prefixes(model: Model) -> None:
    tok = model.tokenizer
    rocket = tok.encode("🚀")
    assert len(rocket) == 3
    s = TextStream(tok)
    assert [s.push(t) for t in rocket] == ["", "", "🚀"]
    s = TextStream(tok, stop=["END"])
    out = [s.push(t) for t in tok.encode("Hi E")]
    assert "".join(out) == "Hi "  # " E" could start "END": held back
    out += [s.push(t) for t in tok.encode("ND more")]
    assert "".join(out) == "Hi " and s.stopped and s.text == "Hi "
    s = TextStream(tok, stop=["END"])
    out = [s.push(t) for t in tok.encode("Hi E")]
    assert "".join(out) + s.flush() == "Hi E"  # not a stop after all: flushed at the end


def test_text_stream_token_by_token_equals_whole_decode(model: Model) -> None:
    tok = model.tokenizer
    text = "Café 東京 🚀🔥 naïve — «quotes» 12345 <|im_start|>x\n\tend " * 3
    ids = tok.encode(text)
    s = TextStream(tok)
    streamed = "".join(s.push(t) for t in ids) + s.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True)
    assert "🚀🔥" in streamed and "<|im_start|>" not in streamed
