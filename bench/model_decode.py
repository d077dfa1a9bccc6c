"""Single-process SmolLM2 (ethen.model): load time, prefill and decode speed, batched-decode scaling.

.venv/bin/python bench/model_decode.py [--steps 32] [--repeats 5] [--skip-cold]

Figures are medians over ``--repeats`` runs; the batched aggregate is reported next to the one-session
baseline measured in the same run (ratio). Per-CPU-second rates are printed too: with one BLAS thread they
are steady when other processes compete for the cores, where wall-clock rates are not. BLAS threads follow
the environment (e.g. ``OPENBLAS_NUM_THREADS=1``); on a shared 2-core machine one thread per process gives
the steadiest decode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from ethen.model import Model, load_model, open_weight_store

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm. " * 4}]


def _cold_load_s() -> float:
    with tempfile.TemporaryDirectory(prefix="ethen-cold-") as tmp:
        t0 = time.perf_counter()
        load_model(open_weight_store(cache_root=tmp))
        return time.perf_counter() - t0


def _warm_load_s() -> tuple[float, float]:
    t0 = time.perf_counter()
    m = load_model()
    t1 = time.perf_counter()
    m.logits([1, 2, 3], m.new_kv_cache())  # first touch of every mmap'd weight page
    return t1 - t0, time.perf_counter() - t0


def _prefill_tok_s(m: Model, ids: list[int]) -> float:
    kv = m.new_kv_cache()
    t0 = time.perf_counter()
    m.logits(ids, kv)
    return len(ids) / (time.perf_counter() - t0)


def _decode_tok_s(m: Model, ids: list[int], sessions: int, steps: int) -> tuple[float, float]:
    """Aggregate tokens/s of ``sessions`` concurrent greedy sessions decoded as one batch per step:
    (per wall-clock second, per CPU second of this process)."""
    kvs = [m.new_kv_cache() for _ in range(sessions)]
    nxt = [int(np.argmax(m.logits(ids, kv))) for kv in kvs]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        logits = m.logits_batch(nxt, kvs)
        nxt = [int(t) for t in np.argmax(logits, axis=1)]
    n = sessions * steps
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def _median2(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cold", action="store_true", help="skip the cold (cache-building) load")
    args = ap.parse_args()
    print(f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    if not args.skip_cold:
        print(f"cold load (parse GGUF + dequantize + write cache + load): {_cold_load_s():.2f} s")
    warm = [_warm_load_s() for _ in range(3)]
    print(f"warm load (mmap cache): {statistics.median([w[0] for w in warm]):.3f} s;"
          f" to first logits: {statistics.median([w[1] for w in warm]):.3f} s")
    m = load_model()
    ids = m.tokenizer.encode(m.chat_template.render(PROMPT))
    prefill = statistics.median(_prefill_tok_s(m, ids) for _ in range(args.repeats))
    print(f"prefill ({len(ids)} tokens): {prefill:.0f} tok/s")
    print(f"load average now: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (high: wall figures suffer)")
    base, base_cpu = _median2([_decode_tok_s(m, ids, 1, args.steps) for _ in range(args.repeats)])
    print(f"decode, 1 session (baseline): {base:.1f} tok/s wall ({1000 / base:.1f} ms/token); "
          f"{base_cpu:.1f} tok per CPU-s")
    for b in (4, 8):
        agg, agg_cpu = _median2([_decode_tok_s(m, ids, b, args.steps) for _ in range(args.repeats)])
        print(f"decode, {b} sessions batched: {agg:.1f} tok/s wall aggregate = {agg / base:.2f}x baseline; "
              f"{agg_cpu:.1f} tok per CPU-s = {agg_cpu / base_cpu:.2f}x")


if __name__ == "__main__":
    main()
