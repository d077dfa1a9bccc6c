"""Logit and greedy-token parity with transformers' own GGUF loader (optional extra ``parity``).

transformers dequantizes the same Q4_1 tensors and un-permutes Q/K itself, so both sides see the same weights;
differences are float32 rounding only. Skips (with the reason) when transformers/torch are not importable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ethen.model import Model, SamplingParams, find_gguf_path, generate, model_step

SKIP_REASON = "parity extra not installed: pip install -e '.[parity]' torch==2.13.0"
torch = pytest.importorskip("torch", reason=SKIP_REASON)
transformers = pytest.importorskip("transformers", reason=SKIP_REASON)

MAX_ABS_DIFF = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count from 1 to 12."}],
    [{"role": "user", "content": "Write a haiku about the sea. Use the word 'blue'."}],
]
TEXTS = [
    "Hello world! 12345 + 678 = 13023",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Unicode: café, naïve, 東京, emoji 🚀🔥, ümlaut",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><jupyter_code>x = [1,2,3]",
    "def f(x):\n    return x**2  # comment",
]


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    path = find_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.mark.parametrize("chat", CHATS, ids=["france", "system-count", "haiku"])
def test_logits_match_transformers(
    model: Model, hf: tuple[Any, Any], chat: list[dict[str, str]]
) -> None:
    hf_model, _ = hf
    ids = model.tokenizer.encode(model.chat_template.render(chat))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    ours = model.logits(ids, model.new_kv_cache(), all_positions=True)
    diff = float(np.abs(ours - ref).max())
    print(f"max abs logit diff ({len(ids)} tokens): {diff:.3g}")
    assert diff <= MAX_ABS_DIFF


@pytest.mark.parametrize("chat", CHATS, ids=["france", "system-count", "haiku"])
def test_greedy_tokens_match_transformers(
    model: Model, hf: tuple[Any, Any], chat: list[dict[str, str]]
) -> None:
    hf_model, _ = hf
    ids = model.tokenizer.encode(model.chat_template.render(chat))
    n_new = 24
    with torch.no_grad():
        stop = model.tokenizer.im_end_id
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                eos_token_id=stop, pad_token_id=stop)
    ref = [int(t) for t in out[0, len(ids):]]
    if ref and ref[-1] == model.tokenizer.im_end_id:
        ref = ref[:-1]
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new)
    ours = generate(model_step(model), model.tokenizer, ids, greedy)
    assert len(ref) >= 3
    assert list(ours.token_ids) == ref


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(
    model: Model, hf: tuple[Any, Any], text: str
) -> None:
    _, hf_tok = hf
    assert model.tokenizer.encode(text) == hf_tok(text)["input_ids"]


def test_chat_template_matches_transformers(model: Model, hf: tuple[Any, Any]) -> None:
    _, hf_tok = hf
    for chat in CHATS:
        for gen in (True, False):
            expected = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert model.chat_template.render(chat, add_generation_prompt=gen) == expected
