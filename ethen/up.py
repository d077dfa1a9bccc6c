"""``ethen up``: the main job on embedded defaults. One command starts a local mesh and the gateway:

1. the model's float32 weight cache (built from the GGUF on first run);
2. three ``ethen worker`` processes with a heterogeneous, partly replicated layout
   (``examples/mesh-layout.toml``, embedded as :data:`DEFAULT_LAYOUT`; ``--layout FILE`` replaces it);
3. the orchestrator (embeddings + head, Health-fed routing, failover) in this process;
4. the OpenAI-compatible gateway with the ``mesh`` provider serving ``smollm2-135m-instruct`` (so
   ``ethen/auto`` routes to it), on ``--port`` (default 8080).

It prints the URL with a curl and an openai-SDK example. The API key comes from ``ETHEN_API_KEY`` when set;
otherwise one is generated on first run and stored (mode 600) in the local data directory
(``$ETHEN_DATA_DIR``, else ``$XDG_DATA_HOME/ethen``, else ``~/.local/share/ethen``), and printed.
Ctrl-C (or SIGTERM) stops the gateway, then every worker it started (SIGTERM, SIGKILL after 3 s).

Choice: the gateway config's provider entry for ``mesh`` uses the ``openai_compat`` kind with a placeholder
URL, because the provider instance is supplied in-process (``create_app(providers=...)``), as the gateway's
in-process provider test does; the config schema has no ``mesh`` kind.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import typer

__all__ = ["DEFAULT_LAYOUT", "api_key", "data_dir", "load_layout", "up"]

DEFAULT_LAYOUT: tuple[tuple[str, str, float], ...] = (
    ("gpu", "0-9", 10.0),
    ("mini", "0-9,10-19", 6.0),
    ("laptop", "10-19,20-29", 3.0),
)
MODEL = "smollm2-135m-instruct"


def data_dir() -> Path:
    env = os.environ.get("ETHEN_DATA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "ethen"


def api_key() -> tuple[str, str]:
    """(key, where it came from): ``ETHEN_API_KEY``, the stored key, or a new one stored now."""
    from ethen.gateway.auth import KEY_PREFIX

    env = os.environ.get("ETHEN_API_KEY")
    if env:
        if not env.startswith(KEY_PREFIX):
            raise typer.BadParameter(f"ETHEN_API_KEY must start with {KEY_PREFIX!r}")
        return env, "ETHEN_API_KEY"
    path = data_dir() / "api_key"
    if path.is_file():
        key = path.read_text(encoding="utf-8").strip()
        if key.startswith(KEY_PREFIX):
            return key, str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = f"{KEY_PREFIX}-{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")
    return key, f"{path} (generated now)"


def load_layout(path: Path | None) -> list[tuple[str, str, float]]:
    """Workers of a layout TOML file (``[[workers]] node_id, layers, capacity_score``), or the defaults."""
    if path is None:
        return list(DEFAULT_LAYOUT)
    from ethen.mesh.worker.server import parse_fragments

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"--layout {path}: {exc}") from None
    workers = doc.get("workers")
    if not isinstance(workers, list) or not workers:
        raise typer.BadParameter(f"--layout {path}: needs at least one [[workers]] table")
    out: list[tuple[str, str, float]] = []
    for i, w in enumerate(workers):
        node, layers, score = w.get("node_id"), w.get("layers"), w.get("capacity_score", 1.0)
        if not isinstance(node, str) or not node or not isinstance(layers, str):
            raise typer.BadParameter(f"--layout {path}: workers[{i}] needs node_id and layers strings")
        try:
            parse_fragments(layers)
        except ValueError as exc:
            raise typer.BadParameter(f"--layout {path}: workers[{i}].{exc}") from None
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise typer.BadParameter(f"--layout {path}: workers[{i}].capacity_score must be a number")
        out.append((node, layers, float(score)))
    return out


def _gateway_config(host: str, port: int, key: str) -> Any:
    from ethen.gateway.auth import hash_key
    from ethen.gateway.config import parse_config

    return parse_config({
        "server": {"host": host, "port": port},
        "providers": [{"id": "mesh", "kind": "openai_compat", "base_url": "http://127.0.0.1:9/in-process",
                       "timeouts": {"connect_s": 5.0, "first_byte_s": 120.0, "total_s": 600.0}}],
        "routes": [{"model": MODEL, "provider": "mesh"}],
        "api_keys": [{"name": "local", "sha256": hash_key(key)}],
    })


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def up(
    port: int = typer.Option(8080, "--port", help="Gateway port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Gateway bind address."),
    layout: Path = typer.Option(None, "--layout", help="Mesh layout TOML (default: embedded)."),  # noqa: B008
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Start a local 3-worker mesh, its orchestrator and the gateway; Ctrl-C stops them all."""
    import logging

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ethen.mesh.worker.cli import one_blas_thread

    one_blas_thread()  # the orchestrator's head matmul shares the cores with the workers
    workers_spec = load_layout(layout)
    key, key_source = api_key()
    t0 = time.perf_counter()
    _say("[1/4] model weights: opening the float32 cache (the first run builds it from the GGUF) ...")
    from ethen.model.gguf_loader import open_weight_store

    store = open_weight_store()
    _say(f"      ok ({time.perf_counter() - t0:.1f}s)")
    from ethen.mesh.worker.launch import WorkerProcess, spawn_worker

    started: list[WorkerProcess] = []
    orch = None
    try:
        for i, (node, layers, score) in enumerate(workers_spec, 1):
            _say(f"[2/4] worker {i}/{len(workers_spec)}: {node} layers {layers} ...")
            w = spawn_worker(node, layers, extra_args=["--capacity-score", str(score)])
            started.append(w)
            _say(f"      ready on {w.address} (pid {w.pid})")
        _say("[3/4] orchestrator: polling worker health, choosing a route ...")
        from ethen.mesh.orchestrator import Orchestrator

        orch = Orchestrator.load({w.node_id: w.address for w in started}, store=store).start()
        route = orch.route_for(32)
        _say("      route now: " + " -> ".join(f"{s.node_id} {s.first}-{s.last}" for s in route.stages)
             + f" (cost {route.cost:.1f})")
        _say("[4/4] gateway ...")
        import uvicorn

        from ethen.gateway.app import PREFIX, create_app
        from ethen.gateway.catalog import Catalog
        from ethen.gateway.providers.mesh import MeshProvider

        cfg = _gateway_config(host, port, key)
        app = create_app(cfg, catalog=Catalog.load(), providers={"mesh": MeshProvider(orch)})
        url = f"http://{host}:{port}{PREFIX}"
        print(f"""
Ethen is up ({time.perf_counter() - t0:.1f}s): {url}
API key ({key_source}):
  {key}

curl {url}/chat/completions \\
  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "ethen/auto", "messages": [{{"role": "user", "content": "Capital of France?"}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}", api_key="{key}")
r = client.chat.completions.create(model="ethen/auto", messages=[{{"role": "user", "content": "Hi!"}}])
print(r.choices[0].message.content)
print(r.model_extra["ethen"]["routing"]["mesh"]["route"]["nodes"])
PY

Ctrl-C stops the gateway and the {len(started)} workers.""", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                               access_log=False, lifespan="on"))
        server.run()
    except (TimeoutError, RuntimeError, OSError) as exc:  # a worker did not start, a port was taken, ...
        _say(f"error: {exc}")
        raise typer.Exit(1) from None
    finally:
        _say("stopping ...")
        if orch is not None:
            orch.close()
        for w in started:
            w.stop(timeout=3.0)
        _say("stopped.")
