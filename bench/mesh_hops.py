"""Would a chained data plane beat the orchestrator-driven hops? A transport-only prototype, in one run.

    .venv/bin/python bench/mesh_hops.py [--rounds 4] [--steps 30] [--worker]
    sudo .venv/bin/python bench/mesh_hops.py --hosts [--delays 0,5,20] [--sessions 8] [--rounds 3]

Three gRPC server processes on 127.0.0.1 each hold ~141 MB of float32 matrices (40 x [1536, 576], about the
bytes a 10-layer SmolLM2 fragment streams per decode step) and "compute" a step by multiplying a 576-vector
through all of them, as a decode step streams its weights. Per step, medians over rounds:

- single process: the same 3 x 40 products in this process (the baseline);
- sequential unary (what ``ethen.mesh.orchestrator`` does): the client calls each server's unary RPC in turn
  and forwards the bytes it gets back (6 one-way transfers per step);
- chained: the client calls the first server; each server computes, fires the next server's RPC without
  waiting for it (a ``.future()``, kept alive until it completes) and acks; the last one delivers the result
  to a gRPC server in the client (4 one-way transfers on the critical path, acks off it);
- the cold RPC floor: the round trip of one call minus the server handler's own time, with this process
  streaming ~160 MB just before each call (as the other stages do in a pipeline);
- sequential, pre-warmed: as sequential, but every later server first gets a "Warm" ping (one product, to
  bring its code path back into the caches) sent just before the stage before it is called, so it runs
  while that stage computes.

Five runs on this 2-vCPU VM (sync grpcio, Python 3.11, load average 0.3-0.9): single 14.1-15.9 ms;
sequential 80-88 % of single (0.69-1.19 ms per hop); chained 78-88 % (0.67-1.35 ms per hop); pre-warmed
(three runs) 81-84 % (0.91-1.15 ms). Run to run the modes move together and none wins. The chain saves
transfers but pays a ``.future()`` per hop (the sync channel's polling thread, a thread hop) and its acks
compete for the 2 cores; a warm-up ping is one more RPC, and the stage before it flushes the caches again
anyway. That is why the mesh keeps orchestrator-driven hops (see ``bench/mesh_decode.py``).

``--hosts`` (root): the same three servers on namespaced hosts (:mod:`tests.mesh.netns`), each behind a relay
holding every chunk D ms each way, and the chain's receiver behind a relay in the root namespace, so every
one-way crossing on the critical path pays D (star: 6 per step; chain: 4). One run (2026-12-01, load average
8.3 from other jobs, 10 steps x 3 rounds, medians): one step at a time, star / chain 78.6 / 92.7 ms at 0 ms
(the chain 0.85x: its extra acks and thread hops cost CPU on a saturated VM), 135.1 / 105.0 ms at 5 ms
(1.29x), 209.3 / 161.3 ms at 20 ms (1.30x), i.e. the chain saves the 2 D per step the arithmetic says
(echo round trip 41.7 ms at 20 ms). 8 concurrent steppers are CPU-bound here (the prototype servers do not
batch: 8 x 40 products per step each): 17.9 / 14.8 steps/s at 0 ms, 20.5 / 19.0 at 20 ms, no shape wins
there. That is the measurement that chose the chain for decode over real links
(``data_plane = "chain"``, :mod:`ethen.mesh.orchestrator.chain`).

The cold RPC floor (three runs): 1.20-1.27 ms per call for a raw-bytes handler. An ethen worker's ``Forward``
measured the same way (``--worker``: rtt minus its reported queue + compute time, caches flushed before
each call) costs 1.55-1.70 ms: our protobuf messages, validation, session store and batcher add ~0.35-0.45 ms
cold. Three hops at the floor already cost ~3.7 ms; against a ~21-24 ms single-process step that caps the
pipeline near 85-87 % of single process on this VM, below the 90 % target, whatever the worker code does.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

F32 = npt.NDArray[np.float32]
MATRICES = 40  # x [1536, 576] float32 = ~141 MB per server


def weights(seed: int) -> list[F32]:
    rng = np.random.default_rng(seed)
    return [rng.random((1536, 576), dtype=np.float32) for _ in range(MATRICES)]


def compute(ws: list[F32], x: F32) -> F32:
    y = x
    for w in ws:
        y = w @ x  # [1536]: streams w once
    return x + y[:576] * 0  # same shape as the input, depends on the products


def _ident(b: bytes) -> bytes:
    return b


def serve(port: int, handlers: dict[str, Callable[[bytes, Any], bytes]]) -> grpc.Server:
    srv = grpc.server(ThreadPoolExecutor(8))
    methods = {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_ident, response_serializer=_ident)
        for name, fn in handlers.items()
    }
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("hops", methods),))
    srv.add_insecure_port(f"127.0.0.1:{port}")
    srv.start()
    return srv


def stub(port: int | str, name: str) -> grpc.UnaryUnaryMultiCallable:
    channel = grpc.insecure_channel(port if isinstance(port, str) else f"127.0.0.1:{port}")
    return channel.unary_unary(f"/hops/{name}", request_serializer=_ident, response_deserializer=_ident)


def run_server(port: int, next_port: int | str, next_method: str, seed: int) -> None:
    ws = weights(seed)
    nxt = stub(next_port, next_method)
    pending: collections.deque[Any] = collections.deque(maxlen=64)  # a dropped future cancels its call

    def fwd(req: bytes, ctx: Any) -> bytes:
        return compute(ws, np.frombuffer(req, np.float32)).tobytes()

    def timed(req: bytes, ctx: Any) -> bytes:  # Fwd + the handler's own time (ms, 8 bytes) at the end
        t0 = time.perf_counter()
        out = compute(ws, np.frombuffer(req, np.float32)).tobytes()
        return out + struct.pack("<d", (time.perf_counter() - t0) * 1000)

    def chain(req: bytes, ctx: Any) -> bytes:
        out = compute(ws, np.frombuffer(req, np.float32)).tobytes()
        pending.append(nxt.future(out))
        return b""

    def tagged(req: bytes, ctx: Any) -> bytes:  # Chain with an 8-byte tag in front (concurrent chains)
        out = compute(ws, np.frombuffer(req[8:], np.float32)).tobytes()
        pending.append(nxt.future(req[:8] + out))
        return b""

    small = np.ones(576, np.float32)

    def warm(req: bytes, ctx: Any) -> bytes:
        compute(ws[:1], small)  # run the handler's code path on one matrix
        return b""

    handlers = {"Fwd": fwd, "Timed": timed, "Chain": chain, "Tagged": tagged, "Warm": warm}
    serve(port, handlers).wait_for_termination()


def measure_worker(calls: int, flush: F32) -> float:
    """Median rtt - (queue + compute) of a real worker's decode-step ``Forward`` after a cache flush."""
    from ethen.mesh.orchestrator.client import WorkerClient
    from ethen.mesh.worker.launch import spawn_worker

    worker = spawn_worker("w0", "0-9")
    try:
        client = WorkerClient("w0", worker.address)
        client.forward("bench", 0, 9, np.ones((20, 576), np.float32), 0)  # a 20-token prompt
        out: list[float] = []
        for pos in range(20, 20 + calls):
            flush.sum()
            t = time.perf_counter()
            res = client.forward("bench", 0, 9, np.full((1, 576), 0.5, np.float32), pos)
            out.append((time.perf_counter() - t) * 1000 - res.compute_ms - res.queue_ms)
        client.close()
        return statistics.median(out)
    finally:
        worker.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps per mode per round")
    ap.add_argument("--worker", action="store_true",
                    help="also measure a real ethen worker's Forward (layers 0-9) the same way as the floor")
    ap.add_argument("--hosts", action="store_true",
                    help="root: the three servers on namespaced hosts behind delaying relays (see hosts())")
    ap.add_argument("--delays", default="0,5,20", help="--hosts: one-way delays per crossing, ms")
    ap.add_argument("--sessions", type=int, default=8, help="--hosts: concurrent steps for the aggregate")
    ap.add_argument("--server", nargs=4, help=argparse.SUPPRESS)  # port next_address|next_port method seed
    args = ap.parse_args()
    if args.server:
        port, nxt, method, seed = args.server
        run_server(int(port), int(nxt) if nxt.isdigit() else nxt, method, int(seed))
        return
    if args.hosts:
        hosts(args)
        return

    ports = [free_port() for _ in range(3)]
    deliver_port = free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--server", str(p),
                          str(ports[i + 1] if i + 1 < 3 else deliver_port), "Deliver" if i == 2 else "Chain",
                          str(i)])
        for i, p in enumerate(ports)
    ]
    deliver_server: grpc.Server | None = None
    try:
        got = threading.Event()

        def deliver(req: bytes, ctx: Any) -> bytes:
            got.set()
            return b""

        deliver_server = serve(deliver_port, {"Deliver": deliver})  # referenced: a dropped server stops
        local = weights(0) + weights(1) + weights(2)
        fwd = [stub(p, "Fwd") for p in ports]
        chain0 = stub(ports[0], "Chain")
        x = np.ones(576, np.float32)
        deadline = time.monotonic() + 60
        while True:  # wait for the servers (they build their matrices first)
            try:
                for f in fwd:
                    f(x.tobytes(), timeout=5)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        single: list[float] = []
        sequential: list[float] = []
        chained: list[float] = []
        warmed: list[float] = []
        warm = [stub(p, "Warm") for p in ports]
        for _ in range(args.rounds):
            for _ in range(args.steps):
                t = time.perf_counter()
                compute(local, x)
                single.append(time.perf_counter() - t)
            for _ in range(args.steps):
                t = time.perf_counter()
                h = x.tobytes()
                for f in fwd:
                    h = f(h)
                sequential.append(time.perf_counter() - t)
            for _ in range(args.steps):
                t = time.perf_counter()
                h = x.tobytes()
                pings = []
                for i, f in enumerate(fwd):
                    if i + 1 < len(fwd):  # wake the next stage while this one computes
                        pings.append(warm[i + 1].future(b""))
                    h = f(h)
                warmed.append(time.perf_counter() - t)
                for ping in pings:
                    ping.result()
            for _ in range(args.steps):
                got.clear()
                t = time.perf_counter()
                chain0(x.tobytes())
                if not got.wait(10):
                    raise RuntimeError("the chain did not deliver within 10 s")
                chained.append(time.perf_counter() - t)
        # the cold RPC floor: rtt minus the handler's own time, with this process streaming ~160 MB between
        # calls (as the other stages do in a pipeline), so the RPC path starts with cold caches
        timed = stub(ports[0], "Timed")
        flush = np.ones(40_000_000, np.float32)
        floor: list[float] = []
        for _ in range(args.rounds * args.steps):
            flush.sum()
            t = time.perf_counter()
            out = timed(x.tobytes())
            floor.append((time.perf_counter() - t) * 1000 - struct.unpack("<d", out[-8:])[0])
        worker_floor = measure_worker(args.rounds * args.steps, flush) if args.worker else None
        s, a, b, w = (statistics.median(v) * 1000 for v in (single, sequential, chained, warmed))
        print(f"{'mode':34} {'step ms':>8} {'vs single':>10} {'overhead/hop ms':>16}")
        print(f"{'single process (baseline)':34} {s:8.2f} {'100.0%':>10} {'':>16}")
        print(f"{'sequential unary (orchestrator)':34} {a:8.2f} {s / a:10.1%} {(a - s) / 3:16.2f}")
        print(f"{'chained (worker -> worker)':34} {b:8.2f} {s / b:10.1%} {(b - s) / 3:16.2f}")
        print(f"{'sequential, next stage pre-warmed':34} {w:8.2f} {s / w:10.1%} {(w - s) / 3:16.2f}")
        print(f"cold RPC floor (rtt - handler time, caches flushed before each call): "
              f"{statistics.median(floor):.2f} ms per RPC")
        if worker_floor is not None:
            print(f"ethen worker Forward, same measure (rtt - queue - compute): {worker_floor:.2f} ms")
        print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs")
    finally:
        if deliver_server is not None:
            deliver_server.stop(None)
        for proc in procs:
            proc.kill()


def hosts(args: argparse.Namespace) -> None:
    """Star vs chain through the relays of three namespaced hosts (root; ``tests.mesh.netns``).

    Each server runs in its host's namespace on 127.0.0.1 behind the host's relay; servers call the next one
    at its relay's address, and the last delivers to this process's receiver behind a relay in the root
    namespace, so every one-way crossing on the critical path pays D: the star 6 D per step (client -> s1 ->
    client -> s2 -> ...), the chain 4 D (client -> s1 -> s2 -> s3 -> client; acks off the critical path).
    Per delay: one step at a time (ms per step, and the floor ``compute + crossings x D``), and
    ``--sessions`` concurrent steppers (aggregate steps/s).
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.mesh.netns import Hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"mesh_hops --hosts: {reason}")
    inner = 50100  # the servers' port inside each (fresh) namespace
    delays = [float(d) for d in args.delays.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    deliver_server: grpc.Server | None = None
    waiting: dict[bytes, threading.Event] = {}
    lock = threading.Lock()

    def deliver(req: bytes, ctx: Any) -> bytes:
        with lock:
            ev = waiting.get(req[:8])
        if ev is not None:
            ev.set()
        return b""

    with Hosts(3) as hs:
        try:
            port = free_port()
            deliver_server = serve(port, {"Deliver": deliver})
            back = hs.root_relay(port)
            for h in hs.hosts:
                h.start_relay(inner)
            for i, h in enumerate(hs.hosts):
                nxt = hs[i + 1].address if i < 2 else back.address
                procs.append(subprocess.Popen(
                    [*h.prefix, sys.executable, __file__, "--server", str(inner), nxt,
                     "Deliver" if i == 2 else "Tagged", str(i)], env={**os.environ}))
            fwd = [stub(h.address, "Fwd") for h in hs.hosts]
            chain0 = stub(hs[0].address, "Tagged")
            x = np.ones(576, np.float32)
            deadline = time.monotonic() + 90
            while True:
                try:
                    for f in fwd:
                        f(x.tobytes(), timeout=5)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            tags = iter(range(1 << 62))

            def star_step() -> None:
                h = x.tobytes()
                for f in fwd:
                    h = f(h, timeout=30)

            def chain_step() -> None:
                tag = struct.pack("<q", next(tags))
                ev = threading.Event()
                with lock:
                    waiting[tag] = ev
                chain0(tag + x.tobytes(), timeout=30)
                if not ev.wait(30):
                    raise RuntimeError("the chain did not deliver within 30 s")
                with lock:
                    del waiting[tag]

            def one(step: Callable[[], None]) -> float:
                for _ in range(2):
                    step()
                t = time.perf_counter()
                for _ in range(args.steps):
                    step()
                return (time.perf_counter() - t) * 1000 / args.steps

            def many(step: Callable[[], None]) -> float:
                def run() -> None:
                    for _ in range(args.steps):
                        step()
                threads = [threading.Thread(target=run) for _ in range(args.sessions)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join(timeout=300)
                return args.sessions * args.steps / (time.perf_counter() - t)

            res: dict[float, dict[str, list[float]]] = {d: collections.defaultdict(list) for d in delays}
            for _ in range(args.rounds):
                for d in delays:
                    hs.set_delay(d)
                    res[d]["rtt"].append(statistics.median(h.echo_rtt_ms(5) for h in hs.hosts))
                    for name, step in (("star", star_step), ("chain", chain_step)):
                        res[d][name].append(one(step))
                        res[d][name + "N"].append(many(step))
            med = statistics.median
            base = res[delays[0]]
            print(f"{args.steps} steps per measurement, medians of {args.rounds} rounds (delays "
                  f"interleaved); {args.sessions} concurrent for the aggregate")
            print(f"{'one-way':>8} {'echo rtt':>9} | {'1 step: star':>12} {'chain':>7} {'chain/star':>10} | "
                  f"{args.sessions}x: {'star':>6} {'chain':>7} {'chain/star':>10} | "
                  f"{'vs 0 ms: star':>13} {'chain':>6}")
            for d in delays:
                r = {k: med(v) for k, v in res[d].items()}
                b = {k: med(v) for k, v in base.items()}
                print(f"{d:6g}ms {r['rtt']:7.1f}ms | {r['star']:10.1f}ms {r['chain']:5.1f}ms "
                      f"{r['star'] / r['chain']:9.2f}x | {r['starN']:8.1f}/s {r['chainN']:5.1f}/s "
                      f"{r['chainN'] / r['starN']:9.2f}x | {r['starN'] / b['starN']:12.0%} "
                      f"{r['chainN'] / b['chainN']:6.0%}")
            print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs")
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
            if deliver_server is not None:
                deliver_server.stop(None)


if __name__ == "__main__":
    main()
