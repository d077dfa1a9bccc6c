"""``ethen up``: the main job on embedded defaults. One command starts a local mesh and the gateway:

1. the model's metadata (config, tokenizer, tensor table; cached on first run): workers keep the GGUF's own
   blocks;
2. three ``ethen worker`` processes with a heterogeneous, partly replicated layout
   (``examples/mesh-layout.toml``, embedded as :data:`~ethen.up_layout.DEFAULT_LAYOUT`, derived from the
   model's layer count by :func:`~ethen.up_layout.default_layout`; ``--layout FILE`` replaces it, refused
   before any worker starts when it does not fit the model, :func:`~ethen.up_layout.check_layout`);
3. a gateway config with one ``kind = "mesh"`` provider listing those workers' addresses, written to
   ``<data dir>/up-gateway.toml`` once validated (rewritten on every run: worker ports are picked by the OS;
   never while another ``ethen up`` runs on that data directory, :mod:`ethen.up_state`);
4. the gateway from that file, by the same code path as ``ethen gateway --config FILE`` (``load_config`` ->
   ``create_app`` -> the provider factory; the lifespan start-up loads the mesh orchestrator: embeddings +
   head, Health polling, a first route), serving ``smollm2-135m-instruct`` (so ``ethen/auto`` routes to it)
   on ``--port`` (default 8080). With ``--model X.gguf`` the route is named after the file's model
   (:func:`ethen.up_config.mesh_route`).

It prints the URL with a curl and an openai-SDK example once the server accepts connections (the example
prints who served the answer, the mesh or any provider ``--config`` adds), and the dashboard's URL (``/ui``,
signed in with the printed admin key). The API key comes from ``ETHEN_API_KEY`` when set; otherwise it is a
key of project ``default`` in the store, generated on first run and stored (mode 600) in the local data
directory (``$ETHEN_DATA_DIR``, else ``$XDG_DATA_HOME/ethen``, else ``~/.local/share/ethen``), and printed:
its requests show in ``ethen usage`` and the dashboard under that project
(:func:`ethen.up_state.project_key`).
Ctrl-C (or SIGTERM) stops the gateway, then every worker it started (SIGTERM, SIGKILL after 3 s).

``--config FILE`` merges a user gateway config into the generated one: its ``[[providers]]``, ``[[routes]]``,
``[[api_keys]]`` and ``[[canaries]]`` are appended after the mesh's (so cloud providers join the pool and
``ethen/*`` aliases choose among them and the mesh), and every other section is used as given (``[policy]``,
``[store]``, ``[model_map]``, ``[cache]``, ``[[hedges]]``, ``[[shadows]]``, ``[compat]``, ...); its
``[server]`` is ignored (``--host`` / ``--port`` decide); the merge rule is
:func:`ethen.gateway.config.overlay.merge_overlay` (``examples/cloud-tools.toml``: tool-capable cloud routes
for agents). Everything is validated before anything runs or is written: the flags (``--port`` 0-65535), the
overlay merged into a stand-in of the generated config, then the whole config with the workers' node ids; a
bad one exits 2 naming the file, the key and the value, and leaves ``up-gateway.toml`` as it was.

Supervision: the workers run under a :class:`~ethen.mesh.worker.supervisor.Supervisor`. A worker that dies
is restarted on the same address (so the written config stays true and the orchestrator's Health polling
routes to it again), after 0.5 s doubling to 30 s while it keeps failing (reset once it stayed up 60 s); each
death and restart is one WARNING line (node id, pid, exit code or signal, next delay). The workers still exit
when ``ethen up`` dies of any signal (:mod:`ethen.mesh.worker.launch`).

``--join HOST:PORT`` opens the mesh provider's membership registry, so workers of other machines join this
mesh (``ethen worker --join``, with ``<data dir>/mesh_token``); the banner prints a worker command that joins
as printed. A registry other hosts reach needs ``--tls-cert`` / ``--tls-key``; the flags are checked by the
mesh provider's own config rules before anything loads (:func:`ethen.up_checks.check_join`).

Choices where the issue is silent:
- Embedded store: without a ``[store]`` in ``--config``, the gateway gets one: ``$ETHEN_DATABASE_URL`` when
  set, else SQLite at ``<data dir>/ethen.db`` (:func:`~ethen.paths.default_store_url`), so projects, project
  keys, budgets, usage and certification receipts work out of the box. The admin key (``$ETHEN_ADMIN_KEY``,
  else generated once into ``<data dir>/admin_key``, mode 600) is printed like the API key; its digest enables
  ``/api/admin/v1`` (also added to a user ``[store]`` that has no ``admin_key_sha256``). ``ethen projects``,
  ``keys``, ``usage`` and ``certify`` find the same store (and config) without flags (:mod:`ethen.admin.cli`).
- The banner's examples ask "What is the capital of France?" with ``temperature: 0`` and ``max_tokens: 32``
  (SmolLM2-135M answers "Capital of France?" wrongly even greedily, and samples nonsense at temperature 1).
  The Python example runs with this interpreter (the venv's ``python``); ``bash run.sh up`` installs the
  ``openai`` SDK it uses, and when ``openai`` is not importable the banner prints the pip command first.
- "ready in N s" counts from the command's start: ``$ETHEN_UP_T0`` (Unix time, exported by ``bash run.sh up``
  before it installs anything), else this module's import (the ``ethen up`` process start).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ethen.knobs import ENGINE_ENV, warn_gone_env
from ethen.paths import data_dir, up_config_path
from ethen.up_checks import check_join, check_overlay, check_port, say, second_port
from ethen.up_config import gateway_document, mesh_route, write_config
from ethen.up_layout import check_layout, default_layout, load_layout
from ethen.up_state import (
    API_KEY_ENV,
    InstanceRunning,
    UpStateError,
    admin_key,
    lock_instance,
    mesh_token_file,
    project_key,
)

if TYPE_CHECKING:
    from ethen.model.choose import EngineOptions

__all__ = ["up"]

_IMPORTED_AT = time.time()  # ~ the process start: ``ethen up``'s modules load first
T0_ENV = "ETHEN_UP_T0"
DB_ENV = "ETHEN_DATABASE_URL"


def _open_weights(model: Path | None = None) -> Any:
    """The weight store (the model's metadata cache), with a spinner and elapsed time while
    the first run builds its cache."""
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
                store = open_weight_store(model)
            finally:
                done.set()
    else:
        store = open_weight_store(model)
    say(f"      ok ({time.perf_counter() - t0:.1f}s)")
    return store


def _startup_logging(level: str) -> None:
    """Start-up progress (``ethen.gateway.startup``, e.g. the mesh loading) as indented plain lines."""
    from ethen.gateway.observation.logformat import LOG_FORMAT_ENV, JsonFormatter

    handler = logging.StreamHandler(sys.stderr)
    json_lines = os.environ.get(LOG_FORMAT_ENV) == "json"  # --log-format json
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter("      %(message)s"))
    startup = logging.getLogger("ethen.gateway.startup")
    startup.addHandler(handler)
    startup.setLevel(logging.INFO if level != "ERROR" else logging.ERROR)
    startup.propagate = False


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # before the server runs (it handles SIGTERM itself): stop the workers started


def _command_start() -> float:
    """Unix time the command started: ``$ETHEN_UP_T0`` (``bash run.sh up``) if plausible, else the import."""
    raw = os.environ.pop(T0_ENV, "")
    try:
        t0 = float(raw)
    except ValueError:
        return _IMPORTED_AT
    return t0 if 0 <= time.time() - t0 < 86400 else _IMPORTED_AT


def up(
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Gateway port (0: a free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Gateway bind address."),
    layout: Path = typer.Option(  # noqa: B008
        None, "--layout", help="Mesh layout TOML (default: 3 workers derived from the model's layer count)."),
    config: Path = typer.Option(  # noqa: B008
        None, "--config", help="Gateway TOML merged in: its providers/routes/api_keys/canaries appended, "
        "other sections as given, \\[server] ignored (examples/cloud-tools.toml: tool-capable cloud routes)."
    ),
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
    log_format: str = typer.Option("text", "--log-format", envvar="ETHEN_LOG_FORMAT",
                                   help="text, or json (one JSON object per line)."),
    model: Path = typer.Option(  # noqa: B008
        None, "--model", help="GGUF model file (llama, qwen2; default: SmolLM2-135M-Instruct)."),
    join: str = typer.Option(
        None, "--join", help="HOST:PORT where workers of other machines join the mesh (ethen worker --join); "
        "not loopback: also --tls-cert and --tls-key (ethen mesh certs)."),
    tls_cert: Path = typer.Option(None, "--tls-cert", help="PEM certificate of the --join registry."),  # noqa: B008
    tls_key: Path = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),  # noqa: B008
    engine: str = typer.Option(
        "auto", "--engine", envvar=ENGINE_ENV, help="auto (by the model: ggml for 1B-class models, "
        "onnxruntime's float32 compute for small ones), ggml or onnx; the workers and the head."),
    accuracy: str = typer.Option(
        "auto", "--accuracy", help="auto (by the model), exact (float32-grade products: onnx) or fast (int8 "
        "activations: ggml); the workers and the head."),
    device: str = typer.Option(
        "auto", "--device", help="auto (a GPU when the engine has one), cpu, cuda (ggml's CUDA backend if "
        "installed, else onnxruntime-gpu), metal or vulkan (ggml backends; refused when not installed); the "
        "workers and the head."),
) -> None:
    """Start a local 3-worker mesh and the gateway serving it; Ctrl-C stops them all."""
    t0 = _command_start()
    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise typer.BadParameter(f"--log-level = {log_level!r}: use debug, info, warning or error")
    user = check_overlay(config, host, port, model) if config is not None else None  # before anything runs
    from ethen.mesh.worker.cli import engine_options

    warn_gone_env()
    try:  # to the workers' command lines and the head's loader (the mesh provider's config)
        options = engine_options(engine, accuracy, device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        lock = lock_instance(data_dir())  # never overwrite the config of a running `ethen up`
    except InstanceRunning as exc:
        say(f"error: {exc}")
        raise typer.Exit(1) from None
    try:
        _up_locked(t0, level, port, host, layout, user, log_level, log_format, model, join, tls_cert, tls_key,
                   options)
    finally:
        os.close(lock)


def _up_locked(t0: float, level: str, port: int, host: str, layout: Path | None, user: dict[str, Any] | None,
               log_level: str, log_format: str, model: Path | None, join: str | None, tls_cert: Path | None,
               tls_key: Path | None, options: EngineOptions) -> None:
    try:
        port = check_port(host, port)  # before anything slow
    except OSError as exc:
        say(f"error: {exc}")
        raise typer.Exit(1) from None
    from ethen.gateway.observation.logformat import FORMATS, configure_logging

    if log_format not in FORMATS:
        raise typer.BadParameter(f"--log-format = {log_format!r}: use text or json")
    configure_logging(level, log_format)
    _startup_logging(level)
    from ethen.mesh.worker.cli import one_blas_thread

    one_blas_thread()  # the orchestrator's head matmul shares the cores with the workers
    from ethen.model.errors import ModelError  # after one_blas_thread: it imports NumPy
    workers_spec = load_layout(layout)
    tls = check_join(join, tls_cert, tls_key)
    user_admin = isinstance((user or {}).get("store"), dict) and "admin_key_sha256" in (user or {})["store"]
    admin = None if user_admin else admin_key()
    key, key_source, store_key = _project_key(host, port, user, admin)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from ethen.mesh.worker.supervisor import Supervisor

    supervisor = Supervisor()
    try:
        say("[1/4] model weights: the GGUF's own blocks (the first run caches its metadata) ...")
        store = _open_weights(model)
        n_layers = int(store.config.n_layers)
        if layout is None:
            workers_spec = default_layout(n_layers)
        else:
            try:
                check_layout(workers_spec, n_layers, f"--layout {layout}", partial=join is not None)
            except typer.BadParameter as exc:
                say(f"error: {exc.message}")
                raise typer.Exit(2) from None
        from ethen.app import PREFIX, create_app
        from ethen.gateway.accounting.auth import hash_key
        from ethen.gateway.api.serve import serve
        from ethen.gateway.catalog import Catalog
        from ethen.gateway.config import parse_config, skip_providers_without_keys
        from ethen.gateway.errors import GatewayConfigError
        from ethen.up_banner import banner

        model_path = None if model is None else str(model.resolve())
        token_file = str(mesh_token_file().resolve())
        route = None if model is None else mesh_route(store)

        def document(workers: dict[str, str]) -> dict[str, Any]:
            return gateway_document(host, port, None if store_key else key, workers, user,
                                    admin_key_sha256=hash_key(admin[0]) if admin else None,
                                    model_path=model_path, token_file=token_file, route=route, join=join,
                                    tls=tls, engine_options=options)

        try:  # the whole config, with the workers' real node ids, before any of them starts
            parse_config(document({node: "127.0.0.1:1" for node, _, _ in workers_spec}),
                         source="the config of `ethen up`" if user is None else
                         "the config of `ethen up` with --config (its entries after the mesh's)")
        except GatewayConfigError as exc:
            say(f"error: {exc.message}")
            raise typer.Exit(2) from None
        model_args = [] if model is None else ["--model", model_path or ""]
        model_args += ["--token-file", token_file, *options.args()]
        # the workers start at once: ready in 4.4 s against 6.1 s one after the other (2-core VM, quantized,
        # bench/up_load.py --ref, medians of 3; each load is ~1.5-2 CPU s, most of it on one core).
        n = len(workers_spec)
        say(f"[2/4] workers: starting {n}{' at once' if n > 1 else ''} ...")
        with ThreadPoolExecutor(max_workers=n) as pool:  # leaving it waits for every spawn (stopped below)
            started = [pool.submit(supervisor.add, node, layers,
                                   extra_args=["--capacity-score", str(score), *model_args])
                       for node, layers, score in workers_spec]
            for i, ((node, layers, _score), fut) in enumerate(zip(workers_spec, started, strict=True), 1):
                w = fut.result()
                say(f"[2/4] worker {i}/{n}: {node} layers {layers} ...")
                say(f"      ready on {w.address} (pid {w.pid})")
        supervisor.start()  # from now on a worker that dies is restarted on its address
        doc = document(supervisor.addresses)
        try:
            cfg = skip_providers_without_keys(parse_config(doc, source=str(up_config_path())))
            app = create_app(cfg, catalog=Catalog.load())
        except GatewayConfigError as exc:
            say(f"error: {exc.message}")
            raise typer.Exit(2) from None
        path = write_config(doc, up_config_path())  # validated: only now the file is replaced
        say(f"[3/4] gateway config: {path}")
        say("[4/4] gateway: starting its providers (the mesh loads its head, polls the workers, routes) ...")
        text = banner(f"http://{host}:{port}{PREFIX}", key, key_source, admin, path, len(workers_spec),
                      join=None if join is None else (join, token_file, tls is not None),
                      second_port=second_port(host, port))

        def announce() -> None:
            took = f"Ethen is up, ready in {time.time() - t0:.1f} s since the command started:"
            print(text.replace("Ethen is up:", took, 1), flush=True)

        if not serve(app, host=host, port=port, log_level=log_level, on_started=announce):
            say("error: the gateway did not start (see the log above)")
            raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    except typer.Exit:  # a RuntimeError too: keep its status (2 for a bad --layout or config)
        raise
    except (TimeoutError, RuntimeError, OSError, ModelError) as exc:  # a worker did not start, bad GGUF, ...
        say(f"error: {exc}")
        raise typer.Exit(1) from None
    finally:
        say("stopping ...")
        supervisor.stop(timeout=3.0)
        say("stopped.")


def _project_key(host: str, port: int, user: dict[str, Any] | None,
                 admin: tuple[str, str] | None) -> tuple[str, str, bool]:
    """(API key, where it came from, whether it is a store key): :func:`ethen.up_state.project_key` in the
    store this config serves (exit 1 naming the store's error: unreachable, ...)."""
    from ethen.gateway.accounting.auth import KEY_PREFIX, hash_key
    from ethen.gateway.config import parse_config, store_url
    from ethen.gateway.errors import GatewayConfigError

    env = os.environ.get(API_KEY_ENV)
    if env and not env.startswith(KEY_PREFIX):
        say(f"error: {API_KEY_ENV} must start with {KEY_PREFIX!r}")
        raise typer.Exit(2)
    try:
        cfg = parse_config(gateway_document(host, port, None, {"gpu": "127.0.0.1:1"}, user,
                                            admin_key_sha256=hash_key(admin[0]) if admin else None))
        url = store_url(cfg)
    except GatewayConfigError as exc:
        say(f"error: {exc.message}")
        raise typer.Exit(2) from None
    if url is None:  # not reached: with no [store] of its own, the config of `ethen up` has the embedded one
        say("error: the config of `ethen up` has no [store]: its API key lives in the store")
        raise typer.Exit(2)
    try:
        return project_key(url, data_dir() / "api_key")
    except UpStateError as exc:
        say(f"error: the store of `ethen up`: {exc}")
        raise typer.Exit(1) from None

