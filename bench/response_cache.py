"""Response cache benchmark (issue 27): what a cache hit adds over the gateway's fixed overhead, and memory
per entry.

Set-up (all on 127.0.0.1, each server its own process): the scripted OpenAI-compatible upstream
(``tests/gateway/upstream.py``, fixed latency, 5 ms by default) and ``ethen gateway`` with ``[cache] enabled``
(memory backend; with ``--redis URL`` also a second gateway with ``backend = "redis"`` on that Redis).

Measured in the same run, per gateway, open-loop at ``--rate`` (500) requests/s for ``--requests`` requests
(bounded; request i leaves at ``start + i / rate`` and its latency counts from then): the same deterministic
chat completion (``temperature: 0``), alternately as a cache **hit** (the entry was stored by a warm-up
request) and with ``Cache-Control: no-store`` (the baseline: the gateway's full path to the upstream, the
cache not read nor written). For each: p50 / p99 of the gateway's own ``x-ethen-overhead-ms`` (total minus
upstream time; a hit has no upstream time, so it is the hit's whole time in the gateway) and of the client
latency. **Added p50** = hit overhead p50 - no-store overhead p50 (target <= 0.5 ms at 500 rps).

Memory per entry: ``tracemalloc`` over ``--entries`` entries stored in-process in a
:class:`~ethen.gateway.cache.MemoryBackend` through :class:`~ethen.gateway.cache.ResponseCache` (the
scripted upstream's answer, ~0.4 KB, and a 4 KB answer): allocated bytes / entries, next to the entry's
encoded size.

Run:  PYTHONPATH=. .venv/bin/python bench/response_cache.py [--rate 500] [--requests 4000] [--redis URL]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchkit import free_port, open_loop, percentile, wait_ready  # noqa: E402

from ethen.gateway.cache import CachePolicy, MemoryBackend, ResponseCache  # noqa: E402

CLIENT_KEY = "ethen-bench-0123456789abcdef0123456789abcdef"
BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "temperature": 0}



def load(url: str, rate: int, n: int) -> dict[str, dict[str, list[float]]]:
    """Open loop (benchkit.open_loop), alternately a hit and a no-store request: per kind, the gateway's
    overhead (``x-ethen-overhead-ms``), the client latency (ms), and one entry per error (not 200, or not the
    expected ``x-ethen-cache``)."""
    base = {"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"}
    kinds = {"hit": base, "no-store": {**base, "cache-control": "no-store"}}
    out: dict[str, dict[str, list[float]]] = {k: {"overhead": [], "latency": [], "errors": []} for k in kinds}
    replies = open_loop(url, json.dumps(BODY).encode(), n, rate,
                        lambda i: kinds["hit" if i % 2 == 0 else "no-store"], timeout_s=10)
    for r in replies:
        kind = "hit" if r.i % 2 == 0 else "no-store"
        want = "hit" if kind == "hit" else "bypass"
        if r.status != 200 or r.headers.get("x-ethen-cache") != want:
            out[kind]["errors"].append(1.0)
            continue
        out[kind]["latency"].append(r.latency_ms)
        out[kind]["overhead"].append(float(r.headers["x-ethen-overhead-ms"]))
    return out


def write_config(path: Path, upstream: str, redis_url: str | None) -> None:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    shared = ""
    if redis_url:
        shared = f'\n[shared]\nredis_url = "{redis_url}"\nkey_prefix = "bench{os.getpid()}"\n'
    backend = "redis" if redis_url else "memory"
    path.write_text(f"""
[[providers]]
id = "up"
kind = "openai_compat"
base_url = "{upstream}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
max_connections = 1000

[[routes]]
model = "bench-model"
provider = "up"
info = {{ context_window = 128000, max_output_tokens = 8192, quality = 0.7 }}
prices = {{ input_per_mtok = 1.0, output_per_mtok = 4.0 }}

[[api_keys]]
name = "bench"
sha256 = "{digest}"

[cache]
enabled = true
backend = "{backend}"
ttl_s = 3600
{shared}""")



def bench_gateway(name: str, url: str, rate: int, n: int) -> dict[str, Any]:
    h = {"authorization": f"Bearer {CLIENT_KEY}"}
    first = httpx.post(url, json=BODY, headers=h, timeout=10)
    assert first.status_code == 200 and first.headers["x-ethen-cache"] in ("miss", "hit"), first.text
    time.sleep(0.2)  # a redis write is a background task
    assert httpx.post(url, json=BODY, headers=h, timeout=10).headers["x-ethen-cache"] == "hit"
    load(url, min(rate, 200), 400)  # warm-up (connections, code paths), discarded
    res = load(url, rate, n)
    row: dict[str, Any] = {"gateway": name, "rate": rate}
    for kind, d in res.items():
        oh, lat = d["overhead"], d["latency"]
        row[kind] = {
            "n": len(oh), "errors": len(d["errors"]),
            "overhead_p50_ms": percentile(oh, 0.5), "overhead_p99_ms": percentile(oh, 0.99),
            "latency_p50_ms": percentile(lat, 0.5), "latency_p99_ms": percentile(lat, 0.99),
        }
    row["added_p50_ms"] = row["hit"]["overhead_p50_ms"] - row["no-store"]["overhead_p50_ms"]
    return row


def memory_per_entry(entries: int, content_bytes: int) -> tuple[float, int]:
    """(tracemalloc bytes per entry, encoded entry bytes) for ``entries`` distinct entries (the answer's
    bytes are copied into each entry, as from the upstream)."""
    content = ("x" * content_bytes) if content_bytes else "Hello from upstream"
    answer = {"id": "chatcmpl-up1", "object": "chat.completion", "created": 1700000000,
              "model": "bench-model",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                           "finish_reason": "stop", "logprobs": None}],
              "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}}
    raw = json.dumps(answer, separators=(",", ":")).encode()
    backend = MemoryBackend(entries, 3600)
    cache = ResponseCache(CachePolicy(), backend)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(entries):  # the key (64-char str), the encoded entry, the LRU's slot: what stays
        body = {**BODY, "seed": i}
        cache.store_body(cache.consult("config:bench", "chat", body, body, None, None), "up/bench-model", raw)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert backend.entries == entries
    return (after - before) / entries, backend.size // entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--requests", type=int, default=4000, help="measured requests per gateway (half hits)")
    ap.add_argument("--latency-ms", type=float, default=5.0, help="the scripted upstream's latency")
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--redis", default=None, help="also measure the redis backend on this Redis URL")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ethen-cache-bench-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench", "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(tmp / log, "wb") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
        procs.append(p)
        return p

    rows: list[dict[str, Any]] = []
    try:
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        p = spawn([sys.executable, str(ROOT / "tests/gateway/upstream.py"), "--port", str(up_port),
                   "--latency-ms", str(args.latency_ms)], "upstream.log")
        wait_ready(f"{upstream}/v1/models", p)
        gateways = [("memory", None)] + ([("redis", args.redis)] if args.redis else [])
        for name, redis_url in gateways:
            write_config(tmp / f"{name}.toml", upstream, redis_url)
            port = free_port()
            p = spawn([sys.executable, "-m", "ethen", "gateway", "--config", str(tmp / f"{name}.toml"),
                       "--port", str(port)], f"{name}.log")
            base = f"http://127.0.0.1:{port}/api/gateway/v1"
            wait_ready(f"{base}/healthz", p)
            rows.append(bench_gateway(name, f"{base}/chat/completions", args.rate, args.requests))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    print(f"response cache at {args.rate} rps, {args.requests} requests per gateway (half hits, half "
          f"Cache-Control: no-store), upstream latency {args.latency_ms:g} ms; medians (p99)")
    print(f"{'backend':8} {'kind':9} {'n':>5} {'err':>4} {'overhead ms':>18} {'client latency ms':>20}")
    for row in rows:
        for kind in ("no-store", "hit"):
            k = row[kind]
            print(f"{row['gateway']:8} {kind:9} {k['n']:5d} {k['errors']:4d} "
                  f"{k['overhead_p50_ms']:8.3f} ({k['overhead_p99_ms']:7.3f}) "
                  f"{k['latency_p50_ms']:9.3f} ({k['latency_p99_ms']:8.3f})")
        ratio = row["hit"]["overhead_p50_ms"] / row["no-store"]["overhead_p50_ms"]
        verdict = "ok" if row["added_p50_ms"] <= 0.5 else "OVER"
        print(f"{row['gateway']:8} hit added p50 over the no-store overhead: {row['added_p50_ms']:+.3f} ms "
              f"(hit/no-store overhead p50 = {ratio:.2f}x; target <= +0.5 ms: {verdict})")
    mem = {}
    for size in (0, 4096):
        per, encoded = memory_per_entry(args.entries, size)
        mem[size] = {"tracemalloc_bytes_per_entry": per, "encoded_bytes_per_entry": encoded}
        print(f"memory per entry ({args.entries} entries, {'~0.4 KB' if not size else '4 KB'} answer): "
              f"{per:,.0f} B allocated (entry encoded: {encoded:,} B; overhead {per - encoded:,.0f} B)")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "memory": mem}, indent=2))


if __name__ == "__main__":
    main()
