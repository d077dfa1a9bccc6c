"""Benchmark: ``score_route`` against a networkx shortest path on the same problem, in the same run.

What it measures
----------------
For random meshes of 100, 1,000 and 10,000 nodes over 80 layers (seeded, so every run sees the same
meshes), the wall time of one full ``score_route`` call (input checks, fragment index, DP, ``Route`` with its
breakdown and rejections), median over several calls.

Baseline: networkx ``dijkstra_path_length`` on an explicit graph whose vertices are ``(boundary, node of the
current stage)``: a fragment ``(L, E)`` of node ``m`` is an edge ``(L, m) -> (E+1, m)`` of weight 0 (the stage
continues) and an edge ``(L, *) -> (E+1, m)`` of weight ``cost(m) + hop`` (a new stage), where ``(L, *)`` is
a hub every vertex at ``L`` reaches at weight 0. The hub keeps the graph at O(fragments) edges (joining every
``(L, x)`` to every fragment starting at ``L`` directly would be quadratic: ~8 million edges at 10,000 nodes);
it lets a node "switch" to itself, which always costs more than continuing, so the optimum is unchanged.
The baseline is timed twice: graph construction from the same ``NodeState`` list plus the search, and the
search alone. Both solvers must return the same cost (checked on every mesh; the script fails otherwise).

Meshes: each node has 1-4 fragments; fragments mostly start and end on 4-layer blocks (so chains exist and
layers are replicated many times), a quarter of them at random layers; 10 % of nodes are dead; latency
1-60 ms, load 0-1, capacity score 0.5-30. The first nodes form one guaranteed covering chain.

The three timings of a size take turns (ours, baseline build+solve, baseline solve) so that a busy shared
machine slows them alike; the load average is printed with the figures.

Run: ``.venv/bin/python bench/mesh_route.py`` (``--quick`` for fewer repeats).
"""

from __future__ import annotations

import argparse
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


def networkx_graph(states: list[NodeState], weights: RouteWeights) -> nx.DiGraph:
    first, last = 0, LAYERS - 1
    hop = weights.hop_cost()
    g = nx.DiGraph()
    for s in states:
        if not s.alive:
            continue
        cost = weights.node_cost(s)
        for a, e in s.served_layers:
            if a < first or e > last:
                continue
            g.add_edge((a, s.node_id), (e + 1, s.node_id), weight=0.0)
            g.add_edge((a, "*"), (e + 1, s.node_id), weight=cost + hop)
            g.add_edge((e + 1, s.node_id), (e + 1, "*"), weight=0.0)
            if a == first:
                g.add_edge("source", (e + 1, s.node_id), weight=cost)
            if e == last:
                g.add_edge((e + 1, s.node_id), "sink", weight=0.0)
    return g


def networkx_cost(states: list[NodeState], weights: RouteWeights) -> float:
    return float(nx.dijkstra_path_length(networkx_graph(states, weights), "source", "sink"))


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median time of each function, the functions taking turns so that they share the machine's load."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            out.append(seconds(fn))
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    rng = random.Random(SEED)
    weights = RouteWeights()
    request = RoutingRequest((0, LAYERS - 1))
    print(__doc__.split("Run:")[0].strip().splitlines()[0])
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} CPUs (shared machine: figures vary with it)")
    print(f"python {sys.version.split()[0]}, networkx {nx.__version__}, seed {SEED}, {LAYERS} layers; "
          "times are medians of interleaved calls, in ms\n")  # fmt: skip
    header = (f"{'nodes':>7} {'fragments':>9} {'stages':>6} {'score_route':>11} {'nx build+solve':>14} "
              f"{'nx solve':>9} {'ratio total':>11} {'ratio solve':>11} {'us/fragment':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    ours_by_size: dict[int, float] = {}
    frags_by_size: dict[int, int] = {}
    for n in SIZES:
        states = random_mesh(n, rng)
        route = score_route(request, states, weights)
        baseline = networkx_cost(states, weights)
        if not math.isclose(route.cost, baseline, rel_tol=1e-12, abs_tol=1e-9):
            print(f"MISMATCH at {n} nodes: score_route {route.cost!r} vs networkx {baseline!r}")
            return 1
        fragments = sum(len(s.served_layers) for s in states if s.alive)
        graph = networkx_graph(states, weights)
        repeats = (3 if args.quick else 9) if n < 10_000 else (3 if args.quick else 5)
        ours, total, solve = interleaved_medians(
            [
                lambda states=states: score_route(request, states, weights),
                lambda states=states: networkx_cost(states, weights),
                lambda g=graph: nx.dijkstra_path_length(g, "source", "sink"),
            ],
            repeats,
        )
        ours_by_size[n] = ours
        frags_by_size[n] = fragments
        print(f"{n:>7} {fragments:>9} {len(route.stages):>6} {ours * 1e3:>11.2f} {total * 1e3:>14.2f} "
              f"{solve * 1e3:>9.2f} {total / ours:>10.1f}x {solve / ours:>10.1f}x "
              f"{ours / fragments * 1e6:>11.2f}")  # fmt: skip
    print("\nsame cost from both solvers on every mesh (checked above)")
    for small, big in itertools.pairwise(SIZES):
        growth = ours_by_size[big] / ours_by_size[small]
        print(f"growth {small:>6} -> {big:>6} nodes: time x{growth:.1f} "
              f"for fragments x{frags_by_size[big] / frags_by_size[small]:.1f} (target <= ~12x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
