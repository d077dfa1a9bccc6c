"""``ethen worker``: serve some fragments of the model's layers over gRPC.

Prints ``READY <host>:<port>`` on stdout (flushed) once the layers are loaded and the port is bound, so a
parent process (``ethen up``, tests, benchmarks) can wait for it; ``--port 0`` binds a free port and reports
it there.
SIGINT / SIGTERM stop it within a second. Started by :func:`ethen.mesh.worker.launch.spawn_worker` (``ethen
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
from typing import TYPE_CHECKING

import typer

from ethen.mesh.worker.limits import MAX_PREFILL_TOKENS, MAX_SESSIONS_PER_CALLER

if TYPE_CHECKING:
    from ethen.mesh.worker.server import WorkerConfig

__all__ = ["one_blas_thread", "run_worker", "worker"]


def one_blas_thread() -> None:
    """Default BLAS to one thread (effective only before NumPy is first imported)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def run_worker(config: WorkerConfig, host: str, port: int, model_path: Path | None = None) -> None:
    """Load the layers (of the GGUF ``model_path``, default SmolLM2's), serve until SIGINT/SIGTERM."""
    from ethen.mesh.worker.backend import ModelBackend
    from ethen.mesh.worker.server import WorkerService, serve
    from ethen.model.gguf_loader import open_weight_store
    from ethen.model.model import load_layer_stacks

    t0 = time.perf_counter()
    backend = ModelBackend(load_layer_stacks(list(config.fragments), open_weight_store(model_path)))
    service = WorkerService(config, backend)
    server, bound = serve(service, host, port)
    layers = ",".join(f"{a}-{b}" for a, b in config.fragments)
    print(f"ethen worker {config.node_id!r}: layers {layers} loaded in {time.perf_counter() - t0:.1f}s, "
          f"serving on {host}:{bound}", file=sys.stderr, flush=True)
    print(f"READY {host}:{bound}", flush=True)
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    done.wait()
    server.stop(grace=0.5).wait(1.0)
    service.stop()


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
) -> None:
    """Serve fragments of the model's layers to the mesh over gRPC."""
    from ethen.mesh.worker.launch import die_with_parent

    die_with_parent()  # first: a parent killed while this worker loads must not leave it behind
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    one_blas_thread()
    from ethen.mesh.worker.server import WorkerConfig, parse_fragments

    try:
        fragments = parse_fragments(layers)
        config = WorkerConfig(node_id, fragments, capacity_score=capacity_score,
                              max_cache_bytes=int(max_cache_mb * 1024 * 1024), session_ttl_s=session_ttl,
                              max_sessions=max_sessions, batch_window_s=batch_window_ms / 1000.0,
                              max_prefill_tokens=max_prefill_tokens,
                              max_sessions_per_caller=max_sessions_per_caller)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from ethen.model.errors import ModelError

    try:
        run_worker(config, host, port, model)
    except ModelError as exc:  # a layer the model does not have, weights not installed, ...
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2) from None
