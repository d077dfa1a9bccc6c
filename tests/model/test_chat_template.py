"""The GGUF's own chat template, rendered with a sandboxed jinja2 environment."""

from __future__ import annotations

import pytest

from ethen.model import ChatTemplate, ModelInputError, WeightStore

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tpl(store: WeightStore) -> ChatTemplate:
    return store.load_chat_template()


def test_template_comes_from_the_gguf(store: WeightStore, tpl: ChatTemplate) -> None:
    assert tpl.source == store.meta["chat_template"]
    assert "<|im_start|>" in tpl.source


def test_renders_default_system_prompt_and_generation_prompt(tpl: ChatTemplate) -> None:
    out = tpl.render([{"role": "user", "content": "Hi"}])
    assert out == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_own_system_prompt_and_no_generation_prompt(tpl: ChatTemplate) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}]
    out = tpl.render(msgs, add_generation_prompt=False)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                   "<|im_start|>assistant\nA<|im_end|>\n")


@pytest.mark.parametrize(("messages", "match"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
    ([{"role": "", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}, 3], r"messages\[1\] must be an object"),
])
def test_bad_messages_are_clear_errors(tpl: ChatTemplate, messages: object, match: str) -> None:
    with pytest.raises(ModelInputError, match=match):
        tpl.render(messages)  # type: ignore[arg-type]


def test_template_is_sandboxed() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ModelInputError, match="failed to render"):
        evil.render([{"role": "user", "content": "x"}])


def test_raise_exception_from_template_is_clear() -> None:
    tpl = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ModelInputError, match="first must be user"):
        tpl.render([{"role": "system", "content": "x"}])


def test_broken_template_is_clear() -> None:
    with pytest.raises(ModelInputError, match="does not compile"):
        ChatTemplate("{% for %}")
