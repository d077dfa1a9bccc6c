"""Where one layer's decode time goes in the engine: each matrix of one layer of a GGUF (default: the
TinyLlama-1.1B-shape Q4_K file of ``bench/model_decode.py --vs-llama-cpp --tinyllama``), one row, one
thread, cache-warm, every variant interleaved in one run, ms medians:

* ``linear``: the engine's matmul as it ships (:meth:`ethen.model.engine.GraphBuilder.linear`);
* ``nbits``: its ``MatMulNBits`` alone (the weights' 4/8-bit blocks, no min term);
* ``mins``: the K-quants' min term alone as it ships (a 4-bit ``MatMulNBits`` over ``[xsum, 16 xsum]``,
  :func:`ethen.model.quant.k_mins`);
* ``mins (old)``: the min term as it was before (a float ``MatMul`` over ``Cast(m) * Cast(dmin)``, the
  ``[K / 32, R]`` float32 matrix rebuilt on every call);
* ``exact-int8``: the matmul at exact-int8 (what ``--accuracy auto`` runs for 8-bit blocks; float32-grade
  from the int8-activation kernel: :meth:`ethen.model.engine.GraphBuilder.split3`); max error over
  ``max |y|`` against a float64 product is printed next to the float32 and int8 kernels'.

.venv/bin/python bench/quant_profile.py [--model X.gguf] [--layer 0] [--repeats 30]
.venv/bin/python bench/quant_profile.py --stack [--accuracy fast|exact]
.venv/bin/python bench/quant_profile.py --zero-points [--model X.gguf] [--repeats 15]

``--zero-points``: a 4-bit ``MatMulNBits`` with a zero-point input (all 0, as Q4_1 had) against none (the
default, 8; what Q4_1 packs as since 2026-12-07, :func:`ethen.model.quant._q4_1_shifted_mins`), the model's
four matrix shapes with random blocks, 30 copies of each cycled per timing (the model's layers streamed
as in decode, not one matrix warm in cache), 1 row, 1 thread, interleaved, microseconds per matmul.

``--stack``: all layers of the model, one thread, decode tok/s of 16 steps in a fresh process without and
then in one after a 512-row prefill. It uses only APIs an older tree has too, so the same script measures
another commit: ``git archive REV | tar -x -C /tmp/ref`` then ``PYTHONPATH=/tmp/ref`` (check the printed
``ethen`` path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ethen.model import open_weight_store
from ethen.model.engine import ACCURACY_EXACT, ACCURACY_EXACT_INT8, ACCURACY_FAST, Engine, GraphBuilder
from ethen.model.qmodel import _packed_rows, _Tensors
from ethen.model.quant import NBits


def _nbits(g: GraphBuilder, x: str, w: NBits, acc: int) -> str:
    ins = [x, g.const(w.data), g.const(w.scales)] + ([g.const(w.zero_points)] if w.zero_points is not None
                                                     else [])
    return g.op("MatMulNBits", ins, domain="com.microsoft", K=w.cols, N=w.rows, bits=w.bits,
                block_size=w.block, accuracy_level=acc)


def _old_mins(g: GraphBuilder, x: str, w: NBits) -> str:
    """The min term before: float MatMul over Cast(m) * Cast(dmin) built per call."""
    assert w.mins is not None
    nsb, nb = w.cols // 256, w.cols // 32
    q = w.mins.data.reshape(w.rows, nsb, 8)  # [R, nsb, 8] bytes of 16 nibbles: [m & 15, m >> 4] (k_mins)
    vals = np.stack([q & 15, q >> 4], axis=-1).reshape(w.rows, nsb, 16)
    m = (vals[..., :8] + 16 * vals[..., 8:]).astype(np.uint8)  # [R, nsb, 8] the file's 6-bit m
    m_t = np.ascontiguousarray(m.transpose(1, 2, 0))  # [nsb, 8, R]
    dmin_t = np.ascontiguousarray((-w.mins.scales).reshape(w.rows, nsb).T[:, None, :].astype(np.float16))
    blocks = g.op("Reshape", [x, g.const(np.array([-1, nb, 32], np.int64), "shape", False)])
    xsum = g.op("ReduceSum", [blocks, g.const(np.array([2], np.int64), "ax", False)], keepdims=0)
    mm = g.op("Cast", [g.const(m_t)], to=1)
    dm = g.op("Cast", [g.const(dmin_t)], to=1)
    neg = g.op("Neg", [g.op("Mul", [mm, dm])])
    mins = g.op("Reshape", [neg, g.const(np.array([nb, w.rows], np.int64), "shape", False)])
    return g.op("MatMul", [xsum, mins])


def _new_mins(g: GraphBuilder, x: str, w: NBits) -> str:
    assert w.mins is not None
    nsb = w.cols // 256
    sub = g.op("Reshape", [x, g.const(np.array([-1, nsb, 8, 32], np.int64), "shape", False)])
    xsum = g.op("ReduceSum", [sub, g.const(np.array([3], np.int64), "ax", False)], keepdims=0)
    x16 = g.op("Mul", [xsum, g.const(np.array(16, np.float32), "c", False)])
    xm = g.op("Reshape", [g.op("Concat", [xsum, x16], axis=2),
                          g.const(np.array([-1, 16 * nsb], np.int64), "shape", False)])
    return _nbits(g, xm, w.mins, ACCURACY_EXACT)


def _session(w: NBits, build: Any, acc: int) -> Any:
    g = GraphBuilder("profile")
    x = g.input("x", w.cols)
    g.node("Identity", [build(g, x)], ["y"])
    g.output("y", w.rows)
    return Engine("cpu", 1, acc).session(g)


_STACK = """
import sys, time
import numpy as np
from pathlib import Path
import ethen
from ethen.model import open_weight_store
from ethen.model.engine import Engine
from ethen.model.model import LayerStack
from ethen.model.qmodel import load_quant_layers
path, acc, pre = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
store = open_weight_store(path)
n = store.config.n_layers
stack = LayerStack(store.config, load_quant_layers([(0, n - 1)], store, Engine("cpu", 1, acc))[0])
x = np.random.default_rng(0).standard_normal((512, store.config.d_model)).astype(np.float32)
if pre:
    stack.forward(x, np.arange(512), stack.new_kv_cache())
kv = stack.new_kv_cache()
stack.forward(x[:16], np.arange(16), kv)
t0 = time.perf_counter()
for i in range(16):
    stack.forward(x[16 + i:17 + i], np.array([16 + i]), kv)
print(16 / (time.perf_counter() - t0), ethen.__file__)
"""


def _stack(model: Path, accuracy: str, repeats: int) -> None:
    import subprocess
    import sys

    acc = ACCURACY_EXACT if accuracy == "exact" else ACCURACY_FAST
    rates: dict[str, list[float]] = {"no prefill": [], "after a 512-row prefill": []}
    where = ""
    for _ in range(repeats):
        for i, k in enumerate(rates):
            out = subprocess.run([sys.executable, "-c", _STACK, str(model), str(acc), str(i)], check=True,
                                 capture_output=True, text=True, cwd="/").stdout.split()  # PYTHONPATH's ethen
            rates[k].append(float(out[0]))
            where = out[1]
    print(f"{model.name}, all layers, {accuracy}, 1 thread, decode tok/s (16 steps, fresh processes, "
          f"medians of {repeats}); ethen from {where}")
    for k, v in rates.items():
        print(f"  {k}: {statistics.median(v):.1f} (runs {' '.join(f'{r:.1f}' for r in v)})")


def _zero_points(model: Path, repeats: int) -> None:
    cfg = open_weight_store(model).config
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.d_ff
    shapes = {"qkv": (cfg.q_dim + 2 * kv, d), "o": (d, cfg.q_dim), "gate|up": (2 * ff, d), "down": (d, ff)}
    rng, copies = np.random.default_rng(0), 30
    print(f"{model.name}: 4-bit MatMulNBits, block 32, 1 row, 1 thread, {copies} copies cycled, us, medians "
          f"of {repeats}")
    total = {True: 0.0, False: 0.0}
    for name, (rows, cols) in shapes.items():
        sess: dict[bool, list[Any]] = {True: [], False: []}
        nb = cols // 32
        for _ in range(copies):
            data = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
            scales = rng.random(rows * nb).astype(np.float32) * 0.01
            zeros = np.zeros(rows * ((nb + 1) // 2), np.uint8)
            for with_zp in (True, False):
                w = NBits(rows, cols, 4, 32, data, scales, zeros if with_zp else None)
                sess[with_zp].append(_session(w, lambda g, x, w=w: _nbits(g, x, w, ACCURACY_EXACT),
                                              ACCURACY_EXACT))
        x = rng.standard_normal((1, cols)).astype(np.float32)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for with_zp, ss in sess.items():
                t0 = time.perf_counter()
                for s in ss:
                    s.run(None, {"x": x})
                times[with_zp].append((time.perf_counter() - t0) / copies * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in total:
            total[k] += med[k]
        print(f"  {name:8} [{rows}, {cols}]: zero points {med[True]:7.1f}, none {med[False]:7.1f}  "
              f"({med[True] / med[False]:.2f}x)")
    print(f"  a layer's four: {total[True]:.0f} against {total[False]:.0f} "
          f"({total[False] / total[True]:.2f}x the time)")


def main() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path,
                    default=Path.home() / ".cache" / "ethen-bench" / "tinyllama-shape-Q4_K.gguf")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--stack", action="store_true", help="whole-model decode, without / after a prefill")
    ap.add_argument("--accuracy", choices=("fast", "exact"), default="fast")
    ap.add_argument("--zero-points", action="store_true",
                    help="4-bit MatMulNBits with a zero-point input (all 0) against none, the model's shapes")
    args = ap.parse_args()
    load0 = os.getloadavg()
    if args.zero_points:
        _zero_points(args.model, min(args.repeats, 15))
        print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        return
    if args.stack:
        _stack(args.model, args.accuracy, min(args.repeats, 3))
        print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        return
    tensors = _Tensors(open_weight_store(args.model))
    p = f"blk.{args.layer}."
    groups = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"], "gate|up": ["ffn_gate", "ffn_up"],
              "down": ["ffn_down"]}
    rng = np.random.default_rng(0)
    print(f"{args.model.name}, layer {args.layer}, 1 row, 1 thread, ms, medians of {args.repeats}")
    for acc, acc_name in ((ACCURACY_EXACT, "float32 compute (exact)"), (ACCURACY_FAST, "int8 activations")):
        print(acc_name)
        for name, parts in groups.items():
            names = [p + t + ".weight" for t in parts]
            w = _packed_rows(tensors, names, [None] * len(names))[0]
            if not isinstance(w, NBits):
                continue
            v: dict[str, Any] = {"linear": lambda g, x, w=w, a=acc: g.linear(x, w, a),
                                 "nbits": lambda g, x, w=w, a=acc: _nbits(g, x, w, a)}
            if w.mins is not None:
                v["mins"] = lambda g, x, w=w: _new_mins(g, x, w)
                v["mins (old)"] = lambda g, x, w=w: _old_mins(g, x, w)
            if acc == ACCURACY_EXACT:
                v["exact-int8"] = lambda g, x, w=w: g.linear(x, w, ACCURACY_EXACT_INT8)
            sess = {k: _session(w, b, ACCURACY_EXACT_INT8 if k == "exact-int8" else acc)
                    for k, b in v.items()}
            x = rng.standard_normal((1, w.cols)).astype(np.float32)
            times: dict[str, list[float]] = {k: [] for k in sess}
            for s in sess.values():
                s.run(None, {"x": x})
            for _ in range(args.repeats):
                for k, s in sess.items():
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    times[k].append(time.perf_counter() - t0)
            line = "  ".join(f"{k} {statistics.median(t) * 1e3:.3f}" for k, t in times.items())
            print(f"  {name:8} [{w.rows} x {w.cols}] {line}")
            if "exact-int8" in sess:
                w64 = np.concatenate([np.asarray(dequantize(np.asarray(tensors.get(n)[1]),
                                                            GGMLQuantizationType[tensors.get(n)[0]]),
                                                 np.float64).reshape(-1, w.cols) for n in names])
                ref = x.astype(np.float64) @ w64.T
                errs = {k: float(np.abs(sess[k].run(None, {"x": x})[0] - ref).max() / np.abs(ref).max())
                        for k in ("linear", "exact-int8")}
                fast = _session(w, lambda g, x, w=w: g.linear(x, w, ACCURACY_FAST), ACCURACY_FAST)
                errs["int8 activations"] = float(np.abs(fast.run(None, {"x": x})[0] - ref).max()
                                                 / np.abs(ref).max())
                print("           max error / max |y| vs float64: "
                      + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
