"""Mesh fairness benchmark (issue 23, item 5): another caller's decode-step latency, unloaded vs while one
caller prefills 2,048 tokens, in the same run.

    .venv/bin/python bench/mesh_fairness.py [--layers 0-9] [--steps 400] [--rounds 4]

One worker (``--layers``, default 0-9: a third of the model, like ``ethen up``'s workers) serves gRPC on
127.0.0.1 in a child process with two mesh tokens, i.e. two callers, A and B. Each of ``--rounds`` rounds: A
prefills 2,048 positions alone (a new session), B decodes ``--steps / --rounds`` steps of one row alone (the
unloaded baseline), then B decodes for as long as A prefills 2,048 positions again (loaded); rounds interleave
the phases so a load that drifts during the run weighs on both. B's steps run at positions 0-99 of its session
in both phases (a new session every 100 steps), so the phases differ only by A's prefill, not by B's context.
Prints the medians and p99 of B's step latency in both phases, their ratio (target: p99 <= 3x the unloaded
p99), where B's step spends its time (the worker's queue and compute, as the worker reports them, and the
rest: RPC, GIL, OS scheduling), and A's prefill time alone vs under B's decoding. BLAS is single-threaded.
Last, what slicing costs a prefill's compute: a 2,048-token prefill in process, 128-row chunks through the
fragment (the worker before slicing) vs the worker's layer slices. The load average (1 min) is printed at the
start and the end: the VM has 2 vCPUs shared with other jobs, so compare figures of the same run only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np

from ethen.mesh.auth import ClientCredentials
from ethen.mesh.orchestrator.client import WorkerClient
from ethen.mesh.worker.backend import ModelBackend
from ethen.mesh.worker.launch import spawn_worker
from ethen.mesh.worker.limits import PREFILL_CHUNK_TOKENS, chunk_rows


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="0-9")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=576, help="the model's hidden size (SmolLM2-135M: 576)")
    args = ap.parse_args()
    first, last = (int(x) for x in args.layers.split("-"))
    load_start = os.getloadavg()[0]
    tokens = [secrets.token_urlsafe(24), secrets.token_urlsafe(24)]
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "tokens"
        token_file.write_text("\n".join(tokens) + "\n")
        worker = spawn_worker("w", args.layers, extra_args=["--token-file", str(token_file)])
        try:
            run(worker.address, first, last, tokens, args.steps, args.rounds, args.hidden)
        finally:
            worker.stop()
    if args.rounds:
        compute_cost(first, last, args.rounds)
    print(f"load average (1 min) {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")


def run(address: str, first: int, last: int, tokens: list[str], steps: int, rounds: int, d: int) -> None:
    def client(token: str) -> WorkerClient:
        return WorkerClient("w", address, forward_timeout_s=600.0, credentials=ClientCredentials(token=token))

    a, b = client(tokens[0]), client(tokens[1])
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((2048, d)).astype(np.float32)
    row = rng.standard_normal((1, d)).astype(np.float32)
    n = 0  # B's steps so far: session n // 100, position n % 100
    parts: dict[str, list[tuple[float, float, float]]] = {"unloaded": [], "loaded": []}

    def decode(phase: str) -> float:
        nonlocal n
        session, pos = f"dec-{n // 100}", n % 100
        t0 = time.perf_counter()
        r = b.forward(session, first, last, row, pos)
        took = time.perf_counter() - t0
        parts[phase].append((r.queue_ms, r.compute_ms, took * 1000 - r.queue_ms - r.compute_ms))
        if pos == 99:
            b.close_session(session)
        n += 1
        return took

    def prefill(name: str) -> float:
        t0 = time.perf_counter()
        a.forward(name, first, last, prompt, 0)
        took = time.perf_counter() - t0
        a.close_session(name)
        return took

    for _ in range(3):  # warm-up
        decode("unloaded")
    del parts["unloaded"][:]
    unloaded: list[float] = []
    loaded: list[float] = []
    alone: list[float] = []
    shared: list[float] = []
    for i in range(rounds):  # each round: A alone, B alone, then both: drifting load hits every phase
        alone.append(prefill(f"alone-{i}"))
        unloaded += [decode("unloaded") for _ in range(steps // rounds)]
        done = threading.Event()

        def long(i: int = i, done: threading.Event = done) -> None:
            shared.append(prefill(f"long-{i}"))
            done.set()

        thread = threading.Thread(target=long)
        thread.start()
        while not done.is_set():
            loaded.append(decode("loaded"))
        thread.join()
    a.close()
    b.close()
    um, up = statistics.median(unloaded) * 1000, _pct(unloaded, 0.99) * 1000
    lm, lp = statistics.median(loaded) * 1000, _pct(loaded, 0.99) * 1000
    print(f"worker layers {first}-{last}; caller B's decode step (one row), ms:")
    print(f"  unloaded                     n={len(unloaded):4d}  median {um:8.1f}  p99 {up:8.1f}  "
          f"max {max(unloaded) * 1000:8.1f}")
    print(f"  while A prefills 2,048 tok   n={len(loaded):4d}  median {lm:8.1f}  p99 {lp:8.1f}  "
          f"max {max(loaded) * 1000:8.1f}")
    print(f"  ratio loaded / unloaded      median {lm / um:5.2f}x  p99 {lp / up:5.2f}x  (target p99 <= 3x)")
    for name, xs in parts.items():
        cols = list(zip(*xs, strict=True))
        print(f"  {name:8s} B's step, ms: " + "  ".join(
            f"{label} median {statistics.median(c):5.1f} p99 {_pct(list(c), 0.99):6.1f}"
            for label, c in zip(("worker queue", "compute", "rest (RPC, GIL, OS)"), cols, strict=True)))
    print(f"caller A's 2,048-token prefill: alone {statistics.median(alone):.2f} s, while B decodes "
          f"{statistics.median(shared):.2f} s (medians of {rounds})")


def compute_cost(first: int, last: int, rounds: int) -> None:
    """What slicing costs a prefill in compute: a 2,048-token prefill in process (no gRPC), as the worker
    computed it before issue 23 item 5 (128-row chunks through the whole fragment) and as it does now (chunks
    of ``chunk_rows`` rows, one layer at a time), interleaved, median of ``rounds``."""
    backend = ModelBackend.load([(first, last)])
    layers = last - first + 1
    prompt = np.random.default_rng(1).standard_normal((2048, backend.hidden_size)).astype(np.float32)

    def unsliced() -> None:
        kv = backend.new_cache(first)
        for a in range(0, 2048, PREFILL_CHUNK_TOKENS):
            rows = np.arange(a, a + PREFILL_CHUNK_TOKENS)
            backend.forward([first], prompt[a : a + PREFILL_CHUNK_TOKENS], rows, [kv])

    def sliced() -> None:
        kv = backend.new_cache(first)
        row = 0
        while row < 2048:
            rows = min(2048 - row, chunk_rows(row))
            x, pos = prompt[row : row + rows], np.arange(row, row + rows)
            for layer in range(layers):
                x = backend.forward_layer(first, layer, x, pos, kv)
            row += rows

    times: dict[str, list[float]] = {"unsliced": [], "sliced": []}
    for _ in range(rounds):
        for name, fn in (("unsliced", unsliced), ("sliced", sliced)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    u, s = statistics.median(times["unsliced"]), statistics.median(times["sliced"])
    print(f"2,048-token prefill compute in process (median of {rounds}): 128-row chunks through the fragment "
          f"{u:.2f} s, layer slices (chunk_rows) {s:.2f} s ({s / u:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
