"""Logit parity of the tiny ``llama`` / ``qwen2`` GGUFs with transformers' own GGUF loader (optional extra
``parity``), single process and split across 2-3 layer stacks. Skips (with the reason) without it.

The models with ``rope_freqs`` / linear RoPE scaling are left out: transformers' GGUF config mapping reads
neither (they are checked against the independent reference in ``test_tiny_models``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ethen.model import load_layer_stacks
from tests.model.conftest import Tiny

SKIP_REASON = "parity extra not installed: pip install -e '.[parity]' torch==2.13.0"
torch = pytest.importorskip("torch", reason=SKIP_REASON)
transformers = pytest.importorskip("transformers", reason=SKIP_REASON)

MAX_ABS_DIFF = 1e-3
NAMES = ["llama-mixed", "qwen2"]
SPLITS = ["0-2", "0-0,1-2", "0-0,1-1,2-2"]


def _hf(t: Tiny) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(t.path.parent), gguf_file=t.path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.mark.parametrize("name", NAMES)
def test_tiny_logits_match_transformers_single_and_split(tiny_models: dict[str, Tiny], name: str) -> None:
    t = tiny_models[name]
    hf = _hf(t)
    ids = t.model.tokenizer.encode(t.model.chat_template.render([{"role": "user", "content": "hello world"}]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    for ranges in SPLITS:
        stacks = load_layer_stacks(ranges, t.store)
        h = t.model.ends.embed(ids)
        pos = np.arange(len(ids))
        for s in stacks:
            h = s.forward(h, pos, s.new_kv_cache())
        ours = t.model.ends.logits(h)
        diff = float(np.abs(ours - ref).max())
        print(f"{name} {ranges}: max abs logit diff {diff:.3g}")
        assert diff <= MAX_ABS_DIFF
