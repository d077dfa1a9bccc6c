"""Mesh decode benchmark: single process vs a 3-worker gRPC pipeline on loopback, in one run.

    .venv/bin/python bench/mesh_decode.py [--tokens 48] [--rounds 3]
    .venv/bin/python bench/mesh_decode.py --head-ab [--tokens 32] [--rounds 3]
    .venv/bin/python bench/mesh_decode.py --lanes-ab 1,2 [--tokens 32] [--rounds 3]
    .venv/bin/python bench/mesh_decode.py --threads-ab 1,2 [--tokens 32] [--rounds 4]
    .venv/bin/python bench/mesh_decode.py --model X.gguf [--tokens 32] [--rounds 3]

``--model``: issue 43's mesh targets on any GGUF (e.g. ``bench/model_decode.py``'s TinyLlama-shape Q4_K_M,
``~/.cache/ethen-bench/tinyllama-shape-Q4_K_M.gguf``): three workers on thirds of its layers, each on the
engine ``auto`` picks (ggml for a 1B-class K-quant), against the same model in this process, interleaved
per round: one session's decode (target >= 80 % of the single process) and the aggregate of 1 / 4 / 8
concurrent sessions through the mesh (target 8 >= 1.5x 1), on a 64-token prompt of random token ids.

``--head-ab``: the logits head's block kernel (accuracy ``exact``: :mod:`ethen.model.qhead`) against the
engine graph (accuracy ``auto``; what ``auto``, the default, runs for a Q8_0 head at the default
accuracy: exact-int8), in one run over the same three workers: two
orchestrators (and two single-process models sharing one layer stack), measured alternately per round:
single-process decode, mesh one session, and 1 / 4 / 8 concurrent sessions (medians, ratios).

Measures (medians over rounds; every figure is printed next to its single-process baseline):

- decode tokens/s of one session: single process vs pipeline (workers 0-9 | 10-19 | 20-29, orchestrator
  holding embeddings + head), and their ratio (target >= 90 %);
- per-hop overhead in ms: (pipeline step - single-process step) / stages, and, directly, the RPC round trip
  minus the worker's own queue + compute time (issue 5's 1 ms target, replaced in issue 12 by the next row);
- the raw gRPC floor measured the same way in the same run (a ``bench/mesh_hops.py`` server: a generic
  bytes handler that streams ~141 MB per call like a decode step and reports its own time), one call after
  each decode step's three, and the ratio of the worker's per-RPC cost to it (target <= 1.5x). One run at
  load average 7.7-12 (the VM saturated by other jobs: a single-process step took 236 ms instead of ~21):
  4.47 ms vs a 4.29 ms floor, 1.04x (p90 16 ms: under such load the cost is scheduling, not our code);
- serialization per hop in ms (encode + decode of a decode step's request and reply, in-process), the
  quantity behind the issue's "Petals measured 18 ms serialization overhead per hop" (a tight loop, so warm
  caches: the cold cost of the whole RPC path is in the two rows above);
- prefill tokens/s (a ~200-token prompt) for both;
- aggregate decode tokens/s through the pipeline with 1, 4 and 8 concurrent sessions (target: 8 >= 3x 1).

BLAS runs single-threaded everywhere (set below, before NumPy loads) so the comparison is fair and the worker
processes do not fight over the cores with BLAS thread pools. The load average is printed at the end: the
machine this was tuned on has 2 vCPUs shared with other jobs, so compare figures of the same run only.

Where the per-token mesh overhead goes (2 vCPUs, KVM, measured with one worker and a client; medians):

- an RPC to a worker that does no compute: 0.39 ms round trip (+0.05 ms handler); with the worker idle 5 ms
  first (time.sleep): 0.53 ms; after the worker streams its 10 layers' weights (~180 MB, as in decode):
  0.95-1.2 ms. Split by CLOCK_MONOTONIC stamps: client -> handler entry 0.48 ms (0.22 without compute),
  handler exit -> client 0.42 ms (0.16). The extra ~0.5 ms is the cold path after the weights flush the
  caches (L2 2 MB/core, L3 32 MB), not Python work in the handler (0.11-0.15 ms).
- per stage the worker's compute is ~0.3 ms slower than the same layers inside the single process (cold
  activations / KV / interpreter state after the other processes ran).
- so 3 synchronous hops cost ~3 x 1.2 ms + ~1 ms of cold compute per token, against a 90 % budget of
  ~2.3 ms at a ~21 ms single-process step.

Tried and not kept (no gain beyond noise in interleaved A/B runs): GRPC_POLL_STRATEGY=poll,
``grpc.optimization_target=latency``, ``grpc.http2.bdp_probe=0``, ``sys.setswitchinterval(0.5 ms)``, weights
in RAM or in 2 MB huge pages instead of mmap (compute and RPC alike), prefetching the next layer's weights
from a second thread, in-place softmax in decode attention (~1 us of ~20 us), bypassing the worker's
step batcher and the orchestrator's decode rounds for a lone session (79-80 % either way, 3 interleaved
runs), pinning the orchestrator and workers to cores (split, alternated: noise; all on one core: 78 %).
Kept: a lone session's stages use unary ``Forward`` instead of a one-item ``ForwardBatch`` (-0.7 ms per
token), the tied head multiplied as a ``[d, V]`` C-contiguous copy (8 rows: 10.2 ms instead of 14.6 ms; 1
row: equal).
Not done: a chained data plane (worker -> worker, last stage -> orchestrator). It replaces 6 transfers per
token by 4 one-way ones, but ``bench/mesh_hops.py`` (a transport-only prototype with the same weight
streaming, in one run) measured it no faster than orchestrator-driven hops on this VM (five runs: 78-88 %
vs 80-88 % of single process, 0.67-1.35 ms vs 0.69-1.19 ms per hop; the modes move together run to run).
Each fire-and-forget hop pays a ``.future()`` (the sync channel's polling thread) and the acks compete for
the 2 cores. Pre-warming the next worker with a ping while the current one computes did not help either
(81-84 %, same runs).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402

import numpy as np  # noqa: E402

from ethen.mesh.orchestrator import Orchestrator  # noqa: E402
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker  # noqa: E402
from ethen.model import (  # noqa: E402
    GenerationChunk,
    Model,
    SamplingParams,
    generate_stream,
    load_model,
    model_step,
    open_weight_store,
)

LAYOUT = {"w0": "0-9", "w1": "10-19", "w2": "20-29"}
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]
_FOX = "Summarise this: the quick brown fox jumps over the lazy dog."
LONG_PROMPT = [{"role": "user", "content": " ".join([_FOX] * 16)}]


def timed(chunks: Iterable[GenerationChunk]) -> tuple[float, list[float], int]:
    """(time to first token, per-token decode intervals, tokens)."""
    t0 = time.perf_counter()
    last = t0
    first = 0.0
    steps: list[float] = []
    n = 0
    for chunk in chunks:
        now = time.perf_counter()
        if chunk.token_id is None:
            continue
        if n == 0:
            first = now - t0
        else:
            steps.append(now - last)
        last = now
        n += 1
    return first, steps, n


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_single(model: Model, ids: list[int], params: SamplingParams) -> tuple[float, list[float], int]:
    ctx = model.config.context_length
    return timed(generate_stream(model_step(model), model.tokenizer, ids, params, ctx))


def run_mesh(orch: Orchestrator, ids: list[int], params: SamplingParams) -> tuple[float, list[float], int]:
    return timed(orch.generate(ids, params))


def aggregate(orch: Orchestrator, ids: list[int], sessions: int, tokens: int) -> float:
    """Steady-state aggregate decode tokens/s of ``sessions`` concurrent generations: tokens produced while
    every session is decoding (after the last prefill, before the first session ends), per second."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    stamps: list[list[float]] = [[] for _ in range(sessions)]
    barrier = threading.Barrier(sessions)

    def run(i: int) -> None:
        barrier.wait()
        for chunk in orch.generate(ids, params):
            if chunk.token_id is not None:
                stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    if end <= start:  # a session ended before the last one started: no window where all decode
        return float("nan")
    produced = sum(1 for s in stamps for t in s if start < t <= end)
    return produced / (end - start)


class RawFloor:
    """The raw gRPC floor, measured in the same run: a ``bench/mesh_hops.py`` server process (a generic
    bytes-in/bytes-out handler, no protobuf, no validation) that streams ~141 MB of weights per call like a
    10-layer decode step and reports its own time; the floor is the round trip minus that time."""

    def __init__(self) -> None:
        import socket
        import subprocess
        import sys
        from pathlib import Path

        import grpc

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        script = Path(__file__).with_name("mesh_hops.py")
        argv = [sys.executable, str(script), "--server", str(port), str(port), "1", "0"]
        self.proc = subprocess.Popen(argv)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.call = self.channel.unary_unary("/hops/Timed", request_serializer=lambda b: b,
                                             response_deserializer=lambda b: b)
        self.x = np.full(576, 0.5, np.float32).tobytes()  # a decode step's hidden state (d = 576)
        deadline = time.monotonic() + 120
        while True:  # the server builds its matrices first
            try:
                self.call(self.x, timeout=5)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.5)

    def sample(self) -> float:
        import struct

        t0 = time.perf_counter()
        out = self.call(self.x, timeout=30)
        return (time.perf_counter() - t0) * 1000 - struct.unpack("<d", out[-8:])[0]

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


def rpc_overhead(orch: Orchestrator, ids: list[int], steps: int,
                 floor: RawFloor) -> tuple[list[float], list[float]]:
    """Per RPC: client round trip minus the worker's own queue + compute time, in ms; and, interleaved (one
    after each decode step's three calls), the raw gRPC floor measured the same way."""
    session = orch.open_session(len(ids))
    try:
        x = orch.ends.embed(ids)
        out: list[float] = []
        raw: list[float] = []
        pos = 0
        for i in range(steps + 1):
            h = x if i == 0 else orch.ends.embed([ids[-1]])
            for stage in session.route.stages:
                client = orch.clients[stage.node_id]
                t0 = time.perf_counter()
                res = client.forward(f"{session.id}@{stage.first}", stage.first, stage.last, h, pos)
                rtt = (time.perf_counter() - t0) * 1000
                if i > 0:
                    out.append(rtt - res.compute_ms - res.queue_ms)
                h = res.hidden
            if i > 0:
                raw.append(floor.sample())
            pos += 1 if i else len(ids)
        return out, raw
    finally:
        for stage in session.route.stages:
            orch.clients[stage.node_id].close_session(f"{session.id}@{stage.first}")


def serialization_ms(d: int, calls: int = 2000) -> float:
    """Median ms per hop spent serializing: build + encode the ``Forward`` request of a decode step, decode
    it and its hidden state, build + encode the reply, decode it and its hidden state (the code the client and
    the worker run, in-process; Petals' "serialization overhead per hop" measure)."""
    from ethen.mesh.orchestrator.client import WorkerClient
    from ethen.mesh.proto import mesh_pb2
    from ethen.mesh.worker.server import WorkerService

    hidden = np.full((1, d), 0.5, np.float32)
    samples: list[float] = []
    for i in range(calls):
        t0 = time.perf_counter()
        wire = WorkerClient._request("session", 0, 9, hidden, i).SerializeToString()
        req = mesh_pb2.ForwardRequest.FromString(wire)
        h = np.frombuffer(req.hidden.data, dtype="<f4").reshape(tuple(req.hidden.shape))
        back = WorkerService._reply(h, 0.0, 0.0, 1).SerializeToString()
        rep = mesh_pb2.ForwardResponse.FromString(back)
        np.frombuffer(rep.hidden.data, dtype="<f4").reshape(tuple(rep.hidden.shape))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def head_ab(workers: dict[str, WorkerProcess], tokens: int, rounds: int) -> None:
    """Block-kernel head vs engine-graph head, interleaved per round, same workers (see the docstring)."""
    from ethen.model.choose import EngineOptions
    from ethen.model.qmodel import QuantEmbedAndHead, onnx_engine

    load_before = os.getloadavg()
    model = load_model()
    tok = model.tokenizer
    ids = tok.encode(model.chat_template.render(PROMPT, add_generation_prompt=True))
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    addrs = {n: w.address for n, w in workers.items()}
    built = {}
    for mode in ("kernel", "engine"):
        acc = "exact" if mode == "kernel" else "auto"  # (the head's choice)
        built[mode] = (Model(model.config, QuantEmbedAndHead(open_weight_store(), onnx_engine(accuracy=acc)),
                             model.stack, tok, model.chat_template),
                       Orchestrator.load(addrs, engine_options=EngineOptions(accuracy=acc)))
    (model_k, orch_k), (model_e, orch_e) = built["kernel"], built["engine"]
    kinds = {"kernel": (model_k, orch_k), "engine": (model_e, orch_e)}
    for name, (m, o) in kinds.items():
        blocks = isinstance(m.ends, QuantEmbedAndHead) and m.ends.block_head is not None
        assert blocks == (name == "kernel") and isinstance(o.ends, QuantEmbedAndHead) \
            and (o.ends.block_head is not None) == blocks, name
    figs: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    with orch_k, orch_e:
        for m, o in kinds.values():  # warm both paths
            run_single(m, ids, SamplingParams(temperature=0.0, max_tokens=2))
            run_mesh(o, ids, SamplingParams(temperature=0.0, max_tokens=2))
        for _ in range(rounds):
            for name, (m, o) in kinds.items():
                f = figs[name]
                f.setdefault("single-process decode, 1 session", []).append(1 / median(run_single(m, ids,
                                                                                               params)[1]))
                f.setdefault("mesh decode, 1 session", []).append(1 / median(run_mesh(o, ids, params)[1]))
                for n in (1, 4, 8):
                    f.setdefault(f"mesh aggregate, {n} sessions", []).append(aggregate(o, ids, n, tokens))
    print(f"\nhead A/B, tok/s, medians of {rounds} interleaved rounds ({tokens} tokens per generation)")
    print(f"{'':36} {'block kernel':>19} {'engine graph':>19} {'engine / kernel':>16}")
    for metric in figs["kernel"]:
        e, k = median(figs["engine"][metric]), median(figs["kernel"][metric])
        print(f"{metric:36} {k:19.1f} {e:19.1f} {e / k:15.2f}x")
    for name in ("engine", "kernel"):
        f = figs[name]
        one = median(f["mesh aggregate, 1 sessions"])
        print(f"{name}: 8 sessions = {median(f['mesh aggregate, 8 sessions']) / one:.2f}x one session "
              f"(target >= 3x)")
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")


def lanes_ab(workers: dict[str, WorkerProcess], tokens: int, rounds: int, lanes: list[int],
             path: str | None = None) -> None:
    """Aggregate decode tok/s of 1 / 4 / 8 sessions through orchestrators with different ``round_lanes``
    (same workers, alternated per round; medians). ``path``: the workers' GGUF (``--model``; a prompt of
    64 random token ids), else SmolLM2 and the chat prompt."""
    load_before = os.getloadavg()
    store = open_weight_store(path)
    if path:
        ids = [int(i) for i in np.random.default_rng(0).integers(3, store.config.vocab_size, 64)]
    else:
        model = load_model(store)
        ids = model.tokenizer.encode(model.chat_template.render(PROMPT, add_generation_prompt=True))
    addrs = {n: w.address for n, w in workers.items()}
    orchs = {n: Orchestrator.load(addrs, store, round_lanes=n) for n in lanes}
    figs: dict[int, dict[int, list[float]]] = {n: {} for n in lanes}
    try:
        for o in orchs.values():
            run_mesh(o, ids, SamplingParams(temperature=0.0, max_tokens=2))  # warm
        for _ in range(rounds):
            for n, o in orchs.items():
                for s in (1, 4, 8):
                    figs[n].setdefault(s, []).append(aggregate(o, ids, s, tokens))
    finally:
        for o in orchs.values():
            o.close()
    print(f"\nround lanes A/B, aggregate decode tok/s, medians of {rounds} alternated rounds "
          f"({tokens} tokens)")
    print(f"{'sessions':>9} " + " ".join(f"{f'{n} lane(s)':>12}" for n in lanes))
    for s in (1, 4, 8):
        print(f"{s:>9} " + " ".join(f"{median(figs[n][s]):12.1f}" for n in lanes))
    for n in lanes:
        print(f"{n} lane(s): 8 sessions = {median(figs[n][8]) / median(figs[n][1]):.2f}x one session")
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")


def threads_ab(tokens: int, rounds: int, counts: list[str]) -> None:
    """Three workers per ``--threads`` value (one orchestrator each, head on 2 threads), alternated per
    round: one session's median step and aggregate decode of 1 / 4 / 8 sessions (medians)."""
    load_before = os.getloadavg()
    sets: dict[str, dict[str, WorkerProcess]] = {}
    try:
        for t in counts:
            sets[t] = {f"{n}-t{t}": spawn_worker(f"{n}-t{t}", layers, extra_args=("--threads", t))
                       for n, layers in LAYOUT.items()}
        model = load_model()
        ids = model.tokenizer.encode(model.chat_template.render(PROMPT, add_generation_prompt=True))
        params = SamplingParams(temperature=0.0, max_tokens=tokens)
        orchs = {t: Orchestrator.load({n: w.address for n, w in ws.items()}) for t, ws in sets.items()}
        figs: dict[str, dict[str, list[float]]] = {t: {} for t in orchs}
        try:
            for o in orchs.values():
                run_mesh(o, ids, SamplingParams(temperature=0.0, max_tokens=2))  # warm
            for _ in range(rounds):
                for t, o in orchs.items():
                    f = figs[t]
                    f.setdefault("mesh, one session (median step)", []).append(
                        1 / median(run_mesh(o, ids, params)[1]))
                    for n in (1, 4, 8):
                        f.setdefault(f"mesh aggregate, {n} sessions", []).append(aggregate(o, ids, n, tokens))
        finally:
            for o in orchs.values():
                o.close()
    finally:
        for ws in sets.values():
            for w in ws.values():
                w.stop()
    print(f"\nworker --threads A/B, tok/s, medians of {rounds} alternated rounds ({tokens} tokens)")
    print(f"{'':36} " + " ".join(f"{f'{t} thread(s)':>12}" for t in counts))
    for metric in figs[counts[0]]:
        print(f"{metric:36} " + " ".join(f"{median(figs[t][metric]):12.1f}" for t in counts))
    for t in counts:
        one = median(figs[t]["mesh aggregate, 1 sessions"])
        eight = median(figs[t]["mesh aggregate, 8 sessions"])
        print(f"{t} thread(s): 8 sessions = {eight / one:.2f}x one session")
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")


def thirds(n_layers: int) -> dict[str, str]:
    """Three workers' fragments over ``n_layers`` layers (e.g. 22: 0-7, 8-14, 15-21)."""
    cuts = [round(n_layers * i / 3) for i in range(4)]
    return {f"w{i}": f"{cuts[i]}-{cuts[i + 1] - 1}" for i in range(3)}


def model_mesh(path: str, tokens: int, rounds: int, lanes: int | None = None) -> None:
    """``--model``: single process against three workers on ``path`` (module docstring)."""
    store = open_weight_store(path)
    layout = thirds(store.config.n_layers)
    load_before = os.getloadavg()
    print(f"starting 3 workers {layout} on {path} ...", flush=True)
    workers = {n: spawn_worker(n, layers, extra_args=("--model", path)) for n, layers in layout.items()}
    try:
        model = load_model(store)
        ids = [int(i) for i in np.random.default_rng(0).integers(3, store.config.vocab_size, 64)]
        params = SamplingParams(temperature=0.0, max_tokens=tokens)
        with Orchestrator.load({n: w.address for n, w in workers.items()}, store, round_lanes=lanes) as orch:
            run_single(model, ids, SamplingParams(temperature=0.0, max_tokens=2))  # page both in
            run_mesh(orch, ids, SamplingParams(temperature=0.0, max_tokens=2))
            single, mesh, same = [], [], []
            agg: dict[int, list[float]] = {1: [], 4: [], 8: []}
            for _ in range(rounds):
                _, s_steps, _ = run_single(model, ids, params)
                _, m_steps, _ = run_mesh(orch, ids, params)
                single.append(median(s_steps))
                mesh.append(median(m_steps))
                a = [c.token_id for c in generate_stream(model_step(model), model.tokenizer, ids, params,
                                                         model.config.context_length)]
                b = [c.token_id for c in orch.generate(ids, params)]
                same.append(a == b)
                for n in agg:
                    agg[n].append(aggregate(orch, ids, n, tokens))
        s_step, m_step = median(single), median(mesh)
        print(f"\n{'metric':44} {'single-process':>15} {'3-worker mesh':>15} {'ratio':>8}")
        print(f"{'decode tokens/s (1 session, median step)':44} {1 / s_step:15.1f} {1 / m_step:15.1f} "
              f"{s_step / m_step:8.1%}   target >= 80%")
        for n in (1, 4, 8):
            label = f"aggregate decode tokens/s, {n} sessions"
            print(f"{label:44} {'':15} {median(agg[n]):15.1f} {median(agg[n]) / median(agg[1]):8.2f}x"
                  + ("   target >= 1.5x" if n == 8 else ""))
        print(f"greedy tokens equal to the single process: {sum(same)}/{len(same)} rounds")
        print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, after "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    finally:
        for w in workers.values():
            w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per measured generation")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    ap.add_argument("--head-ab", action="store_true", help="block-kernel head vs engine head, one run")
    ap.add_argument("--data-plane", default="star", choices=("star", "chain"),
                    help="the orchestrator's data plane (default star: one call per stage from it)")
    ap.add_argument("--lanes-ab", default=None, metavar="1,2",
                    help="aggregate decode of orchestrators with these round_lanes, alternated")
    ap.add_argument("--threads-ab", default=None, metavar="1,2",
                    help="three workers per --threads value, alternated (one session, 1/4/8 sessions)")
    ap.add_argument("--model", default=None, help="a GGUF: single process vs three workers on it (docstring)")
    ap.add_argument("--round-lanes", type=int, default=None,
                    help="with --model: round_lanes (default: the orchestrator's, default_round_lanes)")
    args = ap.parse_args()
    if args.model and not args.lanes_ab:
        model_mesh(args.model, args.tokens, args.rounds, args.round_lanes)
        return
    if args.threads_ab:
        threads_ab(args.tokens, args.rounds, args.threads_ab.split(","))
        return
    if args.lanes_ab:
        layout = thirds(open_weight_store(args.model).config.n_layers) if args.model else LAYOUT
        extra = ("--model", args.model) if args.model else ()
        print(f"starting {len(layout)} workers {layout} on 127.0.0.1 ...", flush=True)
        ws = {n: spawn_worker(n, layers, extra_args=extra) for n, layers in layout.items()}
        try:
            lanes_ab(ws, args.tokens, args.rounds, [int(v) for v in args.lanes_ab.split(",")], args.model)
        finally:
            for w in ws.values():
                w.stop()
        return
    if args.head_ab:
        print(f"starting {len(LAYOUT)} workers {LAYOUT} on 127.0.0.1 ...", flush=True)
        ws = {n: spawn_worker(n, layers) for n, layers in LAYOUT.items()}
        try:
            head_ab(ws, args.tokens, args.rounds)
        finally:
            for w in ws.values():
                w.stop()
        return

    load_before = os.getloadavg()
    print(f"starting {len(LAYOUT)} workers {LAYOUT} on 127.0.0.1 ...", flush=True)
    workers: dict[str, WorkerProcess] = {n: spawn_worker(n, layers) for n, layers in LAYOUT.items()}
    try:
        model = load_model()
        tok = model.tokenizer
        ids = tok.encode(model.chat_template.render(PROMPT, add_generation_prompt=True))
        long_ids = tok.encode(model.chat_template.render(LONG_PROMPT, add_generation_prompt=True))
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1)
        addrs = {n: w.address for n, w in workers.items()}
        with Orchestrator.load(addrs, data_plane=args.data_plane) as orch:
            route = orch.route_for(len(ids))
            stages = len(route.stages)
            print(f"pipeline route: {' -> '.join(f'{s.node_id} {s.first}-{s.last}' for s in route.stages)}")
            run_single(model, ids, prefill_params)  # warm both paths (page in the weights)
            run_mesh(orch, ids, prefill_params)
            single_steps: list[float] = []
            mesh_steps: list[float] = []
            single_prefill: list[float] = []
            mesh_prefill: list[float] = []
            for _ in range(args.rounds):
                _, s, _ = run_single(model, ids, params)
                single_steps.append(median(s))
                _, m, _ = run_mesh(orch, ids, params)
                mesh_steps.append(median(m))
                first, _, _ = run_single(model, long_ids, prefill_params)
                single_prefill.append(len(long_ids) / first)
                first, _, _ = run_mesh(orch, long_ids, prefill_params)
                mesh_prefill.append(len(long_ids) / first)
            s_step, m_step = median(single_steps), median(mesh_steps)
            hop = (m_step - s_step) * 1000 / stages
            floor = RawFloor()
            try:
                rpc, raw = rpc_overhead(orch, ids, args.tokens, floor)
            finally:
                floor.close()
            agg = {n: median([aggregate(orch, ids, n, args.tokens) for _ in range(max(1, args.rounds - 1))])
                   for n in (1, 4, 8)}

        print()
        print(f"{'metric':44} {'single-process':>15} {'3-worker mesh':>15} {'ratio':>8}")
        print(f"{'decode tokens/s (1 session, median step)':44} {1 / s_step:15.1f} {1 / m_step:15.1f} "
              f"{s_step / m_step:8.1%}   target >= 90%")
        print(f"{'decode step ms':44} {s_step * 1000:15.2f} {m_step * 1000:15.2f}")
        print(f"{'prefill tokens/s (' + str(len(long_ids)) + '-token prompt)':44} "
              f"{median(single_prefill):15.1f} {median(mesh_prefill):15.1f} "
              f"{median(mesh_prefill) / median(single_prefill):8.1%}")
        print(f"{'per-hop overhead ms ((mesh-single)/stages)':44} {'':15} {hop:15.2f} {'':8}"
              "   target <= 1 ms")
        print(f"{'per-RPC overhead ms (rtt - worker time)':44} {'':15} {median(rpc):15.2f} "
              f"{'':8}   p90 {float(np.percentile(rpc, 90)):.2f}")
        print(f"{'raw gRPC floor ms (same measure, same run)':44} {'':15} {median(raw):15.2f} "
              f"{median(rpc) / median(raw):7.2f}x   target <= 1.5x")
        print(f"{'serialization ms per hop, warm (Petals: 18)':44} {'':15} "
              f"{serialization_ms(model.config.d_model):15.3f}")
        for n in (1, 4, 8):
            label = f"aggregate decode tokens/s, {n} sessions"
            print(f"{label:44} {'':15} {agg[n]:15.1f} {agg[n] / agg[1]:8.2f}x"
                  + ("   target >= 3x" if n == 8 else ""))
        load_after = os.getloadavg()
        print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
              f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    finally:
        for w in workers.values():
            w.stop()


if __name__ == "__main__":
    main()
