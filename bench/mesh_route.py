"""Benchmark: ``score_route`` against a networkx shortest path on the same problem, in the same run.

What it measures
----------------
For random meshes of 100, 1,000 and 10,000 nodes over 80 layers (seeded, so every run sees the same
meshes), the wall time of one full ``score_route`` call (input checks, fragment index, DP, ``Route`` with its
breakdown and rejections), median over several calls.

Baselines, networkx ``dijkstra_path_length`` on explicit graphs whose vertices are ``(boundary, node of the
current stage)``, built from the same ``NodeState`` list:

- **direct** (the issue's graph): from every vertex ``(L, x)`` an edge to ``(E+1, m)`` for every fragment
  ``(L, E)`` of node ``m``, weight 0 when ``m == x`` (the stage continues), else ``cost(m) + hop``. Its edge
  count is quadratic in the nodes per boundary: it is skipped above 2 million edges (~8 million at 10,000
  nodes would need gigabytes), with the count printed.
- **hub** (a stronger baseline): the switch edges go through one hub vertex ``(L, *)`` per boundary that
  every vertex at ``L`` reaches at weight 0, so the graph has O(fragments) edges. The hub lets a node
  "switch" to itself, which always costs more than continuing, so the optimum is unchanged.

Each baseline is timed twice: building the graph plus the search, and the search alone on a prebuilt
graph. Dijkstra stops when it reaches the sink, so the search alone reads only part of the graph, while
``score_route`` reads every node on each call (it has no prebuilt structure to reuse). All solvers must
return the same cost (checked on every mesh; the script fails otherwise).

Meshes: each node has 1-4 fragments; fragments mostly start and end on 4-layer blocks (so chains exist and
layers are replicated many times), a quarter of them at random layers; 10 % of nodes are dead; latency
1-60 ms, load 0-1, capacity score 0.5-30. The first nodes form one guaranteed covering chain.

The timings of a size take turns (ours, then each baseline) so that a busy shared machine slows them
alike; the process's long-lived objects (meshes, prebuilt graphs) are frozen out of the garbage collector
and each timed call starts right after a collection. The clock is this process's CPU time by default
(``--clock wall`` for wall time), so waiting for a core does not count; the load average is printed.

Run: ``.venv/bin/python bench/mesh_route.py`` (``--quick`` for fewer repeats).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import networkx as nx

from ethen.mesh import NodeState, RouteWeights, RoutingRequest, score_route

LAYERS = 80
SIZES = (100, 1_000, 10_000)
SEED = 20261129


def random_mesh(n_nodes: int, rng: random.Random) -> list[NodeState]:
    states: list[NodeState] = []
    # A guaranteed covering chain of 8-layer fragments.
    for i, first in enumerate(range(0, LAYERS, 8)):
        states.append(NodeState(f"chain{i:02d}", rng.uniform(20, 60), rng.random(), rng.uniform(0.5, 5),
                                [(first, first + 7)]))  # fmt: skip
    while len(states) < n_nodes:
        fragments: list[tuple[int, int]] = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.75:
                start = 4 * rng.randrange(LAYERS // 4)
                end = min(LAYERS, start + 4 * rng.randint(1, 5)) - 1
            else:
                start = rng.randrange(LAYERS)
                end = min(LAYERS - 1, start + rng.randint(0, 15))
            fragments.append((start, end))
        states.append(
            NodeState(
                node_id=f"n{len(states):05d}",
                latency_ms=rng.uniform(1, 60),
                current_load=rng.random(),
                capacity_score=rng.uniform(0.5, 30),
                served_layers=fragments,
                alive=rng.random() >= 0.1,
            )
        )
    rng.shuffle(states)
    return states


MAX_DIRECT_EDGES = 2_000_000


def usable(states: list[NodeState], weights: RouteWeights) -> list[tuple[str, float, int, int]]:
    """(node id, stage cost, first, last) of every live fragment (the window is every layer)."""
    return [(s.node_id, weights.node_cost(s), a, e) for s in states if s.alive for a, e in s.served_layers]


def direct_edge_count(states: list[NodeState]) -> int:
    enders: dict[int, set[str]] = {0: {"source"}}
    starting: dict[int, int] = {}
    for s in states:
        if s.alive:
            for a, e in s.served_layers:
                enders.setdefault(e + 1, set()).add(s.node_id)
                starting[a] = starting.get(a, 0) + 1
    return sum(len(enders.get(b, ())) * count for b, count in starting.items())


def direct_graph(states: list[NodeState], weights: RouteWeights) -> nx.DiGraph:
    hop = weights.hop_cost()
    frags = usable(states, weights)
    by_start: dict[int, list[tuple[str, float, int]]] = {}
    enders: dict[int, set[str]] = {}
    for node_id, cost, a, e in frags:
        by_start.setdefault(a, []).append((node_id, cost, e))
        enders.setdefault(e + 1, set()).add(node_id)
    g = nx.DiGraph()
    for node_id, cost, e in by_start.get(0, ()):
        g.add_edge("source", (e + 1, node_id), weight=cost)
    for b, starting in by_start.items():
        for x in enders.get(b, ()):
            for node_id, cost, e in starting:
                g.add_edge((b, x), (e + 1, node_id), weight=0.0 if node_id == x else cost + hop)
    for x in enders.get(LAYERS, ()):
        g.add_edge((LAYERS, x), "sink", weight=0.0)
    return g


def hub_graph(states: list[NodeState], weights: RouteWeights) -> nx.DiGraph:
    hop = weights.hop_cost()
    g = nx.DiGraph()
    for node_id, cost, a, e in usable(states, weights):
        g.add_edge((a, node_id), (e + 1, node_id), weight=0.0)
        g.add_edge((a, "*"), (e + 1, node_id), weight=cost + hop)
        g.add_edge((e + 1, node_id), (e + 1, "*"), weight=0.0)
        if a == 0:
            g.add_edge("source", (e + 1, node_id), weight=cost)
        if e == LAYERS - 1:
            g.add_edge((e + 1, node_id), "sink", weight=0.0)
    return g


def solve(graph: nx.DiGraph) -> float:
    return float(nx.dijkstra_path_length(graph, "source", "sink"))


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def interleaved_medians(
    fns: list[Callable[[], object]], repeats: int, clock: Callable[[], float]
) -> list[float]:
    """Median time of each function, the functions taking turns so that they share the machine's load."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            gc.collect()  # every call starts from the same collector state
            start = clock()
            fn()
            out.append(clock() - start)
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (default; ignores waiting for a core on a shared machine); wall",
    )
    args = parser.parse_args()
    rng = random.Random(SEED)
    weights = RouteWeights()
    request = RoutingRequest((0, LAYERS - 1))
    print(__doc__.split("Run:")[0].strip().splitlines()[0])
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (shared machine: figures vary)")
    print(f"python {sys.version.split()[0]}, networkx {nx.__version__}, seed {SEED}, {LAYERS} layers; "
          f"medians of interleaved calls, {args.clock} time")  # fmt: skip
    ours_by_size: dict[int, float] = {}
    hub_by_size: dict[int, float] = {}
    frags_by_size: dict[int, int] = {}
    for n in SIZES:
        states = random_mesh(n, rng)
        route = score_route(request, states, weights)
        builders: dict[str, Callable[[list[NodeState], RouteWeights], nx.DiGraph]] = {"hub": hub_graph}
        edges = direct_edge_count(states)
        if edges <= MAX_DIRECT_EDGES:
            builders = {"direct": direct_graph, **builders}
        graphs = {name: build(states, weights) for name, build in builders.items()}
        for name, graph in graphs.items():
            if not math.isclose(route.cost, solve(graph), rel_tol=1e-12, abs_tol=1e-9):
                print(f"MISMATCH at {n} nodes: score_route {route.cost!r}, networkx {name} {solve(graph)!r}")
                return 1
        fragments = sum(len(s.served_layers) for s in states if s.alive)
        fns: list[Callable[[], object]] = [lambda states=states: score_route(request, states, weights)]
        for name, build in builders.items():
            fns.append(lambda build=build, states=states: solve(build(states, weights)))
            fns.append(lambda g=graphs[name]: solve(g))
        repeats = (3 if args.quick else 9) if n < 10_000 else (3 if args.quick else 5)
        gc.collect()
        gc.freeze()  # the prebuilt graphs and meshes are not the timed calls' garbage: keep them out of GC
        times = interleaved_medians(fns, repeats, CLOCKS[args.clock])
        gc.unfreeze()
        ours = times[0]
        ours_by_size[n], frags_by_size[n] = ours, fragments
        hub_by_size[n] = times[-2]  # hub graph, build + solve
        print(f"\n{n:,} nodes, {fragments:,} live fragments; route of {len(route.stages)} stages, cost "
              f"{route.cost:.3f} (same from every solver)")  # fmt: skip
        print(f"  {'score_route':<60} {ours * 1e3:>9.2f} ms  ({ours / fragments * 1e6:.2f} us/fragment)")
        for i, (name, graph) in enumerate(graphs.items()):
            total, alone = times[1 + 2 * i], times[2 + 2 * i]
            label = f"networkx {name} graph ({graph.number_of_edges():,} edges)"
            for what, t in ((", build + solve", total), (", solve only", alone)):
                print(f"  {label + what:<60} {t * 1e3:>9.2f} ms  = {t / ours:.2f}x score_route")
        if "direct" not in graphs:
            print(f"  networkx direct graph: skipped, it would have {edges:,} edges")
    print()
    for small, big in itertools.pairwise(SIZES):
        growth = ours_by_size[big] / ours_by_size[small]
        print(f"growth {small:,} -> {big:,} nodes: score_route time x{growth:.1f} (target <= ~12x), networkx "
              f"hub build + solve x{hub_by_size[big] / hub_by_size[small]:.1f}, for fragments "
              f"x{frags_by_size[big] / frags_by_size[small]:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
