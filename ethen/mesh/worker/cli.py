"""``ethen worker``: serve some fragments of the model's layers over gRPC.

Prints ``READY <host>:<port>`` on stdout (flushed) once the layers are loaded and the port is bound, so a
parent process (``ethen up``, tests, benchmarks) can wait for it; ``--port 0`` binds a free port and reports
it there.
Credentials (:mod:`ethen.mesh.auth`): ``--tls-cert F --tls-key F`` serve TLS, ``--token-file F`` requires
``authorization: Bearer <token>`` on every call. Binding a non-loopback ``--host`` without both refuses to
start (exit 2, before the model loads) unless ``--insecure``.

Membership (:mod:`ethen.mesh.worker.membership`): ``--join HOST:PORT`` announces this worker (node id,
``--advertise HOST:PORT`` or the bound address, fragments) to a mesh provider's registry and re-announces it
every couple of seconds; ``--ca-file`` verifies the registry's certificate (TLS), the token file's first token
authenticates it.

SIGTERM drains: the worker opens no new session (``UNAVAILABLE``, Health ``draining``), waits up to
``--drain-timeout`` seconds (30) for its open sessions to end, sends ``Leave`` when it joined, then stops.
SIGINT (Ctrl-C) stops it within a second. Started by :func:`ethen.mesh.worker.launch.spawn_worker` (``ethen
up``, tests, benchmarks), it also stops when that parent dies, whatever the signal (``die_with_parent``).

BLAS runs single-threaded unless ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are set:
a decode step is a chain of small matmuls and several mesh processes share the cores (see
:mod:`ethen.mesh.worker.launch`). NumPy is imported only inside the command, after these defaults are set.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import typer

from ethen.knobs import ENGINE_ENV, warn_gone_env
from ethen.mesh.worker.launch import orphaned
from ethen.mesh.worker.limits import MAX_PREFILL_TOKENS, MAX_SESSIONS_PER_CALLER
from ethen.mesh.worker.memory import memory_refusal, parse_size, resident_bytes
from ethen.model.choose import ACCURACIES, EngineOptions, check_device

if TYPE_CHECKING:
    from ethen.mesh.auth import ClientCredentials, TokenAuth
    from ethen.mesh.worker.config import WorkerConfig
    from ethen.mesh.worker.membership import JoinSpec

__all__ = ["ACCURACIES", "engine_options", "one_blas_thread", "run_worker", "worker"]


def one_blas_thread() -> None:
    """Default BLAS to one thread (effective only before NumPy is first imported)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def run_worker(config: WorkerConfig, host: str, port: int, model_path: Path | None = None, *,
               tls: Any = None, auth: TokenAuth | None = None, join: JoinSpec | None = None,
               drain_timeout_s: float = 30.0, peers: ClientCredentials | None = None) -> None:
    """Load the layers (of the GGUF ``model_path``, default SmolLM2's), serve until SIGINT, or SIGTERM and
    a drain."""
    from ethen.mesh.worker.backend import ModelBackend
    from ethen.mesh.worker.membership import Announcer
    from ethen.mesh.worker.server import WorkerService, serve
    from ethen.model.gguf_loader import open_weight_store
    from ethen.model.model import engine_for, load_layer_stacks

    rss = resident_bytes()
    if rss is not None:  # what the layers cost is measured from here (tests/mesh/test_capped_workers.py)
        print(f"ethen worker {config.node_id!r}: resident {rss} bytes before loading layers", file=sys.stderr,
              flush=True)
    t0 = time.perf_counter()
    store = open_weight_store(model_path)
    engine = engine_for(store, threads=config.threads, pool=config.thread_pool, options=config.engine_options)
    print(f"ethen worker {config.node_id!r}: engine {type(engine).__name__}, {engine.threads} thread(s), "
          f"{config.thread_pool} pool", file=sys.stderr, flush=True)
    backend = ModelBackend(load_layer_stacks(list(config.fragments), store, engine))
    service = WorkerService(config, backend, auth=auth, peers=peers)
    from ethen.mesh.model_id import model_fingerprint  # issue 24: Health says which file this worker loaded
    from ethen.model import find_gguf_path

    service.model_sha256 = model_fingerprint(model_path if model_path is not None else find_gguf_path())
    server, bound = serve(service, host, port, tls=tls)
    layers = ",".join(f"{a}-{b}" for a, b in config.fragments)
    print(f"ethen worker {config.node_id!r}: layers {layers} loaded in {time.perf_counter() - t0:.1f}s, "
          f"serving on {host}:{bound}", file=sys.stderr, flush=True)
    announcer = None
    if join is not None:
        advertise = join.advertise or f"{host}:{bound}"
        announcer = Announcer(join, config.node_id, advertise, list(config.fragments)).start()
    print(f"READY {host}:{bound}", flush=True)
    done = threading.Event()
    drain = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not orphaned():  # the parent died: nobody to drain for
            drain.set()
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    done.wait()
    if drain.is_set() and not orphaned():
        service.drain()
        # the parent may die during the drain (or its death signal came while its other threads still ran,
        # reparenting this worker to one of them first): stop waiting then, nobody is left to finish for
        left = service.wait_drained(drain_timeout_s, give_up=orphaned)
        print(f"ethen worker {config.node_id!r}: drained ({left} session(s) still open)", file=sys.stderr,
              flush=True)
    if announcer is not None:
        announcer.leave()
    server.stop(grace=0.5).wait(1.0)
    service.stop()


def engine_options(engine: str, accuracy: str, device: str) -> EngineOptions:
    """``--engine`` / ``--accuracy`` / ``--device`` as the model loader takes them; a bad value (or a
    ``metal`` / ``vulkan`` device no installed ggml runs) is a ``ValueError`` naming the flag and the
    value."""
    options = EngineOptions(engine.strip() or "auto", accuracy.strip() or "auto", device.strip() or "auto")
    check_device(options.device)  # metal / vulkan: refused, naming the missing ggml backend
    return options


def worker(
    node_id: str = typer.Option(..., "--node-id", help="This node's id, as the router names it."),
    layers: str = typer.Option(..., "--layers", help="Served fragments, e.g. '0-9,10-19' (inclusive)."),
    port: int = typer.Option(0, "--port", help="Port to listen on (0: any free port, printed on READY)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    capacity_score: float = typer.Option(1.0, "--capacity-score", help="Reported to the router (spec §2.1)."),
    max_cache_mb: float = typer.Option(512.0, "--max-cache-mb", help="KV-cache memory cap for all sessions."),
    session_ttl: float = typer.Option(300.0, "--session-ttl", help="Seconds an idle session is kept."),
    max_sessions: int = typer.Option(256, "--max-sessions", help="Open sessions at most."),
    batch_window_ms: float = typer.Option(1.0, "--batch-window-ms", help="Decode-step collection window."),
    max_prefill_tokens: int = typer.Option(
        MAX_PREFILL_TOKENS, "--max-prefill-tokens",
        help="Rows one Forward may carry (longer: INVALID_ARGUMENT)."),
    max_sessions_per_caller: int = typer.Option(
        MAX_SESSIONS_PER_CALLER, "--max-sessions-per-caller",
        help="Open sessions per caller host (more: RESOURCE_EXHAUSTED)."),
    model: Path = typer.Option(  # noqa: B008
        None, "--model", help="GGUF model file (llama, qwen2; default: SmolLM2-135M-Instruct)."),
    tls_cert: Path = typer.Option(None, "--tls-cert", help="PEM server certificate (ethen mesh certs)."),  # noqa: B008
    tls_key: Path = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),  # noqa: B008
    token_file: Path = typer.Option(  # noqa: B008
        None, "--token-file", help="Mesh token file: every call must carry one of its tokens."),
    insecure: bool = typer.Option(
        False, "--insecure", help="Allow a non-loopback --host without TLS and token."),
    join: str = typer.Option(None, "--join", help="HOST:PORT of a mesh provider's registry to join."),
    advertise: str = typer.Option(
        None, "--advertise", help="HOST:PORT where the orchestrator reaches this worker (default: bound)."),
    ca_file: Path = typer.Option(  # noqa: B008
        None, "--ca-file", help="CA of the registry's and the peer workers' certificates (TLS join, chain)."),
    drain_timeout: float = typer.Option(
        30.0, "--drain-timeout", help="SIGTERM: seconds to let open sessions finish."),
    device: str = typer.Option(
        "auto", "--device", help="Compute device: auto (a GPU of the installed ggml's backends for the ggml "
        "engine, onnxruntime-gpu's CUDA for the onnx engine, else cpu), cpu, cuda (ggml's CUDA backend if "
        "installed, else onnxruntime-gpu), metal or vulkan (ggml backends; refused when not installed)."),
    engine: str = typer.Option(
        "auto", "--engine", envvar=ENGINE_ENV, help="auto (by the model: ggml for 1B-class models, "
        "onnxruntime's float32 compute for small ones), ggml (llama.cpp's kernels, int8 activations) or "
        "onnx."),
    accuracy: str = typer.Option(
        "auto", "--accuracy", help="auto (by the model), exact (float32-grade products: the onnx engine) or "
        "fast (int8 activations: the ggml engine)."),
    max_memory: str = typer.Option(
        None, "--max-memory", help="Refuse (before loading) layers whose weights exceed this size, e.g. "
        "800M, 1.5G, 512MiB (their bytes in the GGUF)."),
    thread_pool: str = typer.Option(
        "shared", "--thread-pool", help="shared: one spinning pool of threads for the process (for a worker "
        "alone on its machine); session: a pool per session, asleep between ops (workers sharing cores, "
        "as ethen up's)."),
    threads: int = typer.Option(
        None, "--threads", help="The engine's threads. Default: the cores this process may use, at most 4 "
        "(the ggml engine under --thread-pool session: 1)."),
    parent_pid: int = typer.Option(None, "--parent-pid", hidden=True, help="Stop when this process dies."),
    parent_deathsig: bool = typer.Option(False, "--parent-deathsig", hidden=True,
                                         help="Ask the kernel for SIGTERM when the parent dies."),
) -> None:
    """Serve fragments of the model's layers to the mesh over gRPC."""
    from ethen.mesh.worker.launch import die_with_parent

    die_with_parent(parent_pid, parent_deathsig)  # first: a parent killed while this worker loads
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warn_gone_env()
    one_blas_thread()
    from ethen.mesh.worker.config import WorkerConfig, check_threads, parse_fragments

    try:  # first: a bad value is named as the other engine flags' are (exit 2)
        check_threads(threads, thread_pool)
        options = engine_options(engine, accuracy, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2) from None
    try:
        fragments = parse_fragments(layers)
        config = WorkerConfig(node_id, fragments, capacity_score=capacity_score,
                              max_cache_bytes=int(max_cache_mb * 1024 * 1024), session_ttl_s=session_ttl,
                              max_sessions=max_sessions, batch_window_s=batch_window_ms / 1000.0,
                              max_prefill_tokens=max_prefill_tokens,
                              max_sessions_per_caller=max_sessions_per_caller, threads=threads,
                              thread_pool=thread_pool, engine_options=options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from ethen.mesh.auth import ClientCredentials, CredentialsError
    from ethen.mesh.worker.membership import credentials_of

    try:  # before the model loads: a refused start costs nothing
        tls, auth, join_spec = credentials_of(host, tls_cert, tls_key, token_file, insecure, join, advertise,
                                              ca_file)
        peers = ClientCredentials.load(ca_file, token_file)  # chain: how this worker calls its peers
    except CredentialsError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2) from None
    from ethen.model.errors import ModelError

    if max_memory is not None:
        from ethen.model.gguf_loader import open_weight_store

        try:
            limit = parse_size(max_memory)
            refusal = memory_refusal(open_weight_store(model).tensors or {}, fragments, limit)
        except (ValueError, ModelError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise typer.Exit(2) from None
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr, flush=True)
            raise typer.Exit(2)
    try:
        run_worker(config, host, port, model, tls=tls, auth=auth, join=join_spec,
                   drain_timeout_s=drain_timeout, peers=peers)
    except ModelError as exc:  # a layer the model does not have, weights not installed, ...
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2) from None
