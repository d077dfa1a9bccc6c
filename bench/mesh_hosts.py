"""Mesh across three namespaced hosts: decode speed against the physical limit, latency hiding, detection.

    sudo .venv/bin/python bench/mesh_hosts.py [--tokens 32] [--sessions 8] [--lanes 1,2,2u] [--repeat 3]

Needs root and ``ip netns`` (the hosts of :mod:`tests.mesh.netns`: one network namespace per host on a bridge,
a worker bound to the namespace's loopback behind a relay that holds each chunk D ms each way). One run:

- hosts ``a`` (layers 0-9, 10-19), ``b`` (10-19, 20-29), ``c`` (0-9, 20-29); the measured route is the
  3-stage pipeline a 0-9 -> b 10-19 -> c 20-29 (star: the orchestrator, in the root namespace, calls each
  stage in turn); every host also holds a replica of another stage, for the failover measurements.
- for one-way delays 0, 5 and 20 ms per link: the echo round trip through each relay (measured); one
  session's decode tokens/s and the physical limit ``1 / (sum of stage compute per token + sum of hop round
  trips)``, where stage compute is the workers' own queue + compute time reported in each reply of the same
  run and the hop round trips are the echo round trips; the aggregate decode tokens/s of ``--sessions``
  concurrent sessions for each ``--lanes`` value (independent decode-round groups in flight at once,
  staggered by a stage unless suffixed ``u``, star and chain alike). Each configuration runs ``--repeat``
  times with the delays interleaved (0, 5, 20, 0, 5, 20, ...), so a ratio to 0 ms pairs runs taken close
  together on a shared VM whose load drifts; medians are printed with every run's figure. Also printed, per
  token: what one session pays beyond the limit (the head's time, the three RPCs beyond the echo round trip,
  the rest), and, as a baseline measured in the same run, one session with the orchestrator's head unsplit
  (``head_fn.split = False``; the default splits its matmul over 2 threads) and the head's own time both ways.
- ``--planes star,chain`` (default both): each measurement also runs with the worker-to-worker chain
  (:mod:`ethen.mesh.orchestrator.chain`), whose receiver sits behind a relay in the root namespace so the
  last hop's delivery pays D too; one session's chain step is printed against the same limit (which counts
  the star's 6 crossings, so the chain, crossing 4, may pass 100 %).
- detection, at 5 ms: a dead node (``kill -9``, no request in flight) and a partition (``ip link set down``):
  seconds until the orchestrator's states say dead; a stuck node (``SIGSTOP`` mid-generation,
  ``progress_timeout_s`` 2 s): the longest gap between two tokens, and whether the greedy output equals an
  uninterrupted run (tokens lost on failover).

Measured (one run, VM saturated by other jobs, load average 12; stage compute 61-217 ms per token instead
of ~20 quiet): one session 64 / 77 / 80 % of the physical limit at 0 / 5 / 20 ms (runs 59-67, 77-79, 78-81 %);
beyond the limit per token: head 11-27 ms, three RPCs beyond the echo 12-19 ms, the rest (the thread
waiting for a CPU) 14-21 ms. 8 sessions at 20 ms vs 0 ms: 1 lane 10.5 vs 21.6 tok/s = 51 % (paired runs
68, 51, 32 %); 2 lanes staggered 9.2 vs 8.4 = 102 %; 2 lanes unstaggered 11.6 vs 9.2 = 98 %: the lanes'
ratio passes only because they lose at 0 ms (CPU-bound workers: a lane of 4 costs about what a lane of 8
does), and at 20 ms all three give 9-12 tok/s. Detection: partition 0.51 s, kill -9 0.03 s, SIGSTOP
longest token gap 2.97 s at ``progress_timeout_s`` 2, 0 tokens lost. Earlier runs (load 7.5-8.8, before
staggering): 61-65 / 75 / 83-85 %; 8 sessions 57-70 %, and a probe showing unstaggered lanes stay in phase
(their steps are merged on the workers). A bound to keep in mind (Little's law): N sessions in a star at
one-way delay D cannot exceed N / (6 D + compute latency per token) tokens/s (8 sessions at 20 ms: at most
8 / (0.12 s + compute)), so on a quiet machine, where 8 batched sessions reach ~100 tokens/s at 0 ms, 80 %
at 20 ms is out of reach for 8 sessions whatever the schedule; a chain (worker to worker, 4 D per token
instead of 6 D) or more sessions in flight raise that bound.

Star vs chain (two runs, load 5-10 from other jobs, ``--lanes 1,2,4 --repeat 2 --tokens 24``): one session
star / chain 77 / 80 and 78 / 75 % of the limit at 5 ms, 84 / 97 and 87 / 110 % at 20 ms; 8 sessions at 20
ms vs 0 ms: star 1 lane 70 / 61 %, chain 1 lane 65 / 67 %, chain 4 lanes 92 / 118 % (slow at 0 ms); stuck
node under the chain: longest gap 2.60 s, 0 tokens lost. See README ("Data plane: star or chain").

Decode is measured with ``MeshSession.step`` (prefill the prompt, then feed the argmax token), so the
measured steps never stop early at an end-of-sequence token. BLAS is single-threaded in every process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.mesh.netns: the namespaced hosts

from ethen.mesh.orchestrator import Orchestrator, plan_route
from ethen.mesh.routing import NodeState, Route
from tests.mesh.netns import Hosts, unavailable_reason

LAYOUT = {"a": "0-9,10-19", "b": "10-19,20-29", "c": "0-9,20-29"}
PIPELINE = {"a": (0, 9), "b": (10, 19), "c": (20, 29)}
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


class Recorder:
    """Wraps the telemetry's per-call observer: the workers' queue + compute per one-row call, per node."""

    def __init__(self, orch: Orchestrator) -> None:
        self.inner = orch.monitor.observe_call
        self.worker_ms: dict[str, list[float]] = defaultdict(list)
        self.rest_ms: dict[str, list[float]] = defaultdict(list)  # call duration - worker time
        self.lock = threading.Lock()
        orch.rounds.observe = self

    def __call__(self, node: str, rows: int, duration_ms: float, worker_ms: float) -> None:
        self.inner(node, rows, duration_ms, worker_ms)
        if rows == 1:
            with self.lock:
                self.worker_ms[node].append(worker_ms)
                self.rest_ms[node].append(duration_ms - worker_ms)

    def reset(self) -> None:
        with self.lock:
            self.worker_ms.clear()
            self.rest_ms.clear()


def pipeline_route(orch: Orchestrator, prompt_tokens: int) -> Route:
    states = [NodeState(s.node_id, s.latency_ms, s.current_load, s.capacity_score, [PIPELINE[s.node_id]],
                        s.alive) for s in orch.states()]
    return plan_route(states, 30, prompt_tokens, orch.weights, orch.model_name)


def decode(orch: Orchestrator, ids: list[int], tokens: int, route: Route) -> tuple[float, list[int]]:
    """Seconds for ``tokens`` greedy decode steps after the prefill, and the tokens."""
    session = orch.open_session(len(ids), route=route)
    try:
        tok = int(np.argmax(session.step(ids)))
        out = [tok]
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = int(np.argmax(session.step([tok])))
            out.append(tok)
        return time.perf_counter() - t0, out
    finally:
        session.close()


def aggregate(orch: Orchestrator, ids: list[int], sessions: int, tokens: int, route: Route) -> float:
    barrier = threading.Barrier(sessions)
    spans: list[tuple[float, float]] = []

    def run() -> None:
        session = orch.open_session(len(ids), route=route)
        try:
            tok = int(np.argmax(session.step(ids)))
            barrier.wait(timeout=120)
            t0 = time.perf_counter()
            for _ in range(tokens):
                tok = int(np.argmax(session.step([tok])))
            spans.append((t0, time.perf_counter()))
        finally:
            session.close()

    threads = [threading.Thread(target=run) for _ in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    return sessions * tokens / (end - start)


def head_ms(orch: Orchestrator, samples: int = 9, rows: int = 1) -> tuple[float, float]:
    """Median ms of the orchestrator's head for ``rows`` rows (one: what a lone session pays per token):
    (split over threads, as the orchestrator runs it; unsplit), alternated."""
    h = np.ascontiguousarray(np.repeat(orch.ends.embed([1]), rows, axis=0))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(samples):
        for split in (True, False):
            orch.head_fn.split = split
            t0 = time.perf_counter()
            orch.head_fn(h)
            times[split].append((time.perf_counter() - t0) * 1000.0)
    orch.head_fn.split = True
    return statistics.median(times[True]), statistics.median(times[False])


def unsplit(orch: Orchestrator) -> Orchestrator:
    """``orch`` with its head unsplit until :func:`split` (the baseline measured in the same run)."""
    orch.head_fn.split = False
    return orch


def split(orch: Orchestrator) -> None:
    orch.head_fn.split = True


def until_dead(orch: Orchestrator, node: str, t0: float, timeout_s: float = 5.0) -> float:
    """Seconds from ``t0`` (just before the fault) until the orchestrator's states say ``node`` is dead."""
    while time.monotonic() - t0 < timeout_s:
        if not next(s.alive for s in orch.states() if s.node_id == node):
            return time.monotonic() - t0
        time.sleep(0.01)
    return float("nan")


def configs(spec: str, planes: list[str]) -> list[tuple[str, int, bool]]:
    """``"1,4,4u"`` -> [(plane, 1, True), (plane, 4, True), (plane, 4, False)] per data plane: lanes, and
    ``u`` for lanes left unstaggered (the star staggers each stage call, the chain each lane's first hop)."""
    out: list[tuple[str, int, bool]] = []
    for plane in planes:
        for word in spec.split(","):
            key = (plane, int(word.rstrip("u")), not word.endswith("u"))
            if key not in out:
                out.append(key)
    return out


def label(plane: str, lanes: int, stagger: bool) -> str:
    if lanes == 1:
        return f"{plane}, {lanes} lane" + ("s" if lanes > 1 else "")
    return f"{plane}, {lanes} lanes" + (", staggered" if stagger else ", unstaggered")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def load_orchestrator(hosts: Hosts, addresses: dict[str, str], plane: str, lanes: int,
                      progress_timeout_s: float) -> Orchestrator:
    """A star orchestrator, or a chain one whose receiver sits behind a delaying relay in the root namespace
    (so the last hop's delivery pays the one-way delay like every other crossing)."""
    if plane == "star":
        return Orchestrator.load(addresses, round_lanes=lanes, progress_timeout_s=progress_timeout_s).start()
    port = free_port()
    relay = hosts.root_relay(port)
    return Orchestrator.load(addresses, round_lanes=lanes, progress_timeout_s=progress_timeout_s,
                             data_plane="chain", chain_listen=f"127.0.0.1:{port}",
                             chain_advertise=relay.address).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measured session")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions for the aggregate")
    ap.add_argument("--lanes", default="1,2,4,8",
                    help="decode-round lanes to measure the aggregate with (suffix u: unstaggered)")
    ap.add_argument("--delays", default="0,5,20", help="one-way delays per link, ms")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per configuration (medians)")
    ap.add_argument("--no-detection", action="store_true", help="skip the detection measurements")
    ap.add_argument("--planes", default="star,chain", help="data planes to measure (star, chain)")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"mesh_hosts: {reason}")
    planes = args.planes.split(",")
    cfgs = configs(args.lanes, planes)
    delays = [float(x) for x in args.delays.split(",")]
    with Hosts(3) as hosts:
        for i, (node, layers) in enumerate(LAYOUT.items()):
            hosts[i].start(node, layers)
        addresses = {node: hosts[i].address for i, node in enumerate(LAYOUT)}
        # a generous progress deadline: on a saturated VM 8 queued prefills can pass the 5 s default (the
        # stuck-node measurement below uses 2 s)
        orchs = {(plane, n): load_orchestrator(hosts, addresses, plane, n, 30.0)
                 for plane, n in {("star", 1), *((p, 1) for p in planes), *((p, n) for p, n, _ in cfgs)}}
        try:
            base = orchs[("star", 1)]
            ids = base.chat_prompt(PROMPT)
            rec = Recorder(base)
            route = pipeline_route(base, len(ids))
            print(f"route {' -> '.join(f'{s.node_id} {s.first}-{s.last}' for s in route.stages)}; prompt "
                  f"{len(ids)} tokens; {args.tokens} decode steps per session; medians of {args.repeat}")
            m: dict[float, dict[str, list[float]]] = {d: defaultdict(list) for d in delays}
            aggs: dict[float, dict[tuple[str, int, bool], list[float]]] = {
                d: defaultdict(list) for d in delays}
            rtts: dict[float, list[float]] = {}
            for _ in range(args.repeat):  # delays interleaved: a ratio pairs figures taken close together
                for delay in delays:
                    hosts.set_delay(delay)  # the workers' relays and the chain receivers' relays
                    rtts[delay] = [h.echo_rtt_ms(9) for h in hosts.hosts]
                    decode(base, ids, 4, route)  # warm
                    rec.reset()
                    secs, _ = decode(base, ids, args.tokens, route)
                    compute = sum(statistics.median(rec.worker_ms[n]) for n in PIPELINE)
                    limit_ms = compute + sum(rtts[delay])
                    m[delay]["ratio"].append(args.tokens / secs * limit_ms / 1000.0)
                    m[delay]["step"].append(1000 * secs / args.tokens)
                    m[delay]["limit"].append(limit_ms)
                    m[delay]["compute"].append(compute)
                    m[delay]["rpc"].append(sum(statistics.median(rec.rest_ms[n]) - rtt
                                               for n, rtt in zip(PIPELINE, rtts[delay], strict=True)))
                    heads = head_ms(base)
                    m[delay]["head"].append(heads[0])
                    m[delay]["head_unsplit"].append(heads[1])
                    m[delay]["head8"].extend(head_ms(base, 5, 8))
                    secs, _ = decode(unsplit(base), ids, args.tokens, route)  # baseline: the unsplit head
                    split(base)
                    m[delay]["ratio_unsplit"].append(args.tokens / secs * limit_ms / 1000.0)
                    if "chain" in planes:  # one session through the chain, against the same limit
                        chain = orchs[("chain", 1)]
                        decode(chain, ids, 4, route)
                        secs, _ = decode(chain, ids, args.tokens, route)
                        m[delay]["chain_ratio"].append(args.tokens / secs * limit_ms / 1000.0)
                        m[delay]["chain_step"].append(1000 * secs / args.tokens)
                        secs, _ = decode(unsplit(chain), ids, args.tokens, route)
                        split(chain)
                        m[delay]["chain_ratio_unsplit"].append(args.tokens / secs * limit_ms / 1000.0)
                    for plane, n, stagger in cfgs:
                        orch = orchs[(plane, n)]
                        orch.rounds.stagger = stagger and n > 1
                        got = aggregate(orch, ids, args.sessions, args.tokens, pipeline_route(orch, len(ids)))
                        aggs[delay][(plane, n, stagger)].append(got)
            med = statistics.median
            for delay in delays:
                r = m[delay]
                hops = ", ".join(f"{x:.1f}" for x in rtts[delay])
                runs = ", ".join(f"{c:.0f}" for c in r["compute"])
                print(f"\none-way {delay:g} ms: echo round trip per hop {hops} ms; stage compute "
                      f"{med(r['compute']):.1f} ms/token (workers' own; runs {runs})")
                runs = ", ".join(f"{100 * x:.0f}" for x in r["ratio"])
                print(f"  1 session: step {med(r['step']):.1f} ms vs physical limit {med(r['limit']):.1f} ms "
                      f"-> {100 * med(r['ratio']):.0f} % of it (runs {runs} %); head unsplit (baseline, "
                      f"same run): {100 * med(r['ratio_unsplit']):.0f} %")
                if r["chain_step"]:
                    runs = ", ".join(f"{100 * x:.0f}" for x in r["chain_ratio"])
                    print(f"  1 session, chain: step {med(r['chain_step']):.1f} ms -> "
                          f"{100 * med(r['chain_ratio']):.0f} % of the same limit (runs {runs} %); "
                          f"star/chain step time {med(r['step']) / med(r['chain_step']):.2f}x; head unsplit "
                          f"(baseline, same run): {100 * med(r['chain_ratio_unsplit']):.0f} % (runs "
                          f"{', '.join(f'{100 * x:.0f}' for x in r['chain_ratio_unsplit'])} %)")
                rest = med(r["step"]) - med(r["limit"]) - med(r["head"]) - med(r["rpc"])
                h8 = r["head8"]
                print(f"    beyond the limit, per token: head (norm + [1, d] x [d, V]) {med(r['head']):.1f} "
                      f"ms split over 2 threads ({med(r['head_unsplit']):.1f} unsplit; 8 rows "
                      f"{med(h8[0::2]):.1f} vs {med(h8[1::2]):.1f}); 3 RPCs beyond the echo round trip "
                      f"{med(r['rpc']):.1f} ms; rest {rest:.1f} ms")
                for key in cfgs:
                    got = aggs[delay][key]
                    rel = ""
                    if delay != delays[0]:
                        paired = [x / y for x, y in zip(got, aggs[delays[0]][key], strict=True)]
                        rel = (f" = {100 * med(paired):.0f} % of {delays[0]:g} ms (paired runs "
                               f"{', '.join(f'{100 * x:.0f}' for x in paired)} %)")
                    runs = ", ".join(f"{a:.1f}" for a in got)
                    print(f"  {args.sessions} sessions, {label(*key)}: {med(got):.1f} tok/s aggregate (runs "
                          f"{runs}){rel}")
            if args.no_detection:
                print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
                return
            # ---- detection, at 5 ms ----------------------------------------------------------------------
            hosts.set_delay(5)
            _ref_secs, reference = decode(base, ids, args.tokens, route)
            for plane in planes:
                time.sleep(1.5)  # b answers Health again
                stuck = load_orchestrator(hosts, addresses, plane, 1, 2.0)
                try:
                    session = stuck.open_session(len(ids), route=pipeline_route(stuck, len(ids)))
                    tok = int(np.argmax(session.step(ids)))
                    out, stamps = [tok], [time.perf_counter()]
                    for i in range(args.tokens):
                        if i == 5:
                            hosts[1].stop_worker()  # b: alive, no progress
                        tok = int(np.argmax(session.step([tok])))
                        out.append(tok)
                        stamps.append(time.perf_counter())
                    session.close()
                    gap = max(y - x for x, y in itertools.pairwise(stamps))
                    lost = sum(1 for x, y in zip(out, reference, strict=True) if x != y)
                    failed = [f.failed_node for f in session.failovers]
                    print(f"\n{plane}: stuck node (SIGSTOP b mid-decode, progress_timeout_s 2): longest gap "
                          f"between tokens {gap:.2f} s; failovers {failed}; "
                          f"replayed {session.replayed_positions} positions; tokens differing from the "
                          f"uninterrupted run: {lost} of {len(out)}")
                finally:
                    hosts[1].continue_worker()
                    stuck.close()
            time.sleep(1.5)  # b answers Health again
            t0 = time.monotonic()
            hosts[0].partition()
            took = until_dead(base, "a", t0)
            print(f"partition (ip link set down a, idle): out of routing after {took:.2f} s")
            hosts[0].heal()
            t0 = time.monotonic()
            hosts[2].kill_worker()
            print(f"dead node (kill -9 c, idle): out of routing after {until_dead(base, 'c', t0):.2f} s")
        finally:
            for orch in orchs.values():
                orch.close()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average {load} (2 shared vCPUs: compare figures within a run)")


if __name__ == "__main__":
    main()

