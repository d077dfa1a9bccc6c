"""Gateway overhead benchmark: ethen gateway vs LiteLLM proxy, in front of the same scripted upstream.

Set-up (all on 127.0.0.1, each server its own process):
- the scripted OpenAI-compatible upstream (``tests/gateway/upstream.py``) with a fixed latency (50 ms);
- ``ethen gateway`` routing ``ethen/auto`` over a 3-route pool whose routes all point at that upstream;
- the LiteLLM proxy (``litellm[proxy]`` from a separate venv, default ``/tmp/litellm-venv``, installed there
  when missing; ``--litellm ''`` skips it) with one deployment pointing at the same upstream, with a master
  key (both gateways do auth);
- load at fixed offered rates, by default an open-loop generator in this process (aiohttp + uvloop):
  request i leaves at ``start + i / rate`` and its latency counts from then (no coordinated omission).
  ``--loadgen hey`` uses ``hey`` instead (Debian package, installed with apt-get when missing): ``c``
  workers each limited to 10 requests/s, latencies from ``hey -o csv``. hey's rate-limited workers are
  closed-loop, and on this machine hey added ~4 ms to direct calls and ~12 ms to gateway calls at 500 RPS
  compared with the open-loop generator, so the default is the open-loop one; both are kept.

Measured per offered rate, in the same run:
- p50 / p99 end-to-end latency of direct-to-upstream, through ethen, through LiteLLM;
- overhead = gateway percentile minus the direct percentile at the same rate;
- ethen's self-reported overhead (``x-ethen-overhead-ms``, total minus upstream time) from its Prometheus
  histogram (bucket upper bounds);
- the highest offered rate sustained with no errors (every request 200, achieved >= 95 % of offered, p99 below
  1 s), stepping up a ladder of rates.

With ``--store sqlite`` and/or ``--store postgresql://...`` (issue 11), the same run also starts one ethen
gateway per store with a ``[store]`` section and measures it with a budgeted project key (a project with a
large day budget, so every request authenticates, holds budget and settles into the ledger) at the same rates
and on the same ladder: "store added p50" is its p50 minus the no-store gateway's at the same rate.

Run:  .venv/bin/python bench/gateway_overhead.py [--rates 100,500,1000] [--duration 10] [--store sqlite]
Targets (issue 4): overhead p50 <= 1 ms and p99 <= 5 ms at 500 RPS; p50 overhead >= 5x lower than LiteLLM's;
max sustained rate >= 3x LiteLLM's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLIENT_KEY = "ethen-bench-0123456789abcdef0123456789abcdef"
LITELLM_MASTER = "sk-litellm-bench-master"
UPSTREAM_KEY = "sk-upstream-bench"
PER_WORKER_QPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    url: str, proc: subprocess.Popen[bytes], timeout: float, headers: dict[str, str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1, headers=headers).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def settle(t: Target, max_wait: float = 120.0) -> bool:
    """Wait until ``t`` answers one request with 200 within 1 s (an overloaded server drains its backlog)."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            r = httpx.post(
                t.url, content=t.body, headers={**t.headers, "content-type": "application/json"}, timeout=5
            )
            if r.status_code == 200 and time.monotonic() - started < 1.0:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False


def ensure_litellm(cli: str) -> bool:
    """Install ``litellm[proxy]`` into its own venv (the one ``cli`` lives in) when it is missing."""
    path = Path(cli)
    if path.exists():
        return True
    venv = path.parent.parent
    print(f"installing litellm[proxy] into {venv} (separate venv) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True, timeout=1800
        )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"LiteLLM install failed: {exc}", flush=True)
        return False
    return path.exists()


def ensure_hey() -> str:
    path = shutil.which("hey")
    if path:
        return path
    print("installing hey (apt-get install -y hey) ...", flush=True)
    subprocess.run(["apt-get", "install", "-y", "hey"], check=True, capture_output=True)
    path = shutil.which("hey")
    if not path:
        raise RuntimeError("hey is not available")
    return path


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    body: str


@dataclass
class Result:
    offered: int
    sent: int
    ok: int
    p50_ms: float
    p99_ms: float
    achieved: float

    @property
    def sustained(self) -> bool:
        return self.ok == self.sent and self.achieved >= 0.95 * self.offered and self.p99_ms < 1000


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, round(q * (len(xs) - 1))))
    return xs[k]


def run_open_loop(t: Target, rate: int, duration: float) -> Result:
    """Open-loop load (no coordinated omission): request i is sent at ``start + i / rate`` whatever the
    previous ones are doing, and its latency counts from that intended start, so a lagging generator or server
    is charged, not hidden. aiohttp + uvloop, in this process."""
    import asyncio

    import aiohttp
    import uvloop

    body = t.body.encode()
    headers = {**t.headers, "content-type": "application/json"}
    total = int(rate * duration)

    async def go() -> Result:
        lat: list[float] = []
        ok = 0
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000), timeout=timeout) as s:
            clock = time.perf_counter  # uvloop's loop.time() has 1 ms resolution

            async def one(intended: float) -> None:
                nonlocal ok
                try:
                    async with s.post(t.url, data=body, headers=headers) as r:
                        await r.read()
                        if r.status == 200:
                            ok += 1
                            lat.append((clock() - intended) * 1000)
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass

            start = clock() + 0.05
            tasks = []
            for i in range(total):
                intended = start + i / rate
                delay = intended - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(intended)))
            await asyncio.gather(*tasks)
            elapsed = max(duration, clock() - start)
        return Result(rate, total, ok, percentile(lat, 0.5), percentile(lat, 0.99), ok / elapsed)

    return uvloop.run(go())


def run_hey(hey: str, t: Target, rate: int, duration: float) -> Result:
    workers = max(1, rate // PER_WORKER_QPS)
    cmd = [
        hey,
        "-z",
        f"{duration}s",
        "-c",
        str(workers),
        "-q",
        str(PER_WORKER_QPS),
        "-m",
        "POST",
        "-T",
        "application/json",
        "-d",
        t.body,
        "-t",
        "10",
        "-o",
        "csv",
    ]
    for k, v in t.headers.items():
        cmd += ["-H", f"{k}: {v}"]
    cmd.append(t.url)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60).stdout
    lat: list[float] = []
    sent = ok = 0
    for line in out.splitlines()[1:]:
        parts = line.split(",")
        if len(parts) < 8:
            continue
        sent += 1
        if parts[6] == "200":
            ok += 1
            lat.append(float(parts[0]) * 1000)
    return Result(rate, sent, ok, percentile(lat, 0.5), percentile(lat, 0.99), ok / duration)


def ethen_overhead_quantiles(metrics_url: str) -> tuple[float, float, int]:
    """(p50 upper bound ms, p99 upper bound ms, count) from ethen_gateway_overhead_seconds buckets."""
    text = httpx.get(metrics_url, timeout=5).text
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("ethen_gateway_overhead_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0

    def q(p: float) -> float:
        for le, c in buckets:
            if c >= p * total:
                return le * 1000
        return float("nan")

    return q(0.5), q(0.99), int(total)


def store_project_key(url: str) -> str:
    """A project with a large day budget in the store at ``url`` and a key of it (migrates a new database)."""
    import asyncio

    from ethen.store import Store

    async def go() -> str:
        st = await Store.open(url)
        try:
            name = f"bench{time.time_ns()}"
            await st.create_project(name, budget_usd=1e6, budget_window="day")
            key, _ = await st.create_key(name)
            return key
        finally:
            await st.aclose()

    return asyncio.run(go())


def write_ethen_config(path: Path, upstream: str, store_url: str | None = None) -> None:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    routes = ""
    for i, (quality, price) in enumerate(((0.6, 0.5), (0.7, 1.0), (0.8, 3.0))):
        routes += f"""
[[routes]]
model = "bench-model-{i}"
provider = "up"
upstream_model = "bench-model"
info = {{ context_window = 128000, max_output_tokens = 8192, supports_tools = true, quality = {quality} }}
prices = {{ input_per_mtok = {price}, output_per_mtok = {price * 4} }}
"""
    path.write_text(f"""
[[providers]]
id = "up"
kind = "openai_compat"
base_url = "{upstream}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
max_connections = 1000
timeouts = {{ connect_s = 5.0, first_byte_s = 10.0, total_s = 30.0 }}
{routes}
[[api_keys]]
name = "bench"
sha256 = "{digest}"
""" + (f'\n[store]\nurl = "{store_url}"\n' if store_url else ""))


def write_litellm_config(path: Path, upstream: str) -> None:
    path.write_text(f"""model_list:
  - model_name: bench-model
    litellm_params:
      model: openai/bench-model
      api_base: {upstream}/v1
      api_key: {UPSTREAM_KEY}
general_settings:
  master_key: {LITELLM_MASTER}
litellm_settings:
  set_verbose: false
  telemetry: false
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rates", default="20,100,500,1000", help="offered rates (RPS) for the overhead table")
    ap.add_argument(
        "--ladder", default="20,50,100,250,500,750,1000,1500,2000", help="rates for the max-rate search"
    )
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--ladder-duration", type=float, default=5.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--litellm", default="/tmp/litellm-venv/bin/litellm", help="litellm CLI ('' to skip)")
    ap.add_argument(
        "--loadgen",
        choices=("python", "hey"),
        default="python",
        help="open-loop aiohttp generator (default) or hey (closed-loop workers, rate-limited)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument(
        "--store",
        action="append",
        default=[],
        help="also measure a gateway with this [store] ('sqlite' = a temp file, or a postgresql:// URL) "
        "and a "
        "budgeted project key; repeatable",
    )
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",") if r]
    ladder = [int(r) for r in args.ladder.split(",") if r]

    if args.loadgen == "hey":
        hey = ensure_hey()

        def measure(t: Target, rate: int, duration: float) -> Result:
            return run_hey(hey, t, rate, duration)
    else:
        measure = run_open_loop
    tmp = Path(tempfile.mkdtemp(prefix="ethen-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY}

    def spawn(cmd: list[str], log: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(tmp / log, "wb") as fh:
            p = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**env, **(extra_env or {})},
                cwd=ROOT,
                start_new_session=True,
            )
        procs.append(p)
        return p

    try:
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        p = spawn(
            [
                sys.executable,
                str(ROOT / "tests/gateway/upstream.py"),
                "--port",
                str(up_port),
                "--latency-ms",
                str(args.latency_ms),
            ],
            "upstream.log",
        )
        wait_ready(f"{upstream}/v1/models", p, 30)

        write_ethen_config(tmp / "gateway.toml", upstream)
        gw_port = free_port()
        p = spawn(
            [
                sys.executable,
                "-m",
                "ethen",
                "gateway",
                "--config",
                str(tmp / "gateway.toml"),
                "--port",
                str(gw_port),
            ],
            "ethen.log",
        )
        gw = f"http://127.0.0.1:{gw_port}/api/gateway/v1"
        wait_ready(f"{gw}/healthz", p, 60)

        messages = [{"role": "user", "content": "Say hello"}]
        store_targets: list[Target] = []
        for spec in args.store:
            url = f"sqlite:///{tmp}/store.db" if spec == "sqlite" else spec
            label = "st-sqlite" if spec == "sqlite" else "st-pg"
            key = store_project_key(url)
            write_ethen_config(tmp / f"{label}.toml", upstream, url)
            port = free_port()
            p = spawn(
                [sys.executable, "-m", "ethen", "gateway", "--config", str(tmp / f"{label}.toml"), "--port",
                 str(port)],
                f"{label}.log",
            )
            base = f"http://127.0.0.1:{port}/api/gateway/v1"
            wait_ready(f"{base}/healthz", p, 60)
            store_targets.append(
                Target(label, f"{base}/chat/completions", {"Authorization": f"Bearer {key}"},
                       json.dumps({"model": "ethen/auto", "messages": messages}))
            )
        targets = [
            Target(
                "direct",
                f"{upstream}/v1/chat/completions",
                {"Authorization": f"Bearer {UPSTREAM_KEY}"},
                json.dumps({"model": "bench-model", "messages": messages}),
            ),
            Target(
                "ethen",
                f"{gw}/chat/completions",
                {"Authorization": f"Bearer {CLIENT_KEY}"},
                json.dumps({"model": "ethen/auto", "messages": messages}),
            ),
        ]
        targets += store_targets
        litellm_version = None
        if args.litellm and ensure_litellm(args.litellm):
            write_litellm_config(tmp / "litellm.yaml", upstream)
            ll_port = free_port()
            p = spawn(
                [
                    args.litellm,
                    "--config",
                    str(tmp / "litellm.yaml"),
                    "--port",
                    str(ll_port),
                    "--host",
                    "127.0.0.1",
                    "--num_workers",
                    "1",
                ],
                "litellm.log",
                {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"},
            )
            wait_ready(f"http://127.0.0.1:{ll_port}/health/liveliness", p, 180)
            targets.append(
                Target(
                    "litellm",
                    f"http://127.0.0.1:{ll_port}/v1/chat/completions",
                    {"Authorization": f"Bearer {LITELLM_MASTER}"},
                    json.dumps({"model": "bench-model", "messages": messages}),
                )
            )
            ver = subprocess.run(
                [
                    str(Path(args.litellm).parent / "python"),
                    "-c",
                    "import importlib.metadata as m; print(m.version('litellm'))",
                ],
                capture_output=True,
                text=True,
            )
            litellm_version = ver.stdout.strip() or None
        else:
            print(f"LiteLLM baseline skipped ({args.litellm!r} not found)", flush=True)

        for t in targets:  # warm-up: connections, caches, JIT-less but lazy imports
            measure(t, 50, 3)
        print(
            f"load average before: {os.getloadavg()}; cores: {os.cpu_count()}; upstream latency "
            f"{args.latency_ms:.0f} ms; LiteLLM {litellm_version or '-'}",
            flush=True,
        )

        def show(label: str, name: str, rate: int, r: Result) -> None:
            print(
                f"  {label:6s} {name:8s} {rate:5d}/s: ok {r.ok:6d}/{r.sent:6d} got {r.achieved:7.1f}/s "
                f"p50 {r.p50_ms:8.2f} ms  p99 {r.p99_ms:8.2f} ms  "
                f"{'sustained' if r.sustained else 'NOT sustained'}",
                flush=True,
            )

        def ladder_for(t: Target) -> int:
            best = 0
            for rate in ladder:
                settle(t)
                r = measure(t, rate, args.ladder_duration)
                show("ladder", t.name, rate, r)
                if not r.sustained:
                    break
                best = rate
            return best

        # Phases, so that one target's backlog never runs during another's measurement: direct + ethen at the
        # table rates, ethen's ladder, then LiteLLM (ladder first, from low rates up, then the table rates),
        # with a settle step (the target answers one request within 1 s again) before every measurement.
        table: dict[int, dict[str, Result]] = {rate: {} for rate in rates}
        by_name = {t.name: t for t in targets}
        for rate in rates:
            for name in ("direct", "ethen", *(t.name for t in store_targets)):
                settle(by_name[name])
                r = table[rate][name] = measure(by_name[name], rate, args.duration)
                show("rate", name, rate, r)
        self_p50, self_p99, self_n = ethen_overhead_quantiles(f"{gw}/metrics")
        max_rate = {"ethen": ladder_for(by_name["ethen"])}
        for st in store_targets:
            max_rate[st.name] = ladder_for(st)
        if "litellm" in by_name:
            ll = by_name["litellm"]
            max_rate["litellm"] = ladder_for(ll)
            for rate in rates:
                recovered = settle(ll, 180)
                r = table[rate]["litellm"] = measure(ll, rate, args.duration)
                show("rate", "litellm", rate, r)
                if not recovered:
                    print("  (litellm had not recovered from the previous step within 180 s)", flush=True)

        print("\n== overhead = gateway percentile - direct-upstream percentile, same offered rate ==")
        print(
            f"{'rate':>6} | {'direct p50/p99':>16} | {'ethen ovh p50/p99':>18} | "
            f"{'litellm ovh p50/p99':>20} | {'p50 ratio':>9}"
        )
        report: dict[str, object] = {
            "rates": {},
            "max_sustained_rps": max_rate,
            "litellm_version": litellm_version,
        }
        for rate, row in table.items():
            d = row["direct"]
            e = row["ethen"]
            eo50, eo99 = e.p50_ms - d.p50_ms, e.p99_ms - d.p99_ms
            cells = f"{rate:6d} | {d.p50_ms:7.2f}/{d.p99_ms:7.2f} | {eo50:8.2f}/{eo99:8.2f} |"
            entry: dict[str, float | None] = {
                "direct_p50_ms": d.p50_ms,
                "direct_p99_ms": d.p99_ms,
                "ethen_overhead_p50_ms": eo50,
                "ethen_overhead_p99_ms": eo99,
                "ethen_errors": e.sent - e.ok,
            }
            if "litellm" in row:
                lr = row["litellm"]
                lo50, lo99 = lr.p50_ms - d.p50_ms, lr.p99_ms - d.p99_ms
                ratio = lo50 / eo50 if eo50 > 0 else float("inf")
                cells += f" {lo50:9.2f}/{lo99:9.2f} | {ratio:8.1f}x"
                entry.update(
                    {
                        "litellm_overhead_p50_ms": lo50,
                        "litellm_overhead_p99_ms": lo99,
                        "litellm_errors": lr.sent - lr.ok,
                        "p50_overhead_ratio": ratio,
                    }
                )
            else:
                cells += f" {'-':>20} | {'-':>9}"
            print(cells)
            report["rates"][str(rate)] = entry  # type: ignore[index]
        print(
            "\nethen self-reported overhead (x-ethen-overhead-ms histogram, bucket upper bounds, "
            f"n={self_n}): p50 <= {self_p50:.2f} ms, p99 <= {self_p99:.2f} ms"
        )
        report["ethen_self_reported_overhead_ms"] = {"p50_le": self_p50, "p99_le": self_p99, "n": self_n}
        if store_targets:
            print("\n== store-backed gateway (budgeted project key) vs the no-store gateway, same run ==")
            report["store"] = {}
            for st in store_targets:
                added = {rate: row[st.name].p50_ms - row["ethen"].p50_ms for rate, row in table.items()}
                ratio = max_rate[st.name] / max_rate["ethen"] if max_rate["ethen"] else float("nan")
                cells = ", ".join(f"{rate}/s: {a:+.2f} ms" for rate, a in added.items())
                print(f"  {st.name}: added p50 {cells}; max rate {max_rate[st.name]} vs {max_rate['ethen']} "
                      f"({ratio:.0%})")
                report["store"][st.name] = {  # type: ignore[index]
                    "added_p50_ms": {str(k): v for k, v in added.items()},
                    "max_rate_ratio": ratio,
                }
        print(f"max sustained rate (no errors, >= 95 % of offered, p99 < 1 s): {max_rate}")
        if max_rate.get("litellm"):
            print(
                f"  ratio ethen / litellm: {max_rate['ethen'] / max_rate['litellm']:.1f}x "
                f"(ladder tops out at {ladder[-1]}/s)"
            )
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        print(f"logs: {tmp}")


if __name__ == "__main__":
    main()
