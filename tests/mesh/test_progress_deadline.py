"""The progress deadline of stage calls (stuck nodes): its arithmetic and the mesh provider's
``progress_timeout_s`` key. The behaviour against a SIGSTOPped worker is tested across namespaced hosts in
``tests/mesh/test_mesh_hosts.py``."""

from __future__ import annotations

from typing import Any

import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers import build_providers
from ethen.mesh.orchestrator.rounds import DEFAULT_PROGRESS_TIMEOUT_S, call_timeout

SHA = "0" * 64


def _config(**provider: Any) -> dict[str, Any]:
    return {
        "providers": [{"id": "mesh", "kind": "mesh", "workers": {"gpu": "127.0.0.1:9"}, **provider}],
        "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
        "api_keys": [{"name": "k", "sha256": SHA}],
    }


def test_the_deadline_grows_per_started_128_rows_and_is_capped() -> None:
    assert call_timeout(2.0, 1, 60.0) == 2.0  # a decode step
    assert call_timeout(2.0, 128, 60.0) == 2.0
    assert call_timeout(2.0, 129, 60.0) == 4.0  # two chunks of work
    assert call_timeout(2.0, 2048, 60.0) == 32.0
    assert call_timeout(2.0, 2048, 10.0) == 10.0  # never past forward_timeout_s
    assert call_timeout(None, 1, 60.0) == 60.0  # no progress deadline: forward_timeout_s alone


def test_progress_timeout_s_in_the_mesh_provider_config() -> None:
    p = parse_config(_config()).providers[0]
    assert p.progress_timeout_s == DEFAULT_PROGRESS_TIMEOUT_S == 5.0  # type: ignore[union-attr]
    q = parse_config(_config(progress_timeout_s=1.5)).providers[0]
    assert q.progress_timeout_s == 1.5  # type: ignore[union-attr]
    with pytest.raises(GatewayConfigError, match=r"providers\[0\]\.progress_timeout_s = 0\.0: .*greater"):
        parse_config(_config(progress_timeout_s=0))


def test_the_provider_hands_progress_timeout_s_to_its_orchestrator() -> None:
    provider: Any = build_providers(parse_config(_config(progress_timeout_s=1.5, start_timeout_s=0)))["mesh"]
    orch = provider._loader()  # embeddings + head load; the worker address answers nothing
    try:
        assert orch.progress_timeout_s == 1.5
        assert orch.rounds.progress_timeout_s == 1.5
        assert orch.open_session(4, route=_any_route(orch)).progress_timeout_s == 1.5
    finally:
        orch.close()


def _any_route(orch: Any) -> Any:
    from ethen.mesh.orchestrator import plan_route
    from ethen.mesh.routing import NodeState

    return plan_route([NodeState("gpu", 1.0, 0.0, 1.0, [(0, orch.config.n_layers - 1)])],
                      orch.config.n_layers, 4, orch.weights, orch.model_name)
