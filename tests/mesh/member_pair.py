"""Two gateway instances (A, B) over one mesh membership, for the membership tests of each backend (Redis
``[shared]``: ``test_mesh_shared_membership.py``; the ``[store]``: ``test_mesh_store_membership.py``).

Both serve one config: the backend's section, a mesh provider with static worker ``a`` on layers 0-19,
``join`` on one port and ``member_expiry_s``. A starts first and binds the join port; B cannot and routes
through the shared membership (what the N processes of ``ethen gateway --workers N`` do)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.gateway.accounting.auth import hash_key
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from tests.mesh.test_mesh_membership import Gateway, _free_port, _until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def listed(gw: Gateway, node: str, alive: bool | None = None) -> bool:
    """Whether ``gw``'s metrics list ``node`` (and, given ``alive``, with that liveness)."""
    text = httpx.get(f"{gw.base}/metrics", timeout=5).text
    if alive is None:
        return f'ethen_mesh_node_alive{{node="{node}",provider="mesh"}}' in text
    return f'ethen_mesh_node_alive{{node="{node}",provider="mesh"}} {1.0 if alive else 0.0}' in text


def ask(gw: Gateway, key: str) -> httpx.Response:
    return httpx.post(f"{gw.base}/chat/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                      json={"model": "ethen/auto", "temperature": 0, "max_tokens": 8, "messages": QUESTION})


def gateway_pair(backend: dict[str, Any], key: str, expiry_s: float,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Yield ``{"A", "B", "registry", "workers"}`` (``backend``: the config's ``[shared]`` or ``[store]``
    section as ``{name: table}``); stops both gateways and every worker in ``workers`` afterwards."""
    started: list[WorkerProcess] = []
    gateways: list[Gateway] = []
    try:
        a = spawn_worker("a", "0-9,10-19")
        started.append(a)
        join_port = _free_port()
        for name in ("A", "B"):
            port = _free_port()
            cfg = {
                "server": {"host": "127.0.0.1", "port": port},
                **backend,
                "providers": [{"id": "mesh", "kind": "mesh", "workers": {"a": a.address},
                               "start_timeout_s": 0.0, "join": f"127.0.0.1:{join_port}",
                               "insecure": True, "member_expiry_s": expiry_s}],
                "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
                "api_keys": [{"name": "test", "sha256": hash_key(key)}],
            }
            tmp: Path = tmp_path_factory.mktemp(f"gateway-{name}")
            gateways.append(Gateway(cfg, tmp, port))
            if name == "A":  # A binds the join port before B tries
                _until(lambda: "workers may join on port" in gateways[0].log.read_text(), 30, "A's registry")
        yield {"A": gateways[0], "B": gateways[1], "registry": f"127.0.0.1:{join_port}", "workers": started}
    finally:
        for gw in gateways:
            gw.stop()
        for w in started:
            w.stop()


def join(pair: dict[str, Any], node: str, layers: str = "20-29") -> WorkerProcess:
    """Start worker ``node`` with ``--join`` to the pair's registry (stopped with the pair)."""
    w = spawn_worker(node, layers, extra_args=["--join", pair["registry"]])
    pair["workers"].append(w)
    return w
