"""``ethen up`` load time and each worker's resident memory (issue 24: load <= 5 s on a warm page cache;
resident weight memory per worker <= 1.15x the bytes its layers take in the GGUF).

.venv/bin/python bench/up_load.py [--repeats 3] [--ref REV] [--skip-up] [--skip-probe]

* **Load**: ``ethen up --port 0`` in a data directory kept per tree (so the store and the caches exist: a
  second start, the page cache warm after one unmeasured run per tree); runs interleaved tree by tree; the
  figure is the banner's "ready in N s" with ``ETHEN_UP_T0`` set at the spawn (three workers started one
  after the other, the gateway, the orchestrator's head and first route), and the CPU seconds ``ethen up``
  and its workers used until then (``/proc/<pid>/stat``): the workers start one after the other, so on an
  idle machine the wall time is close to it; on a shared one the wall time is mostly waiting for a core.
  Each worker's ``VmRSS`` / ``RssAnon`` / ``RssFile`` is read from ``/proc`` at that moment too (the whole
  process: Python, gRPC, onnxruntime and the weights).
* ``--ref REV``: the same ``ethen up`` runs of commit ``REV`` too (``git archive`` into a temporary directory,
  run with ``PYTHONPATH`` on it), interleaved with this tree's: a same-run baseline for a load-time change.
* **Weights' resident memory** (the probe of ``tests/model/test_memory.py``): a fresh process loads one
  worker's layers the way a worker does (:func:`ethen.model.load_layer_stacks`), runs one 4-row step (so
  every weight page is touched) and prints its ``RssAnon`` / ``RssFile`` growth; the ratio is that growth
  over the bytes of those layers' tensors in the GGUF (the issue's measure; the KV cache of one short step
  is in it, a few hundred KB).

Medians over ``--repeats``; with ``--ref``, the ratio of this tree's median to the reference's is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ethen.model.gguf_loader import open_weight_store

READY = re.compile(r"^Ethen is up, ready in ([0-9.]+) s since the command started", re.M)
WORKER = re.compile(r"^\[2/4\] worker \d+/\d+: (\S+) layers ([0-9,-]+) \.\.\.$", re.M)
PID = re.compile(r"\(pid (\d+)\)")

PROBE = """
import json, sys
import numpy as np
from ethen.model import load_layer_stacks, open_weight_store

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out

store = open_weight_store()
import onnxruntime  # the engine's library (~23 MiB of RssFile) is not the weights'
before = status()
lo, hi = int(sys.argv[1]), int(sys.argv[2])
(stack,) = load_layer_stacks([(lo, hi)], store)
kv = stack.new_kv_cache()
stack.forward(np.ones((4, stack.config.d_model), dtype=np.float32), np.arange(4), kv)  # touch every page
after = status()
print(json.dumps({k: after[k] - before[k] for k in after}))
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def _layer_bytes(lo: int, hi: int) -> int:
    store = open_weight_store()
    return sum(t.nbytes for n, t in store.tensors.items()
               if n.startswith("blk.") and lo <= int(n.split(".")[1]) <= hi)


def _span(layers: str) -> tuple[int, int]:
    """``"0-9,10-19"`` (consecutive fragments) -> ``(0, 19)``."""
    bounds = [int(v) for part in layers.split(",") for v in part.split("-")]
    return min(bounds), max(bounds)


ROOT = Path(__file__).resolve().parents[1]


Workers = list[tuple[str, int, int, dict[str, int]]]


def run_up(data: Path, root: Path = ROOT) -> tuple[float, float, Workers]:
    """One ``ethen up`` of the tree at ``root``: seconds to ready, CPU seconds its processes (``ethen up``
    and its workers) used until then, and each worker's (node, first, last, /proc status)."""
    env = {**os.environ, "ETHEN_DATA_DIR": str(data), "PYTHONPATH": str(root),
           "ETHEN_UP_T0": str(time.time())}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=root)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops") or time.monotonic() > deadline:
                break
        text = "\n".join(lines)
        m = READY.search(text)
        if not m:
            raise RuntimeError(f"ethen up ({root}) did not come up:\n{text}")
        workers = [(w.group(1), *_span(w.group(2))) for w in WORKER.finditer(text)]
        pids = [int(p) for p in PID.findall(text)]
        cpu = _cpu_s(proc.pid) + sum(_cpu_s(p) for p in pids)
        procs = [(n, a, b, _status(p)) for (n, a, b), p in zip(workers, pids, strict=True)]
        return float(m.group(1)), cpu, procs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def probe(lo: int, hi: int, root: Path = ROOT) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(lo), str(hi)], capture_output=True, text=True,
                         timeout=600, check=True, env=env, cwd=root)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ref", default=None, help="also run ethen up of this commit (same run, interleaved)")
    ap.add_argument("--skip-up", action="store_true")
    ap.add_argument("--skip-probe", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ethen-up-ref-") as ref:
        roots = {"this tree": ROOT}
        if args.ref is not None:
            archive = subprocess.run(["git", "archive", args.ref], cwd=ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", ref], input=archive, check=True)
            roots[f"@{args.ref}"] = Path(ref)
        labels = list(roots.items())
        if not args.skip_up:
            _bench_up(labels, args.repeats)
        if not args.skip_probe:
            _bench_probe(labels, args.repeats)
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}")


Labels = list[tuple[str, Path]]  # (label, source tree)


def _bench_up(labels: Labels, repeats: int) -> None:
    ready: dict[str, list[float]] = {label: [] for label, _ in labels}
    cpu: dict[str, list[float]] = {label: [] for label, _ in labels}
    rss: dict[tuple[str, str], list[dict[str, int]]] = {}
    layouts: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="ethen-up-bench-") as tmp:
        for i, (_, root) in enumerate(labels):  # unmeasured: builds the caches, warms the page cache
            run_up(Path(tmp) / str(i), root)
        for _ in range(repeats):
            for i, (label, root) in enumerate(labels):
                took, used, workers = run_up(Path(tmp) / str(i), root)
                ready[label].append(took)
                cpu[label].append(used)
                for node, lo, hi, st in workers:
                    layouts[node] = (lo, hi)
                    rss.setdefault((label, node), []).append(st)
    print(f"ethen up, ready in (s), median of {repeats} (warm page cache, second start), interleaved:")
    for label, _ in labels:
        runs = [round(c, 2) for c in cpu[label]]
        print(f"  {label:22s} {statistics.median(ready[label]):6.2f}  runs {ready[label]}; CPU s of ethen up "
              f"+ workers until ready {statistics.median(cpu[label]):.2f} (runs {runs})")
    base = labels[0][0]
    for label, _ in labels[1:]:
        print(f"  {base} / {label}: {statistics.median(ready[base]) / statistics.median(ready[label]):.2f}x")
    print("each worker's process at ready (median VmRSS / RssAnon / RssFile; layers' bytes in the GGUF):")
    for node, (lo, hi) in layouts.items():
        fb = _layer_bytes(lo, hi)
        for label, _ in labels:
            sts = rss[(label, node)]
            med = {k: statistics.median(s[k] for s in sts) for k in ("VmRSS", "RssAnon", "RssFile")}
            print(f"  {node:7s} layers {lo}-{hi} ({_mib(fb)} in file) {label:22s} "
                  f"{_mib(med['VmRSS'])} / {_mib(med['RssAnon'])} / {_mib(med['RssFile'])}")


def _bench_probe(labels: Labels, repeats: int) -> None:
    ranges = [(0, 9), (0, 19)]  # the default layout's workers' sizes
    print(f"weights' resident growth on load + one step (fresh process, median of {repeats}, interleaved):")
    for lo, hi in ranges:
        fb = _layer_bytes(lo, hi)
        runs: dict[str, list[dict[str, int]]] = {label: [] for label, _ in labels}
        for _ in range(repeats):
            for label, root in labels:
                runs[label].append(probe(lo, hi, root))
        for label, _ in labels:
            anon = statistics.median(r["RssAnon"] for r in runs[label])
            file_ = statistics.median(r["RssFile"] for r in runs[label])
            print(f"  layers {lo}-{hi} ({_mib(fb)} in file) {label:22s} anon {_mib(anon)} ({anon / fb:.2f}x) "
                  f"+ file {_mib(file_)} = {(anon + file_) / fb:.2f}x the file's bytes")


if __name__ == "__main__":
    main()
