"""Single-process ethen.model: load time, prefill (the chat prompt and 512 tokens) and decode speed,
batched-decode scaling (2, 4, 8 sessions; SmolLM2), and prefill / decode tokens/s per architecture and tensor
type on tiny random-weight GGUFs (``ethen.model.tiny_gguf``: llama and qwen2, d_model 256, 4 layers), next to
transformers' GGUF loader in the same run when the parity extra is installed.

.venv/bin/python bench/model_decode.py [--steps 32] [--repeats 5] [--skip-cold] [--skip-tiny] [--model X.gguf]
.venv/bin/python bench/model_decode.py --vs-llama-cpp [--model X.gguf]   (quantized engine vs llama.cpp)
.venv/bin/python bench/model_decode.py --answers [--model X.gguf]   (greedy answers: llama.cpp, each accuracy)
.venv/bin/python bench/model_decode.py --vs-llama-cpp --tinyllama [--types Q4_K_M] [--repeats 3] [--ref REV]
    [--modes exact-int8,'exact-int8 + float32 prefill'] [--modes auto,ggml,ggml-native]
    (TinyLlama-1.1B shape, llama.cpp's Q4_K_M and Q8_0; ``--ref``: the same Ethen runs of commit REV,
    interleaved)
OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/model_decode.py --head [--repeats 21]   (the logits head alone)
.venv/bin/python bench/model_decode.py --devices [--model X.gguf] [--repeats 3]   (per device: the onnx
    engine's cpu, cuda; the ggml engine's direct CPU engine and each device of the installed libggml's
    backends, its CPU backend's device included)

``--head`` times the orchestrator's head alone (final RMSNorm + the vocabulary matmul) for 1/2/4/8 rows,
one thread, interleaved in one run: the numba block kernel (:mod:`ethen.model.qhead`, the default) against
the engine graph it replaces (``MatMulNBits`` over nibble halves); the kernel split over 2 threads
(``SplitHead``, the orchestrator's default) too. On the model's own head (SmolLM2: tied Q8_0; the Q4_0 /
Q4_1 / Q6_K kernels were removed, slower). Then the kernels' first-call cost in fresh processes (numba
import + cache load, and a compile with an empty cache).

``--vs-llama-cpp`` builds ``llama-cpp-python`` into ``~/.cache/ethen-bench/llama-venv`` on first use (a
source build, ~7-25 minutes, cached; ``CMAKE_BUILD_PARALLEL_LEVEL=1``) and prints, in one run, decode and
512-token prefill tok/s of Ethen's quantized layers (``ethen.model.qmodel``, int8 activations, exact and
exact-int8)
and llama.cpp on the same GGUF at 1 and 2 threads.

The tensor type changes the file and the cold load (dequantization), not the decode step: the cache is
float32 whatever the file holds, so per-type decode rates should agree within noise.

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
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ethen.model import Model, find_gguf_path, load_model, open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf

TINY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm. " * 4}]
LONG_PREFILL = 512  # tokens of the long-prefill figure (the prompt's tokens repeated)


def _cold_load_s(model: Path | None) -> float:
    with tempfile.TemporaryDirectory(prefix="ethen-cold-") as tmp:
        t0 = time.perf_counter()
        load_model(open_weight_store(model, cache_root=tmp))
        return time.perf_counter() - t0


def _warm_load_s(model: Path | None) -> tuple[float, float]:
    t0 = time.perf_counter()
    m = load_model(open_weight_store(model))
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


def _tiny_rows(steps: int, repeats: int) -> list[tuple[str, str, float, float, float, Path]]:
    """(arch, type, cold load s, prefill tok/s, decode tok/s, path) of each tiny model."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ethen-tiny-") as tmp:
        for arch in ("llama", "qwen2"):
            for kind in TINY_TYPES:
                spec = TinySpec(arch=arch, types=(kind,), embd_type=kind, n_layers=4, context_length=512,
                                output_type=None if arch == "llama" else kind)
                path = write_tiny_gguf(Path(tmp) / f"{arch}-{kind}.gguf", spec)
                t0 = time.perf_counter()
                m = load_model(open_weight_store(path, cache_root=Path(tmp) / "cache"))
                cold = time.perf_counter() - t0
                ids = m.tokenizer.encode(m.chat_template.render(PROMPT))
                pre = statistics.median(_prefill_tok_s(m, ids) for _ in range(repeats))
                dec = statistics.median(_decode_tok_s(m, ids, 1, steps)[0] for _ in range(repeats))
                rows.append((arch, kind, cold, pre, dec, path))
        hf_rows = _hf_rows(rows, steps, repeats)
    print(f"tiny models (d_model 256, 4 layers, {len(ids)}-token prompt), median of {repeats}:")
    print(f"  {'arch':6} {'type':5} {'cold load':>9} {'prefill tok/s':>14} {'decode tok/s':>13}"
          + ("  transformers: prefill / decode tok/s" if hf_rows else ""))
    hfs: list[tuple[float, float] | None] = list(hf_rows) if hf_rows else [None] * len(rows)
    for (arch, kind, cold, pre, dec, _), hf in zip(rows, hfs, strict=True):
        extra = f"  {hf[0]:>8.0f} / {hf[1]:.0f}" if hf else ""
        print(f"  {arch:6} {kind:5} {cold:8.2f}s {pre:14.0f} {dec:13.1f}{extra}")
    return rows


def _hf_rows(rows: list[Any], steps: int, repeats: int) -> list[tuple[float, float]] | None:
    """transformers' prefill / decode tok/s on the same files (None without the parity extra)."""
    try:
        import torch
        import transformers
    except ImportError:
        print("transformers: parity extra not installed (pip install -e '.[parity]' torch==2.13.0): skipped")
        return None
    out = []
    for *_, path in rows:
        try:
            out.append(_hf_speed(transformers, torch, path, steps, repeats))
        except Exception as exc:  # a type transformers cannot load: say so, keep the row
            print(f"transformers cannot run {path.name}: {type(exc).__name__}: {exc}")
            out.append((float("nan"), float("nan")))
    return out


def _hf_speed(transformers: Any, torch: Any, path: Path, steps: int, repeats: int) -> tuple[float, float]:
    torch.set_num_threads(int(os.environ.get("OPENBLAS_NUM_THREADS", "1") or 1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 3 + len(PROMPT[0]["content"]) // 4))])
    pre, dec = [], []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf(ids, use_cache=True)
            pre.append(ids.shape[1] / (time.perf_counter() - t0))
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = hf(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            dec.append(steps / (time.perf_counter() - t0))
    return statistics.median(pre), statistics.median(dec)


def _median2(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


LLAMA_VENV = Path.home() / ".cache" / "ethen-bench" / "llama-venv"
_LLAMA_PROBE = """
import sys, time, llama_cpp
path, threads, steps, n_pre = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                      n_batch=512, verbose=False)
ids = [(7 * i) % min(1000, llm.n_vocab() - 100) + 100 for i in range(n_pre)]  # (tiny vocabularies)
t0 = time.perf_counter(); llm.eval(ids); pre = n_pre / (time.perf_counter() - t0)
llm.reset(); llm.eval(ids[:16])
t0 = time.perf_counter()
for i in range(steps):
    llm.eval([ids[i]])
print(pre, steps / (time.perf_counter() - t0))
"""


def _llama_python() -> Path:
    """The llama-cpp-python venv's interpreter, built on first use (a source build, cached)."""
    import subprocess
    import sys

    py = LLAMA_VENV / "bin" / "python"
    if not py.exists():
        print(f"building llama-cpp-python into {LLAMA_VENV} (one time, several minutes)...")
        subprocess.run([sys.executable, "-m", "venv", str(LLAMA_VENV)], check=True)
        subprocess.run([str(LLAMA_VENV / "bin" / "pip"), "install", "llama-cpp-python"], check=True,
                       env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "1"})
    return py


def _llama_cpp(path: Path, threads: int, steps: int) -> tuple[float, float]:
    import subprocess

    argv = [str(_llama_python()), "-c", _LLAMA_PROBE, str(path), str(threads), str(steps), str(LONG_PREFILL)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _ethen_quant(path: Path, threads: int, steps: int, accuracy: int, device: str = "cpu",
                 long_prefill: str = "0", prepack: str = "1", pool: str = "") -> tuple[float, ...]:
    """(prefill tok/s, decode tok/s, packed layer bytes, the layers' bytes in the file, RssAnon growth of
    this process over the load and the runs, the KV cache's bytes, RssAnon growth at load, the resident
    pages of the engine layout's files after the runs, the GGUF's resident pages after the runs (held by
    Q8_0 kernel layers of an older --ref tree, if any), the bytes those layers hold (their quants and
    scales)). ``long_prefill`` "1": the engine's
    ``long_prefill`` (float32 prefill). ``prepack`` "0": onnxruntime prepacks nothing
    (``session.disable_prepacking``) and only the load is measured (no runs): the twin
    :func:`_weights_resident` subtracts. ``pool``: the engine's ``pool`` (``shared``: ``ethen worker``'s
    default; empty: the engine's default)."""
    from ethen.model.attend import warm
    from ethen.model.engine import Engine
    from ethen.model.heap import mapped_rss
    from ethen.model.model import LayerStack
    from ethen.model.qmodel import QuantLayer, load_quant_layers

    store = open_weight_store(path)
    if accuracy in (GGML, GGML_NATIVE):
        return _ethen_ggml(store, path, threads, steps, accuracy == GGML_NATIVE, device)
    import onnxruntime  # (its library's own memory is not the weights')

    onnxruntime.InferenceSession  # noqa: B018
    anon0 = _rss_anon()
    warm()  # numba's runtime now, not on the load's background thread: in both runs' "loaded" alike
    # (keywords only when asked: a --ref tree's Engine may not take them)
    extra: dict[str, Any] = {"long_prefill": True} if long_prefill == "1" else {}
    if pool:
        extra["pool"] = pool
    engine = Engine(device, threads, accuracy, **extra)
    if prepack == "0":
        options = engine.session_options

        def no_prepacking(graphs: Any) -> Any:
            so = options(graphs)
            so.add_session_config_entry("session.disable_prepacking", "1")
            return so

        engine.session_options = no_prepacking  # type: ignore[method-assign]
    stack = LayerStack(store.config, load_quant_layers([(0, store.config.n_layers - 1)], store, engine)[0])
    layers = [w for w in stack.layers if isinstance(w, QuantLayer)]
    loaded = _rss_anon() - anon0
    packed, file = sum(w.nbytes for w in layers), sum(w.file_nbytes for w in layers)
    held = 0
    for w in layers:
        kernel = getattr(w, "kernel", None)  # (a --ref tree's layers may have none)
        held += kernel.nbytes if kernel is not None else 0
    if prepack == "0":
        return 0.0, 0.0, packed, file, loaded, 0, loaded, mapped_rss(store.directory / "engine"), 0, held
    x = np.random.default_rng(0).standard_normal((LONG_PREFILL, store.config.d_model)).astype(np.float32)
    kv = stack.new_kv_cache()
    t0 = time.perf_counter()
    stack.forward(x, np.arange(LONG_PREFILL), kv)
    pre = LONG_PREFILL / (time.perf_counter() - t0)
    kv = stack.new_kv_cache()
    stack.forward(x[:16], np.arange(16), kv)
    t0 = time.perf_counter()
    for i in range(steps):
        stack.forward(x[16 + i:17 + i], np.array([16 + i]), kv)
    dec = steps / (time.perf_counter() - t0)
    grown = _rss_anon() - anon0
    return (pre, dec, packed, file, grown, kv.nbytes, loaded, mapped_rss(store.directory / "engine"),
            mapped_rss(path) if held else 0, held)



#: the ``accuracy`` argument of :func:`_ethen_quant` that runs the ggml engine (ethen.model.glayer)
GGML = -1
#: the ggml engine on the libggml llama-cpp-python built for this CPU in the bench's llama venv (AVX-512 /
#: VNNI where the CPU has them) instead of the wheel's AVX2 build: what only a native build closes
GGML_NATIVE = -2


def _native_ggml_dir() -> Path:
    return next(LLAMA_VENV.glob("lib/python3*/site-packages/llama_cpp/lib"))


def _timed(stack: Any, d_model: int, steps: int) -> tuple[float, float, int]:
    """(512-row prefill tok/s, decode tok/s, the KV cache's bytes) of ``stack``."""
    x = np.random.default_rng(0).standard_normal((LONG_PREFILL, d_model)).astype(np.float32)
    kv = stack.new_kv_cache()
    t0 = time.perf_counter()
    stack.forward(x, np.arange(LONG_PREFILL), kv)
    pre = LONG_PREFILL / (time.perf_counter() - t0)
    kv = stack.new_kv_cache()
    stack.forward(x[:16], np.arange(16), kv)
    t0 = time.perf_counter()
    for i in range(steps):
        stack.forward(x[16 + i:17 + i], np.array([16 + i]), kv)
    return pre, steps / (time.perf_counter() - t0), kv.nbytes


#: the ``device`` of :func:`_ethen_quant` for the ggml engine on a device of ggml's backend registry
#: (``ggml:CPU``, ``ggml:CUDA0``: :class:`ethen.model.gbackend.BackendEngine`), not the direct CPU engine
GGML_DEVICE = "ggml:"


def _ethen_ggml(store: Any, path: Path, threads: int, steps: int, native: bool = False,
                device: str = "cpu") -> tuple[float, ...]:
    """:func:`_ethen_quant`'s figures for the ggml engine: the layers' weights are the GGUF's own pages (the
    9th figure: the GGUF's resident pages after the runs) and the repacked Q4_0 / Q4_K matrices (in the
    anonymous growth at load). ``native``: on the llama venv's libggml (:data:`GGML_NATIVE`); ``device``
    ``ggml:NAME``: on ggml's device NAME through the backend API (:data:`GGML_DEVICE`)."""
    from ethen.model import ggml_lib
    from ethen.model.attend import warm
    from ethen.model.glayer import GgmlEngine, load_ggml_layers
    from ethen.model.heap import mapped_rss
    from ethen.model.model import LayerStack

    if native:
        native_dir = _native_ggml_dir()
        ggml_lib.library_dir = lambda: native_dir  # (before the first lib())

    if device.startswith(GGML_DEVICE):
        from ethen.model.gbackend import BackendEngine

        engine: GgmlEngine = BackendEngine(device.removeprefix(GGML_DEVICE), threads)
    else:
        engine = GgmlEngine(threads)
    warm()
    anon0 = _rss_anon()
    stack = LayerStack(store.config, load_ggml_layers([(0, store.config.n_layers - 1)], store, engine)[0])
    loaded = _rss_anon() - anon0
    file = sum(w.file_nbytes for w in stack.layers)
    pre, dec, kvb = _timed(stack, store.config.d_model, steps)
    grown = _rss_anon() - anon0
    return pre, dec, file, file, grown, kvb, loaded, 0, mapped_rss(path), 0


TINYLLAMA_TYPES = ("Q4_K_M", "Q8_0")


_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def tinyllama_gguf(kind: str) -> Path:
    """A random-weight llama of TinyLlama-1.1B's shape (22 layers, d_model 2048, FFN 5632, 32 heads / 4 KV
    heads; the tiny generator's 327-token vocabulary) in ``kind``, written once next to the llama.cpp venv
    (``ethen.model.tiny_gguf``; several minutes, cached). ``Q4_K_M`` is llama.cpp's own quantizer's mix
    (Q4_K, with Q6_K where it puts it) of the random F16 model, run in the llama venv."""
    path = LLAMA_VENV.parent / f"tinyllama-shape-{kind}.gguf"
    if kind == "Q4_K_M" and not path.is_file():
        f16 = tinyllama_gguf("F16")
        print(f"quantizing {f16} to {path} with llama.cpp (one time)...")
        tmp = path.with_suffix(".part")
        subprocess.run([str(_llama_python()), "-c", _QUANTIZE, str(f16), str(tmp)], check=True,
                       stdout=subprocess.DEVNULL)
        tmp.rename(path)
    if not path.is_file():
        print(f"writing {path} (one time, several minutes)...")
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = TinySpec(types=(kind,), embd_type=kind, n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4,
                        d_ff=5632, context_length=2048, name=f"tinyllama-shape-{kind}")
        write_tiny_gguf(path, spec)
    return path


def _rss_anon() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return 0


_ETHEN_PROBE = """
import sys
from pathlib import Path
root = sys.argv[1]
sys.path[:0] = [root, root + "/bench"]
import ethen, model_decode
assert ethen.__file__.startswith(root) and model_decode.__file__.startswith(root), (ethen.__file__, root)
print(*model_decode._ethen_quant(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                                 *sys.argv[6:]))
"""
ROOT = Path(__file__).resolve().parents[1]


def _ethen_run(root: Path, path: Path, threads: int, steps: int, accuracy: int,
               long_prefill: bool = False, pool: str = "", prepack: bool = True,
               env: dict[str, str] | None = None) -> tuple[float, ...]:
    """:func:`_ethen_quant` of the tree at ``root`` (this one or ``--ref``'s) in a fresh process; ``pool``
    ``shared``: the engine's one process-wide thread pool (``ethen worker --thread-pool``; this tree only: an
    argument of the probe); ``prepack`` False: the
    load only, with onnxruntime prepacking nothing (this tree only); ``env``: more variables for it."""
    import subprocess
    import sys

    argv = [sys.executable, "-c", _ETHEN_PROBE, str(root), str(path), str(threads), str(steps), str(accuracy)]
    if not prepack or pool:
        argv += ["cpu", "1" if long_prefill else "0", "1" if prepack else "0", *([pool] if pool else [])]
    elif long_prefill:
        argv += ["cpu", "1"]
    env = {**os.environ} | (env or {})
    if pool:  # as `ethen worker` runs it: NumPy's BLAS on one thread next to the spinning pool (unless set)
        env |= {"OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1")}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout.split()
    return tuple(float(v) for v in out)


def _weights_resident(runs: Sequence[tuple[float, ...]], twin: tuple[float, ...]) -> str:
    """The weights' resident memory of ``runs`` (:func:`_ethen_quant`'s figures), the issue's per-worker
    measure: onnxruntime's prepacked copies (the RssAnon growth at load minus that of ``twin``, the same load
    with prepacking off, so sessions, threads and libraries cancel) plus the engine layout's pages mapped
    after the runs (what kernels read in place); and the rest of the process's growth, the KV cache apart."""
    file = runs[0][3]
    prepacked = statistics.median(r[6] for r in runs) - twin[6]
    mapped = statistics.median(r[7] for r in runs)
    # Q8_0 kernel layers: the GGUF's pages still mapped and their own arrays (anonymous, so in both loads'
    # growth alike: added here, taken out of the rest)
    gguf = statistics.median(r[8] if len(r) > 8 else 0 for r in runs)
    held = statistics.median(r[9] if len(r) > 9 else 0 for r in runs)
    rest = statistics.median(r[4] - r[5] for r in runs) - prepacked - held
    weights = prepacked + mapped + gguf + held
    kernels = (f" + the GGUF's pages mapped {gguf / 2**20:.0f} MiB + kernel layers' arrays "
               f"{held / 2**20:.0f} MiB" if held else "")
    return (f"resident weights {weights / 2**20:.0f} MiB = {weights / file:.3f}x the file (prepacked "
            f"{prepacked / 2**20:.0f} MiB + mapped in place {mapped / 2**20:.0f} MiB{kernels}), other "
            f"anonymous growth {rest / 2**20:.0f} MiB = {rest / file:.2f}x")


def _ggml_resident(runs: Sequence[tuple[float, ...]]) -> str:
    """The ggml engine's resident weights: the GGUF's pages resident after the runs (every layer matrix is
    read in place) plus the anonymous growth at load (tensor metadata, the norms' float32 copies)."""
    file = runs[0][3]
    gguf = statistics.median(r[8] for r in runs)
    loaded = statistics.median(r[6] for r in runs)
    weights = gguf + loaded
    return (f"resident weights {weights / 2**20:.0f} MiB = {weights / file:.3f}x the file (the GGUF's pages "
            f"{gguf / 2**20:.0f} MiB + anonymous at load {loaded / 2**20:.1f} MiB)")


def devices(model: Path | None, steps: int, repeats: int) -> None:
    """Per-device decode and prefill (``ethen worker --device``), same run: the onnx engine on the CPU (the
    baseline) and CUDA; the ggml engine's direct CPU engine (the ggml rows' baseline) and each device of the
    installed libggml's backends through the backend API (:mod:`ethen.model.gbackend`; the wheel's: its CPU
    backend's device). A device this machine lacks is printed as skipped, with the reason. Each figure is
    a fresh process (layers only, 1 thread), medians of ``repeats``."""
    import sys

    from ethen.model.engine import ACCURACY_AUTO, DEVICES, Engine, EngineError
    from ethen.model.gbackend import devices as ggml_devices
    from ethen.model.ggml_lib import backends

    path = model or find_gguf_path()
    load0 = os.getloadavg()
    print(f"model: {path.name}; {LONG_PREFILL}-token prefill, {steps} decode steps, medians of {repeats}, "
          "layers only, 1 thread")

    def row(label: str, accuracy: int, device: str, base: tuple[float, float] | None,
            of: str) -> tuple[float, float]:
        argv = [sys.executable, "-c", _ETHEN_PROBE, str(ROOT), str(path), "1", str(steps), str(accuracy),
                device]
        runs = [tuple(float(v) for v in subprocess.run(argv, check=True, capture_output=True,
                                                        text=True).stdout.split()) for _ in range(repeats)]
        pre, dec = (statistics.median(r[i] for r in runs) for i in (0, 1))
        vs = "" if base is None else f" ({pre / base[0]:.2f}x / {dec / base[1]:.2f}x {of})"
        print(f"  {label}: prefill {pre:.0f} tok/s, decode {dec:.1f} tok/s{vs}; runs "
              f"{' '.join(f'{r[1]:.1f}' for r in runs)}")
        return pre, dec

    base: tuple[float, float] | None = None
    for device in (d for d in DEVICES if d != "auto"):
        try:
            Engine(device, 1, ACCURACY_AUTO)
        except EngineError as exc:
            print(f"  onnx {device}: skipped: {exc}")
            continue
        fig = row(f"onnx {device} (--accuracy auto)", ACCURACY_AUTO, device, base, "the CPU's")
        base = base or fig
    ggml = row("ggml cpu (the direct CPU engine)", GGML, "cpu", None, "")
    for dev in ggml_devices():
        row(f"ggml device {dev.name} ({dev.kind}: {dev.description}; backend API)", GGML,
            GGML_DEVICE + dev.name, ggml, "the direct CPU engine's")
    for name in ("cuda", "vulkan", "metal"):
        if name not in backends():
            print(f"  ggml {name}: skipped: no libggml-{name}.so (the libggml-python wheel is a CPU build)")
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load0)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


def vs_llama_cpp(model: Path | None, steps: int, repeats: int, ref: tuple[str, Path] | None,
                 modes: Sequence[str] = ()) -> None:
    """Layers only on Ethen's side (the head stays the orchestrator's); llama.cpp runs the whole model. Each
    Ethen figure is a fresh process (its RssAnon growth is that process's load + runs); with ``ref``, the
    same runs of that commit's tree, interleaved; medians of ``repeats``."""
    from ethen.model.engine import ACCURACY_AUTO, ACCURACY_EXACT, ACCURACY_EXACT_INT8, ACCURACY_FAST

    path = model or find_gguf_path()
    roots = {"": ROOT} | ({f" @{ref[0]}": ref[1]} if ref else {})
    load0 = os.getloadavg()
    print(f"model: {path.name}; {LONG_PREFILL}-token prefill, {steps} decode steps, medians of {repeats}")
    for threads in (1, 2):
        llama: list[tuple[float, float]] = []
        runs: dict[str, list[tuple[float, ...]]] = {}
        twins: dict[str, tuple[float, ...]] = {}
        for _ in range(repeats):
            llama.append(_llama_cpp(path, threads, steps))
            pre = "exact-int8 + float32 prefill"
            for name, acc, long, env in (("auto", ACCURACY_AUTO, True, {}),
                                         ("int8-act", ACCURACY_FAST, False, {}),
                                         ("exact", ACCURACY_EXACT, False, {}),
                                         ("exact-int8", ACCURACY_EXACT_INT8, False, {}),
                                         (pre, ACCURACY_EXACT_INT8, True, {}),
                                         ("ggml", GGML, False, {}),
                                         ("ggml-native", GGML_NATIVE, False, {})):
                if modes and name not in modes:
                    continue
                # with threads to share: also on one process-wide pool (--thread-pool shared, `ethen
                # worker`'s default), this tree only
                for pool in ("", "shared") if threads > 1 else ("",):
                    for tag, root in roots.items():
                        if acc in (GGML, GGML_NATIVE) and pool:
                            continue  # (ggml: its own pool, the same either way)
                        if tag and (acc in (ACCURACY_EXACT_INT8, GGML, GGML_NATIVE) or pool or env):
                            continue  # (modes the --ref tree may not have)
                        label = name + (" + shared pool" if pool else "") + tag
                        runs.setdefault(label, []).append(_ethen_run(root, path, threads, steps, acc, long,
                                                                     pool, env=env))
                        if not tag and label not in twins and acc >= 0:  # its weights' memory (not ggml)
                            twins[label] = _ethen_run(root, path, threads, steps, acc, long, pool, False, env)
        lp, ld = _median2(llama)
        print(f"  llama.cpp {threads} thread(s): prefill {lp:.0f} tok/s, decode {ld:.1f} tok/s")
        for label, rs in runs.items():
            ep, ed, packed, file, grown, kvb = (statistics.median(r[i] for r in rs) for i in range(6))
            vs = ""
            if ref and not label.endswith(f"@{ref[0]}") and f"{label} @{ref[0]}" in runs:
                old = statistics.median(r[1] for r in runs[f"{label} @{ref[0]}"])
                vs = f", {ed / old:.2f}x the ref's decode"
            print(f"  ethen {label} {threads} thread(s): prefill {ep:.0f} tok/s ({ep / lp:.0%}), decode "
                  f"{ed:.1f} tok/s ({ed / ld:.0%}{vs}; runs {' '.join(f'{r[1]:.1f}' for r in rs)}); layer "
                  f"weights {packed / 1e6:.1f} MB = {packed / file:.3f}x the file's {file / 1e6:.1f} MB; "
                  f"RssAnon +{grown / 2**20:.0f} MiB = {(grown - kvb) / file:.2f}x the file + the KV cache's "
                  f"{kvb / 2**20:.0f} MiB (a fresh process: load, 512-row prefill, decode)"
                  + (f"; {_weights_resident(rs, twins[label])}" if label in twins else "")
                  + (f"; {_ggml_resident(rs)}" if label.startswith("ggml") else ""))
    print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load0)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


#: greedy-answer prompts: `ethen up`'s banner prompt first, then the four of docs/model.md's numerics section
ANSWER_PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.",
                  "Write a haiku about autumn.", "Count from 1 to 20.",
                  "Explain what a GPU is in two sentences.")
ANSWER_TOKENS = 64
_ETHEN_GREEDY = """
import json, sys
root = sys.argv[1]
sys.path[:0] = [root]
from pathlib import Path
import ethen
assert ethen.__file__.startswith(root), (ethen.__file__, root)
from ethen.model import SamplingParams, generate_stream, load_model, model_step, open_weight_store
from ethen.model.choose import EngineOptions
from ethen.model.model import engine_for
store = open_weight_store(Path(sys.argv[2]))
options = EngineOptions(accuracy=sys.argv[5])  # --accuracy
m = load_model(store, engine_for(store, threads=1, options=options))  # 1 thread, a pool per session
out = []
for text in json.loads(sys.argv[3]):
    ids = m.tokenizer.encode(m.chat_template.render([{"role": "user", "content": text}],
                                                    add_generation_prompt=True))
    toks = [c.token_id for c in generate_stream(model_step(m), m.tokenizer, ids, SamplingParams(
            temperature=0.0, max_tokens=int(sys.argv[4])), m.config.context_length) if c.token_id is not None]
    out.append({"prompt": ids, "tokens": toks, "text": m.tokenizer.decode(toks)})
print(json.dumps(out))
"""
_LLAMA_GREEDY = """
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=1024, verbose=False)
res = []
for prompt in json.loads(sys.argv[2]):
    out = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if t == llm.token_eos() or len(out) == int(sys.argv[3]):
            break
        out.append(t)
    res.append({"tokens": out, "text": llm.detokenize(out).decode("utf-8", "replace")})
print(json.dumps(res))
"""


def _agree(a: Sequence[int], b: Sequence[int]) -> str:
    """How a greedy token sequence compares with the reference: ``same``, or the first token that differs."""
    if list(a) == list(b):
        return "same"
    return f"#{next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))}"


def greedy_answers(path: Path, modes: Sequence[str] = ("exact", "fast", "auto")) -> None:
    """Greedy answers of llama.cpp and of Ethen under each ``--accuracy`` to :data:`ANSWER_PROMPTS`, all
    from the same prompt tokens (Ethen's tokenizer and chat template), whole models, 1 thread, each against
    Ethen ``exact`` (float32 compute over the file's weights): the speed figures compare arithmetic as well
    as engines, since llama.cpp multiplies int8-quantized activations, as ``fast`` does."""
    import json
    import subprocess
    import sys

    env = dict(os.environ)
    answers: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        argv = [sys.executable, "-c", _ETHEN_GREEDY, str(ROOT), str(path), json.dumps(ANSWER_PROMPTS),
                str(ANSWER_TOKENS), mode]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
        answers[f"ethen {mode}"] = json.loads(out.stdout.splitlines()[-1])
    prompts = [a["prompt"] for a in answers[f"ethen {modes[0]}"]]
    argv = [str(_llama_python()), "-c", _LLAMA_GREEDY, str(path), json.dumps(prompts), str(ANSWER_TOKENS)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    answers["llama.cpp"] = json.loads(out.stdout.splitlines()[-1])
    ref = answers.get("ethen exact", answers[f"ethen {modes[0]}"])
    print(f"greedy answers ({ANSWER_TOKENS} tokens at most, 1 thread, the same prompt tokens), each against "
          "Ethen exact: 'same', or the first token that differs")
    print(f"  {'':17} " + " ".join(f"{p[:14]:>15}" for p in ANSWER_PROMPTS))
    for name, a in answers.items():
        print(f"  {name:17} " + " ".join(f"{_agree(x['tokens'], r['tokens']):>15}" for x, r in zip(a, ref,
                                                                                            strict=True)))
    print(f"  answers to {ANSWER_PROMPTS[0]!r}:")
    for name, a in answers.items():
        print(f"  {name:17} {a[0]['text'][:100]!r}")


_FIRST_CALL = """
import sys, time
t0 = time.perf_counter()
from ethen.model import open_weight_store
from ethen.model.qmodel import QuantEmbedAndHead
import numpy as np
store = open_weight_store(sys.argv[1] or None)
t1 = time.perf_counter()
ends = QuantEmbedAndHead(store)
h = np.ones((7, store.config.d_model), np.float32)
ends.logits(h)  # 4 + 2 + 1 rows: every Q8_0 kernel
print(time.perf_counter() - t1)
"""


def _first_call_s(model: Path | None, cache_dir: str | None) -> float:
    """Building the head + its first call (every row kernel) in a fresh process: numba's import, the JIT
    cache load (or compile with ``cache_dir`` empty)."""
    import subprocess
    import sys

    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(model or "")], capture_output=True,
                         text=True, check=True, env=env)
    return float(out.stdout.split()[-1])


def _engine_head(kind: str, raw: Any, rows: int, cols: int, norm: Any, eps: float) -> Any:
    """The engine graph the kernel replaced (RMSNorm + ``MatMulNBits`` at exact accuracy), as a callable."""
    from ethen.model.engine import ACCURACY_EXACT, Engine, GraphBuilder
    from ethen.model.quant import pack

    g = GraphBuilder("head")
    x = g.input("x", cols)
    g.node("Identity", [g.linear(g.rms_norm(x, norm, eps), pack(kind, raw, rows, cols), ACCURACY_EXACT)],
           ["logits"])
    g.output("logits", rows)
    sess = Engine("cpu", 1, ACCURACY_EXACT).session(g)
    return lambda h: sess.run(None, {"x": h})[0]


def head_bench(model: Path | None, repeats: int) -> None:
    """The head alone, old vs new, 1/2/4/8 rows, interleaved in one run (medians, ratios to the engine)."""
    from ethen.mesh.orchestrator.head import SplitHead
    from ethen.model.qmodel import QuantEmbedAndHead, onnx_engine

    load0 = os.getloadavg()
    print(f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; "
          f"median of {repeats}, variants interleaved; ms per call (all rows)")
    store = open_weight_store(model)
    cfg = store.config
    # accuracy exact: where the kernel runs (the engine would compute in float32)
    kernel = QuantEmbedAndHead(store, onnx_engine(accuracy="exact"))
    assert kernel.block_head is not None, f"the head's type {kernel.head_kind} has no kernel"
    norm, eps = kernel.output_norm, cfg.rms_eps
    t = kernel.block_head
    split = SplitHead(kernel, 2)
    widths: dict[str, int] = {f"{t.kind} (this model, [{t.rows}, {t.cols}])": t.cols}
    heads: dict[str, dict[str, Any]] = {f"{t.kind} (this model, [{t.rows}, {t.cols}])": {
        "engine (old)": _engine_head(t.kind, np.asarray(t.quants).view(np.uint8), t.rows, t.cols, norm, eps),
        "kernel": kernel.logits, "kernel, 2 threads": split}}
    rng = np.random.default_rng(0)
    for name, variants in heads.items():
        print(f"{name}")
        print(f"  {'rows':>4} " + " ".join(f"{v:>18}" for v in variants) + "   kernel / engine")
        for rows in (1, 2, 4, 8):
            h = rng.standard_normal((rows, widths[name])).astype(np.float32)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for fn in variants.values():
                fn(h)  # warm
            for _ in range(repeats):
                for v, fn in variants.items():
                    t0 = time.perf_counter()
                    fn(h)
                    times[v].append(time.perf_counter() - t0)
            med = {v: statistics.median(ts) * 1000 for v, ts in times.items()}
            print(f"  {rows:>4} " + " ".join(f"{med[v]:15.2f} ms" for v in variants)
                  + f"   {med['engine (old)'] / med['kernel']:.2f}x faster")
    split.close()
    with tempfile.TemporaryDirectory(prefix="ethen-numba-") as empty:
        cold = _first_call_s(model, empty)
    warm = statistics.median(_first_call_s(model, None) for _ in range(3))
    print(f"head build + first call in a fresh process: {warm:.2f} s with the kernels cached, "
          f"{cold:.2f} s compiling them (empty NUMBA_CACHE_DIR)")
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cold", action="store_true", help="skip the cold (cache-building) load")
    ap.add_argument("--skip-tiny", action="store_true", help="skip the per-architecture/type tiny models")
    ap.add_argument("--model", type=Path, default=None, help="GGUF to measure (default: SmolLM2)")
    ap.add_argument("--vs-llama-cpp", action="store_true", help="quantized engine vs llama.cpp, same GGUF")
    ap.add_argument("--head", action="store_true", help="the logits head alone: block kernel vs engine")
    ap.add_argument("--tinyllama", action="store_true",
                    help="with --vs-llama-cpp: TinyLlama-1.1B-shape random llamas in Q4_K_M and Q8_0")
    ap.add_argument("--types", default=None, help="with --tinyllama: e.g. Q4_K (default: Q4_K_M,Q8_0)")
    ap.add_argument("--ref", default=None,
                    help="with --vs-llama-cpp: the same Ethen runs of this commit too (interleaved)")
    ap.add_argument("--modes", default=None,
                    help="with --vs-llama-cpp: Ethen's modes to run, comma-separated (default all: auto, "
                         "int8-act, exact, exact-int8, 'exact-int8 + float32 prefill', ggml, ggml-native: "
                         "the ggml engine on the llama venv's libggml built for this CPU)")
    ap.add_argument("--answers", action="store_true",
                    help="only the greedy answers to five prompts: llama.cpp's and each --accuracy's")
    ap.add_argument("--devices", action="store_true",
                    help="decode / prefill per device: onnx cpu, cuda (onnxruntime-gpu); ggml's direct CPU "
                         "engine and each device of the installed libggml's backends")
    args = ap.parse_args()
    if args.devices:
        devices(args.model, args.steps, args.repeats)
        return
    if args.answers:
        greedy_answers(args.model or find_gguf_path())
        return
    if args.head:
        head_bench(args.model, args.repeats)
        return
    if args.vs_llama_cpp:
        with tempfile.TemporaryDirectory(prefix="ethen-decode-ref-") as tmp:
            ref = None
            if args.ref is not None:
                import subprocess

                archive = subprocess.run(["git", "archive", args.ref], cwd=ROOT, capture_output=True,
                                         check=True).stdout
                subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
                ref = (args.ref, Path(tmp))
            kinds = args.types.split(",") if args.types else TINYLLAMA_TYPES
            for path in [tinyllama_gguf(k) for k in kinds] if args.tinyllama else [args.model]:
                vs_llama_cpp(path, args.steps, args.repeats, ref,
                             args.modes.split(",") if args.modes else ())
            if not args.tinyllama:  # (random weights: no answer to compare)
                greedy_answers(args.model or find_gguf_path())
        return
    print(f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    if not args.skip_tiny:
        _tiny_rows(args.steps, args.repeats)
    if not args.skip_cold:
        print(f"cold load (parse GGUF + dequantize + write cache + load): {_cold_load_s(args.model):.2f} s")
    warm = [_warm_load_s(args.model) for _ in range(3)]
    print(f"warm load (mmap cache): {statistics.median([w[0] for w in warm]):.3f} s;"
          f" to first logits: {statistics.median([w[1] for w in warm]):.3f} s")
    m = load_model(open_weight_store(args.model))
    print(f"model: {open_weight_store(args.model).model_name} ({m.config.architecture})")
    ids = m.tokenizer.encode(m.chat_template.render(PROMPT))
    prefill = statistics.median(_prefill_tok_s(m, ids) for _ in range(args.repeats))
    print(f"prefill ({len(ids)} tokens): {prefill:.0f} tok/s")
    long_ids = (ids * (LONG_PREFILL // len(ids) + 1))[:LONG_PREFILL]
    long_prefill = statistics.median(_prefill_tok_s(m, long_ids) for _ in range(args.repeats))
    print(f"prefill ({len(long_ids)} tokens): {long_prefill:.0f} tok/s")
    print(f"load average now: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (high: wall figures suffer)")
    base, base_cpu = _median2([_decode_tok_s(m, ids, 1, args.steps) for _ in range(args.repeats)])
    print(f"decode, 1 session (baseline): {base:.1f} tok/s wall ({1000 / base:.1f} ms/token); "
          f"{base_cpu:.1f} tok per CPU-s")
    for b in (2, 4, 8):
        agg, agg_cpu = _median2([_decode_tok_s(m, ids, b, args.steps) for _ in range(args.repeats)])
        print(f"decode, {b} sessions batched: {agg:.1f} tok/s wall aggregate = {agg / base:.2f}x baseline; "
              f"{agg_cpu:.1f} tok per CPU-s = {agg_cpu / base_cpu:.2f}x")
    hf = _hf_rows([(None, None, None, None, None, args.model or find_gguf_path())], args.steps, args.repeats)
    if hf:
        print(f"transformers, same GGUF: prefill {hf[0][0]:.0f} tok/s, decode 1 session {hf[0][1]:.1f} tok/s")


if __name__ == "__main__":
    main()
