"""``POST /responses`` through the real mesh (issue 15): ``responses.create(model="ethen/auto", ...)`` against
one real ``ethen up`` (SmolLM2 over three local workers) returns the model's text, buffered and streamed,
with the receipt naming the mesh, also through a base URL ending in ``/v1``."""

from __future__ import annotations

import openai

from tests.test_up import Up, up

__all__ = ["up"]  # the module-scoped `ethen up` fixture (one process for this module)


def test_responses_through_the_mesh(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base, api_key=up.key, max_retries=0, timeout=120)
    r = client.responses.create(model="ethen/auto", input="What is the capital of France?",
                                temperature=0, max_output_tokens=16)
    assert r.output_text.strip() and r.usage is not None and r.usage.output_tokens > 0
    assert r.model_extra["ethen"]["routing"]["selected_provider"] == "mesh"
    v1 = openai.OpenAI(base_url=up.base.replace("/api/gateway/v1", "/v1"), api_key=up.key, max_retries=0,
                       timeout=120)
    events = list(v1.responses.create(model="ethen/auto", input="Say hello.", temperature=0,
                                      max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                          "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() and text == events[-1].response.output_text
