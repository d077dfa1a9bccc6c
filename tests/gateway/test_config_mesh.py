"""The ``kind = "mesh"`` provider in the gateway config: validation errors name the key and the value, the
provider factory builds an (unstarted) ``MeshProvider``, ``ethen up``'s generated config merges a user config,
and the shipped example loads. No model and no workers here (``tests/mesh/test_gateway_mesh_config.py`` runs
a real ``ethen gateway --config`` over real workers)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ethen.gateway.catalog import Catalog
from ethen.gateway.config import MeshProviderConfig, build_pool, load_config, parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers import PROVIDER_KINDS, build_providers
from ethen.up_config import gateway_document

ROOT = Path(__file__).resolve().parents[2]
SHA = "0" * 64


def mesh_config(**provider: Any) -> dict[str, Any]:
    return {
        "providers": [{"id": "mesh", "kind": "mesh", "workers": {"gpu": "127.0.0.1:50051"}, **provider}],
        "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
        "api_keys": [{"name": "k", "sha256": SHA}],
    }


def test_a_mesh_provider_parses_with_defaults() -> None:
    workers = {"gpu": "127.0.0.1:50051", "mini": "[::1]:50052", "lap": "box.lan:1"}
    p = parse_config(mesh_config(workers=workers, weights={"hop": 2, "capacity": 0.5},
                                 health_interval_s=1)).providers[0]
    assert isinstance(p, MeshProviderConfig)
    assert p.workers == {"gpu": "127.0.0.1:50051", "mini": "[::1]:50052", "lap": "box.lan:1"}
    assert (p.weights.hop, p.weights.capacity, p.weights.latency) == (2.0, 0.5, None)
    assert (p.health_interval_s, p.forward_timeout_s, p.fallback_model) == (1.0, 60.0, None)


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ({"workers": {"gpu": "localhost"}}, "providers[0].workers.gpu = 'localhost': must be 'host:port'"),
        ({"workers": {"gpu": "127.0.0.1:0"}}, "workers.gpu = '127.0.0.1:0': port must be between"),
        ({"workers": {"gpu": "h:99999"}}, "providers[0].workers.gpu = 'h:99999': port must be between"),
        ({"workers": {"gpu": "http://h:1"}}, "providers[0].workers.gpu = 'http://h:1'"),
        ({"workers": {"gpu": 50051}}, "providers[0].workers.gpu = 50051"),
        ({"workers": {}}, "providers[0].workers = {}: Dictionary should have at least 1 item"),
        ({"workers": {"bad id": "h:1"}}, "providers[0].workers.bad id (key) = 'bad id'"),
        ({"workerz": {"gpu": "h:1"}}, "providers[0].workerz = {'gpu': 'h:1'}: Extra inputs"),
        ({"base_url": "http://h:1/v1"}, "providers[0].base_url = 'http://h:1/v1': Extra inputs"),
        ({"weights": {"latncy": 1.0}}, "providers[0].weights.latncy = 1.0: Extra inputs are not permitted"),
        ({"weights": {"hop": -1}}, "providers[0].weights.hop = -1.0: Input should be greater than or equal"),
        ({"health_interval_s": 2}, "providers[0].health_interval_s = 2.0: Input should be less than"),
        ({"health_interval_s": 0}, "providers[0].health_interval_s = 0.0: Input should be greater than 0"),
        ({"fallback_model": ""}, "providers[0].fallback_model = ''"),
        ({"kind": "meshy"}, "providers[0].kind = 'meshy': unknown provider kind (known: 'openai_compat', "
                            "'anthropic', 'gemini', 'azure_openai', 'mesh')"),
    ],
)
def test_mesh_errors_name_the_key_and_the_value(provider: dict[str, Any], message: str) -> None:
    data = mesh_config()
    data["providers"][0].update(provider)
    with pytest.raises(GatewayConfigError) as err:
        parse_config(data)
    assert message in err.value.message


def test_missing_workers_and_missing_kind_are_named() -> None:
    data = mesh_config()
    del data["providers"][0]["workers"]
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.workers: required key is missing"):
        parse_config(data)
    data = mesh_config()
    del data["providers"][0]["kind"]
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.kind: required key is missing"):
        parse_config(data)


def test_a_mesh_route_must_name_the_mesh_model() -> None:
    data = mesh_config()
    data["routes"][0]["upstream_model"] = "gpt-4o"
    with pytest.raises(GatewayConfigError, match=r"routes\[0\]\.upstream_model = 'gpt-4o': provider 'mesh' "
                                                 r"\(kind mesh\) serves only 'smollm2-135m-instruct'"):
        parse_config(data)


def test_mesh_routes_use_the_catalogs_mesh_entry_whatever_the_provider_id() -> None:
    data = mesh_config(id="edge")
    data["routes"][0]["provider"] = "edge"
    (cand,) = build_pool(parse_config(data), Catalog.load())
    assert (cand.provider, cand.model, cand.prices.input_per_mtok, cand.info.supports_tools) == (
        "edge", "smollm2-135m-instruct", 0.0, False)


def test_the_factory_builds_one_provider_per_kind_without_loading_the_mesh() -> None:
    from ethen.gateway.providers.mesh import MeshProvider

    assert set(PROVIDER_KINDS) == {"openai_compat", "anthropic", "gemini", "azure_openai", "mesh"}
    data = mesh_config()
    data["providers"].append({"id": "cloud", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/v1"})
    providers = build_providers(parse_config(data), {})
    mesh = providers["mesh"]
    assert isinstance(mesh, MeshProvider) and mesh.name == "mesh"
    assert mesh.orchestrator is None  # loaded by the lifespan's start(), not at construction
    assert type(providers["cloud"]).__name__ == "OpenAICompatProvider"


def test_ethen_up_document_merges_a_user_config() -> None:
    user = {
        "server": {"port": 1},
        "providers": [{"id": "cloud", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/v1"}],
        "routes": [{"model": "gpt-4o-mini", "provider": "cloud",
                    "info": {"context_window": 1000, "max_output_tokens": 100, "quality": 0.5,
                             "latency_ms": 1.0, "ttft_ms": 1.0},
                    "prices": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}],
        "api_keys": [{"name": "team", "sha256": SHA}],
        "policy": {"remaining_budget_usd": 5},
    }
    doc = gateway_document("127.0.0.1", 8123, "ethen-local-key", {"gpu": "127.0.0.1:5"}, copy.deepcopy(user))
    cfg = parse_config(doc)
    assert cfg.server.port == 8123  # ethen up's --port wins over the user's [server]
    assert [p.id for p in cfg.providers] == ["mesh", "cloud"] and cfg.providers[0].kind == "mesh"
    assert [r.model for r in cfg.routes] == ["smollm2-135m-instruct", "gpt-4o-mini"]
    assert [k.name for k in cfg.api_keys] == ["local", "team"] and cfg.policy.remaining_budget_usd == 5.0
    clash = copy.deepcopy(user)
    clash["providers"][0]["id"] = "mesh"
    with pytest.raises(GatewayConfigError, match=r"providers\[1\]\.id = 'mesh': duplicate"):
        parse_config(gateway_document("127.0.0.1", 1, "ethen-k", {"gpu": "127.0.0.1:5"}, clash))


def test_the_example_mesh_config_loads() -> None:
    cfg = load_config(ROOT / "examples" / "gateway-mesh.toml")
    (mesh,) = cfg.providers
    assert isinstance(mesh, MeshProviderConfig) and set(mesh.workers) == {"gpu", "mini", "laptop"}
    assert [c.id for c in build_pool(cfg, Catalog.load())] == ["mesh/smollm2-135m-instruct"]
