"""``ethen up``: the main job on embedded defaults. One command starts a local mesh and the gateway:

1. the model's float32 weight cache (built from the GGUF on first run);
2. three ``ethen worker`` processes with a heterogeneous, partly replicated layout
   (``examples/mesh-layout.toml``, embedded as :data:`DEFAULT_LAYOUT`; ``--layout FILE`` replaces it);
3. a gateway config with one ``kind = "mesh"`` provider listing those workers' addresses, written to
   ``<data dir>/up-gateway.toml`` (rewritten on every run: worker ports are picked by the OS);
4. the gateway from that file, by the same code path as ``ethen gateway --config FILE`` (``load_config`` ->
   ``create_app`` -> the provider factory; the lifespan start-up loads the mesh orchestrator: embeddings +
   head, Health polling, a first route), serving ``smollm2-135m-instruct`` (so ``ethen/auto`` routes to it)
   on ``--port`` (default 8080).

It prints the URL with a curl and an openai-SDK example once the server accepts connections. The API key
comes from ``ETHEN_API_KEY`` when set; otherwise one is generated on first run and stored (mode 600) in the
local data directory (``$ETHEN_DATA_DIR``, else ``$XDG_DATA_HOME/ethen``, else ``~/.local/share/ethen``), and
printed. Ctrl-C (or SIGTERM) stops the gateway, then every worker it started (SIGTERM, SIGKILL after 3 s).

``--config FILE`` merges a user gateway config into the generated one: its ``[[providers]]``, ``[[routes]]``,
``[[api_keys]]`` and ``[[canaries]]`` are appended after the mesh's (so cloud providers join the pool and
``ethen/*`` aliases choose among them and the mesh), and its ``[policy]`` / ``[store]`` are used as given;
its ``[server]`` is ignored (``--host`` / ``--port`` decide). The merged file is validated like any config.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
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


def gateway_document(host: str, port: int, key: str, workers: dict[str, str],
                     user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway config ``ethen up`` serves (a TOML document as a dict): the mesh over ``workers``, the
    local key, and the optional user config's providers, routes, keys, canaries, policy and store."""
    from ethen.gateway.auth import hash_key

    user = dict(user or {})
    user.pop("server", None)
    doc: dict[str, Any] = {
        "server": {"host": host, "port": port},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": workers, "start_timeout_s": 60.0}],
        "routes": [{"model": MODEL, "provider": "mesh"}],
        "api_keys": [{"name": "local", "sha256": hash_key(key)}],
    }
    for section in ("providers", "routes", "api_keys", "canaries"):
        extra = user.pop(section, [])
        merged = [*doc.get(section, []), *(extra if isinstance(extra, list) else [extra])]
        if merged:
            doc[section] = merged
    doc.update(user)  # policy, store, and anything unknown (which validation then names)
    return doc


def _read_user_config(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"--config {path}: {exc}") from None


def write_config(doc: dict[str, Any], path: Path) -> Path:
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `ethen up` at each start (worker ports change); ethen gateway --config FILE\n"
    path.write_text(header + tomli_w.dumps(doc), encoding="utf-8")
    return path


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _open_weights() -> Any:
    """The float32 weight cache, with a spinner and elapsed time while the first run builds it."""
    from rich.console import Console

    from ethen.model.gguf_loader import open_weight_store

    t0 = time.perf_counter()
    console = Console(stderr=True)
    if console.is_terminal:
        with console.status("      building/opening the cache ...") as status:
            done = threading.Event()

            def tick() -> None:
                while not done.wait(0.5):
                    status.update(f"      building/opening the cache ... {time.perf_counter() - t0:.0f}s")

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            try:
                store = open_weight_store()
            finally:
                done.set()
    else:
        store = open_weight_store()
    _say(f"      ok ({time.perf_counter() - t0:.1f}s)")
    return store


def _startup_logging(level: str) -> None:
    """Start-up progress (``ethen.gateway.startup``, e.g. the mesh loading) as indented plain lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("      %(message)s"))
    startup = logging.getLogger("ethen.gateway.startup")
    startup.addHandler(handler)
    startup.setLevel(logging.INFO if level != "ERROR" else logging.ERROR)
    startup.propagate = False


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # before the server runs (it handles SIGTERM itself): stop the workers started


def up(
    port: int = typer.Option(8080, "--port", help="Gateway port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Gateway bind address."),
    layout: Path = typer.Option(None, "--layout", help="Mesh layout TOML (default: embedded)."),  # noqa: B008
    config: Path = typer.Option(  # noqa: B008
        None, "--config", help="Gateway TOML whose providers/routes/keys/canaries/policy/store are merged in."
    ),
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Start a local 3-worker mesh and the gateway serving it; Ctrl-C stops them all."""
    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise typer.BadParameter(f"--log-level = {log_level!r}: use debug, info, warning or error")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _startup_logging(level)
    from ethen.mesh.worker.cli import one_blas_thread

    one_blas_thread()  # the orchestrator's head matmul shares the cores with the workers
    workers_spec = load_layout(layout)
    user = _read_user_config(config) if config is not None else None
    key, key_source = api_key()
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.perf_counter()
    from ethen.mesh.worker.launch import WorkerProcess, spawn_worker

    started: list[WorkerProcess] = []
    try:
        _say("[1/4] model weights: the float32 cache (the first run builds it from the GGUF) ...")
        _open_weights()
        for i, (node, layers, score) in enumerate(workers_spec, 1):
            _say(f"[2/4] worker {i}/{len(workers_spec)}: {node} layers {layers} ...")
            w = spawn_worker(node, layers, extra_args=["--capacity-score", str(score)])
            started.append(w)
            _say(f"      ready on {w.address} (pid {w.pid})")
        from ethen.gateway.app import PREFIX, create_app
        from ethen.gateway.catalog import Catalog
        from ethen.gateway.config import load_config
        from ethen.gateway.errors import GatewayConfigError
        from ethen.gateway.serve import serve

        path = write_config(gateway_document(host, port, key, {w.node_id: w.address for w in started}, user),
                            data_dir() / "up-gateway.toml")
        _say(f"[3/4] gateway config: {path}")
        try:
            cfg = load_config(path)
            app = create_app(cfg, catalog=Catalog.load())
        except GatewayConfigError as exc:
            _say(f"error: {exc.message}")
            raise typer.Exit(2) from None
        _say("[4/4] gateway: starting its providers (the mesh loads its head, polls the workers, routes) ...")
        url = f"http://{host}:{port}{PREFIX}"
        banner = f"""
Ethen is up: {url}
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

The same gateway, without `ethen up`, while these workers run:  ethen gateway --config {path}
Ctrl-C stops the gateway and the {len(started)} workers."""

        def announce() -> None:
            took = f"Ethen is up ({time.perf_counter() - t0:.1f}s):"
            print(banner.replace("Ethen is up:", took, 1), flush=True)

        if not serve(app, host=host, port=port, log_level=log_level, on_started=announce):
            _say("error: the gateway did not start (see the log above)")
            raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    except (TimeoutError, RuntimeError, OSError) as exc:  # a worker did not start, a port was taken, ...
        _say(f"error: {exc}")
        raise typer.Exit(1) from None
    finally:
        _say("stopping ...")
        for w in started:
            w.stop(timeout=3.0)
        _say("stopped.")
