"""``POST /embeddings`` (issue 15) through a live gateway to the scripted upstream's ``/v1/embeddings``, with
the official ``openai`` SDK; and the project budget (402) on ``/embeddings`` and ``/responses``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ethen.app import create_app
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.budget_harness import admin, live_store, new_project_key
from tests.gateway.schemas import validator
from tests.gateway.service_harness import CLIENT_KEY, ENV, ROUTES, Live, config_dict, live
from tests.gateway.upstream import Behavior

EMBED_ROUTES: list[dict[str, Any]] = [
    {"model": "embed-small", "provider": "alpha", "upstream_model": "up-embed-a", "endpoint": "embeddings",
     "info": {"context_window": 8192}, "prices": {"input_per_mtok": 20.0}},
    {"model": "embed-small", "provider": "beta", "upstream_model": "up-embed-b", "endpoint": "embeddings",
     "info": {"context_window": 8192}, "prices": {"input_per_mtok": 30.0}},
]


@pytest.fixture(scope="module")
def lv() -> Live:
    with live(routes=[*ROUTES, *EMBED_ROUTES]) as running:
        yield running  # type: ignore[misc]


def test_embeddings_through_the_sdk_and_the_v1_base_url(lv: Live) -> None:
    for base in (lv.base_url, f"{lv.gateway.url}/v1"):
        client = openai.OpenAI(base_url=base, api_key=CLIENT_KEY, max_retries=0, timeout=15)
        r = client.embeddings.create(
            model="embed-small", input=["abc", "hello world"], encoding_format="float"
        )
        assert [d.embedding[0] for d in r.data] == [0.3, 1.1] and r.usage.prompt_tokens == 11
        routing = r.model_extra["ethen"]["routing"]
        assert (routing["selected_provider"], routing["selected_model"]) == ("alpha", "embed-small")
        call = lv.script.calls[-1]
        assert call["path"] == "embeddings" and call["body"]["model"] == "up-embed-a"
        assert call["body"]["input"] == ["abc", "hello world"]
    raw = httpx.post(f"{lv.base_url}/embeddings", json={"model": "embed-small", "input": "x"},
                     headers={"authorization": f"Bearer {CLIENT_KEY}"})
    body = raw.json()
    del body["ethen"]
    assert not list(validator("CreateEmbeddingResponse").iter_errors(body))


def test_embedding_routes_are_not_chat_candidates(lv: Live) -> None:
    with pytest.raises(openai.NotFoundError):  # an embeddings route serves no chat request
        lv.client().chat.completions.create(model="embed-small", messages=[{"role": "user", "content": "x"}])
    r = lv.client().chat.completions.create(model="ethen/cheap", messages=[{"role": "user", "content": "x"}])
    assert not r.model_extra["ethen"]["routing"]["selected_model"].startswith("embed")


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "ethen/auto", "input": "x"}, 400, "alias_not_supported_for_embeddings", "model"),
        ({"model": "beta-small", "input": "x"}, 404, "model_not_found", "model"),
        ({"input": "x"}, 400, "missing_required_parameter", "model"),
        ({"model": "embed-small"}, 400, "missing_required_parameter", "input"),
        ({"model": "embed-small", "input": ""}, 400, "invalid_value", "input"),
        ({"model": "embed-small", "input": []}, 400, "invalid_value", "input"),
        ({"model": "embed-small", "input": [1, "a"]}, 400, "invalid_type", "input"),
        ({"model": "embed-small", "input": {"a": 1}}, 400, "invalid_type", "input"),
    ],
)
def test_embeddings_refusals(lv: Live, body: dict[str, Any], status: int, code: str, param: str) -> None:
    before = len(lv.script.calls)
    r = httpx.post(f"{lv.base_url}/embeddings", json=body, headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == status, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    assert len(lv.script.calls) == before
    assert httpx.post(f"{lv.base_url}/embeddings", json=body).status_code == 401


def test_embeddings_fall_back_to_the_next_route_of_the_model() -> None:
    with live({"up-embed-a": Behavior(fail_status=503)}, routes=[*ROUTES, *EMBED_ROUTES]) as lv:
        r = lv.client().embeddings.create(model="embed-small", input="x")
        routing = r.model_extra["ethen"]["routing"]
        assert [a["outcome"] for a in routing["attempts"]] == ["error", "ok"]
        assert routing["selected_provider"] == "beta" and lv.script.models_called()[-2:] == [
            "up-embed-a", "up-embed-b"]


def test_an_embeddings_route_on_a_provider_without_embeddings_is_a_config_error() -> None:
    route = {**EMBED_ROUTES[0], "provider": "gamma"}  # anthropic: no embeddings
    cfg = parse_config(config_dict("http://127.0.0.1:9", routes=[*ROUTES, route]))
    with pytest.raises(GatewayConfigError, match=r"routes\[4\]\.endpoint"):
        create_app(cfg, env=ENV)


def test_budgets_apply_to_embeddings_and_responses(tmp_path: Path) -> None:
    with live_store(f"sqlite:///{tmp_path / 'gw.db'}", routes=[*ROUTES, *EMBED_ROUTES]) as lv:
        key = new_project_key(lv, "emb", budget_usd=1.0, budget_window="day")
        lv.client(key).embeddings.create(model="embed-small", input="some text")
        with admin(lv) as a:
            window = a.get("/projects/emb").json()["window"]
        assert window["settled_usd"] == pytest.approx(11 * 20.0 / 1e6)  # upstream prompt tokens x price
        assert window["reserved_usd"] == 0
        poor = new_project_key(lv, "poor", budget_usd=1e-9, budget_window="day")
        with pytest.raises(openai.APIStatusError) as ei:
            lv.client(poor).embeddings.create(model="embed-small", input="some text")
        assert ei.value.status_code == 402 and ei.value.code == "budget_exceeded"
        with pytest.raises(openai.APIStatusError) as ei2:
            lv.client(poor).responses.create(model="ethen/auto", input="hi")
        assert ei2.value.status_code == 402 and ei2.value.code == "budget_exceeded"
        # a responses call is settled like a chat call
        lv.client(key).responses.create(model="beta-small", input="hi", max_output_tokens=5)
        with admin(lv) as a:
            usage = a.get("/usage", params={"project": "emb"}).json()["data"]
        assert {u["model"] for u in usage} == {"embed-small", "beta-small"}
