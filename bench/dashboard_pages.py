"""Dashboard pages with a full request log (issue 14): every ``/ui`` page must load in < 300 ms with 10k rows.

Set-up (all on 127.0.0.1): two ``ethen gateway`` processes with a SQLite store and an admin key, the same
config (four routes, a canary): one whose request log holds ``--rows`` (10,000) rows, inserted through the
store's request-log writer (``ethen.store.requests.insert_requests``, in the writer's batches of 500), spread
over the last ``--spread-s`` (50 min: all inside the default 1-hour window of the Candidates tab, the worst
case), and the baseline one with an empty log, measured in the same run. Rows look like logged ones: 1-2
attempts (a failed first try on 10 %), tokens, cost, a receipt with a 4-candidate chain and 3 rejections.

Measured, per gateway:
- HTTP: median and p95 of ``--repeat`` GETs of every page, static file and JSON endpoint the pages call
  from a warm keep-alive client, and, as the in-run baseline of the Spend tab's fix, what it fetched before
  (4 pages of 500 full rows through ``/requests``, one sample = the 4 calls); with each, the gateway
  process's CPU time per call (``/proc/PID/stat``, all threads: the SQLite reads run in aiosqlite's): what
  an idle core would take, which the wall times on a shared, loaded VM do not show;
- in process, on the filled file, the Candidates page's data (the last hour's attempts, bucketed): now
  (``attempts_between``: the ``request_attempts`` table) and, as the in-run baseline, what it was before
  (the rows' JSON attempt lists unnested by SQLite);
- if Chromium is at ``/usr/bin/chromium`` (and the ``playwright`` package is there): each page in a real
  browser, from the click on its tab (after a fresh ``/ui`` load) until its content is drawn (table rows,
  chart canvases), median of ``--browser-repeat``; ``/ui`` itself from navigation until the request table is
  filled.

Run:  .venv/bin/python bench/dashboard_pages.py [--rows 10000] [--repeat 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import free_port, wait_ready

ADMIN_KEY = "admin-bench-dashboard-0123456789abcdef"
CHROMIUM = "/usr/bin/chromium"
TARGET_MS = 300.0
OLD_SPEND = "(before) Spend charts: 4 x /requests?limit=500"
CANDIDATES = ["alpha/alpha-large", "beta/beta-tools", "beta/beta-small", "gamma/gamma-claude"]
PROJECTS = ["acme", "globex", "initech"]

# tab -> (button, the selector that shows it is drawn); "/ui" is the page load itself
TABS = {
    "requests (/ui)": (None, "#req-rows tr"),
    "spend": ("spend", "#chart-model canvas"),
    "projects & keys": ("keys", "#keys-rows tr"),
    "health": ("health", "#log-state:not(:empty)"),
    "candidates": ("providers", "#chart-circuit canvas, #chart-circuit p"),
    "canaries": ("canaries", "#c-rows tr"),
    "mesh": ("mesh", "#m-body p"),
}


def config(path: Path, db: Path) -> None:
    routes = "".join(f"""
[[routes]]
model = "{c.split('/')[1]}"
provider = "{c.split('/')[0]}"
info = {{ context_window = 128000, max_output_tokens = 8192, quality = {0.5 + i / 10} }}
prices = {{ input_per_mtok = {1.0 + i}, output_per_mtok = {4.0 + i} }}
""" for i, c in enumerate(CANDIDATES))
    providers = "".join(f"""
[[providers]]
id = "{p}"
kind = "openai_compat"
base_url = "http://127.0.0.1:9/v1"
api_key_env = "BENCH_UPSTREAM_KEY"
""" for p in ("alpha", "beta", "gamma"))
    path.write_text(f"""{providers}{routes}
[[canaries]]
alias = "ethen/cheap"
candidate = "beta/beta-small"
percent = 20

[[api_keys]]
name = "bench"
sha256 = "{hashlib.sha256(b'ethen-bench-dashboard-client-key').hexdigest()}"

[store]
url = "sqlite:///{db}"
admin_key_sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
""")


def rows(n: int, spread_s: float, rnd: random.Random) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        at = now - timedelta(seconds=spread_s * (n - i) / n)
        served = rnd.choice(CANDIDATES)
        failed_first = rnd.random() < 0.1
        attempts: list[dict[str, Any]] = []
        if failed_first:
            bad = rnd.choice([c for c in CANDIDATES if c != served])
            attempts.append({"candidate": bad, "outcome": "error", "latency_ms": rnd.uniform(5, 900),
                             "error_class": "server_error", "code": "upstream_server_error",
                             "upstream_status": 500, "provider": bad.split("/")[0],
                             "model": bad.split("/")[1], "status": 500})
        latency = rnd.lognormvariate(6, 0.5)
        attempts.append({"candidate": served, "outcome": "ok", "latency_ms": round(latency, 3),
                         "provider": served.split("/")[0], "model": served.split("/")[1], "status": 200})
        canary = rnd.random() < 0.3
        hit = canary and rnd.random() < 0.2
        chain = [served, *[c for c in CANDIDATES if c != served]]
        receipt = {
            "requested_model": "ethen/cheap" if canary else "ethen/auto",
            "selected_provider": served.split("/")[0], "selected_model": served.split("/")[1],
            "primary_provider": chain[0].split("/")[0], "primary_model": chain[0].split("/")[1],
            "reason_codes": ["best_score", *(["fallback_used"] if failed_first else [])],
            "chain": chain, "score": round(rnd.random(), 4),
            "components": {"quality": 0.8, "cost": 0.6, "latency": 0.7, "reliability": 0.9, "health": 0.9},
            "cost_estimate_usd": 0.0002,
            "rejected": [{"candidate": f"delta/model-{k}", "reasons": ["context_window_too_small"]}
                         for k in range(3)],
            "attempts": attempts,
            **({"canary": {"candidate": "beta/beta-small", "percent": 20, "bucket": 7, "hit": hit,
                           "eligible": True, "promoted": hit, "acceptance_met": False}} if canary else {}),
        }
        out.append({
            "request_id": f"bench-{i:06d}", "at": at, "endpoint": "chat", "stream": i % 3 == 0,
            "project": PROJECTS[i % 3], "key_id": f"key-{i % 7}",
            "requested_model": receipt["requested_model"], "selected_provider": served.split("/")[0],
            "selected_model": served.split("/")[1], "primary_provider": chain[0].split("/")[0],
            "primary_model": chain[0].split("/")[1], "fallback_used": failed_first,
            "canary_hit": hit if canary else None, "prompt_tokens": 200, "completion_tokens": 50,
            "cost_nano": 200_000, "ttft_ms": latency / 3, "latency_ms": latency + 2, "overhead_ms": 0.4,
            "status": 200, "outcome": "ok", "error_code": None, "attempts": attempts, "receipt": receipt,
        })
    return out


async def fill(db: Path, n: int, spread_s: float) -> None:
    from ethen.store import Store
    from ethen.store.requests import insert_requests

    st = await Store.open(f"sqlite:///{db}")
    try:
        for p in PROJECTS:
            await st.create_project(p, budget_usd=100.0, budget_window="month")
            await st.create_key(p)
        data = rows(n, spread_s, random.Random(7))
        for i in range(0, len(data), 500):  # the log writer's batch size
            await insert_requests(st, data[i:i + 500])
    finally:
        await st.aclose()


#: the Candidates data before the attempts table (the baseline, measured in the same run on the same file):
#: the window's newest rows' JSON attempt lists unnested by SQLite
OLD_ATTEMPTS_SQL = """WITH r AS (SELECT at, attempts FROM request_log WHERE at >= :since AND at < :until
ORDER BY at DESC LIMIT :cap)
SELECT (julianday(r.at) - 2440587.5) * 86400.0, json_extract(j.value, '$.candidate'),
       json_extract(j.value, '$.provider'), json_extract(j.value, '$.outcome') = 'ok',
       json_extract(j.value, '$.latency_ms')
FROM r, json_each(r.attempts) AS j"""


async def candidates_data(db: Path, repeat: int) -> dict[str, list[float]]:
    """In process, on the filled file: the Candidates page's data for the last hour (query + bucketing into 24
    buckets), before (JSON unnesting) and now (``attempts_between``: the attempts table), alternated."""
    from sqlalchemy import bindparam, text

    from ethen.admin.observe_data import bucket_attempts
    from ethen.store import Store
    from ethen.store.requests import request_log
    from ethen.store.requeststats import attempts_between

    st = await Store.open(f"sqlite:///{db}")
    out: dict[str, list[float]] = {"before": [], "now": []}
    try:
        for _ in range(repeat):
            hi = datetime.now(UTC)
            lo = hi - timedelta(seconds=3600)
            t0 = time.perf_counter()
            typ = request_log.c.at.type
            stmt = text(OLD_ATTEMPTS_SQL).bindparams(bindparam("since", lo, type_=typ),
                                                     bindparam("until", hi, type_=typ), cap=20_000)
            async with st.engine.connect() as conn:
                rows = (await conn.execute(stmt)).all()
            old = [(float(t), str(c), str(p or c.partition("/")[0]), bool(ok),
                    float(lat) if lat is not None else None) for t, c, p, ok, lat in rows if c]
            bucket_attempts(old, lo.timestamp(), 150.0, 24)
            t1 = time.perf_counter()
            new, _, _ = await attempts_between(st, lo, hi, 20_000)
            bucket_attempts(new, lo.timestamp(), 150.0, 24)
            t2 = time.perf_counter()
            assert len(old) == len(new), (len(old), len(new))
            out["before"].append((t1 - t0) * 1000)
            out["now"].append((t2 - t1) * 1000)
    finally:
        await st.aclose()
    return out


def endpoints(client: httpx.Client) -> list[str]:
    """Every page, static file and JSON endpoint the dashboard's pages call."""
    paths = ["/ui", "/ui/app.js", "/ui/observe.js", "/ui/uplot.iife.min.js", "/ui/uplot.min.css"]
    api = "/api/admin/v1"
    first = client.get(f"{api}/requests?limit=50").json()
    rid = first["data"][0]["request_id"] if first["data"] else "none"
    paths += [f"{api}/requests?limit=50", f"{api}/requests/{rid}", f"{api}/health", f"{api}/projects",
              f"{api}/usage", f"{api}/projects/acme", f"{api}/projects/acme/keys",
              f"{api}/observe/spend?limit=2000", f"{api}/observe/providers?window_s=3600&buckets=24",
              f"{api}/observe/providers?window_s=604800&buckets=24", f"{api}/observe/canaries",
              f"{api}/observe/mesh"]
    return paths


def old_spend(client: httpx.Client) -> None:
    """What the Spend tab fetched before ``/observe/spend``: 4 pages of 500 full rows (the baseline)."""
    cursor = None
    for _ in range(4):
        params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        r = client.get("/api/admin/v1/requests", params=params)
        cursor = r.json()["next_cursor"]
        if not cursor:
            return


def cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used, from ``/proc`` (10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def http_times(base: str, cookie: str, repeat: int, pid: int) -> dict[str, tuple[float, float, float]]:
    """Per path: median and p95 wall ms, and the gateway's CPU ms per call (what an idle core would need)."""
    out = {}
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {ADMIN_KEY}", "cookie": cookie},
                      timeout=30) as c:
        calls: list[tuple[str, Any]] = [(p, lambda p=p: c.get(p)) for p in endpoints(c)]
        calls.append((OLD_SPEND, lambda: old_spend(c)))
        for path, call in calls:
            ms = []
            cpu0 = cpu_ms(pid)
            for _ in range(repeat):
                t0 = time.perf_counter()
                r = call()
                ms.append((time.perf_counter() - t0) * 1000)
                assert r is None or r.status_code in (200, 404), (path, r.status_code, r.text[:200])
            out[path] = (statistics.median(ms), quantile(ms, 0.95), (cpu_ms(pid) - cpu0) / repeat)
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def browser_times(base: str, repeat: int) -> dict[str, float] | str:
    if not os.path.exists(CHROMIUM):
        return f"skipped: {CHROMIUM} is absent"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "skipped: the playwright package is absent"
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking"]
    out: dict[str, list[float]] = {name: [] for name in TABS}
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        ctx = b.new_context(viewport={"width": 1280, "height": 900})
        ctx.set_default_timeout(30_000)
        page = ctx.new_page()
        page.goto(f"{base}/ui")
        page.fill("#admin-key", ADMIN_KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("#req-rows tr")
        for _ in range(repeat):
            for name, (tab, drawn) in TABS.items():
                t0 = time.perf_counter()
                page.goto(f"{base}/ui")
                page.wait_for_selector("#req-rows tr")
                if tab is not None:
                    t0 = time.perf_counter()
                    page.click(f"nav button[data-tab={tab}]")
                    page.wait_for_selector(f"section#{tab}.on")
                    page.wait_for_selector(drawn)
                out[name].append((time.perf_counter() - t0) * 1000)
        b.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--spread-s", type=float, default=3000.0)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--browser-repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ethen-dash-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, Any] = {}
    try:
        for name, n in (("full", args.rows), ("empty", 0)):
            db, cfg = tmp / f"{name}.db", tmp / f"{name}.toml"
            config(cfg, db)
            t0 = time.perf_counter()
            asyncio.run(fill(db, n, args.spread_s))
            print(f"{name}: {n} rows inserted through insert_requests in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            if n:
                results["candidates data"] = asyncio.run(candidates_data(db, args.repeat))
            port = free_port()
            p = subprocess.Popen([sys.executable, "-m", "ethen", "gateway", "--config", str(cfg), "--port",
                                  str(port)], env=env, stdout=(tmp / f"{name}.log").open("wb"),
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append(p)
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/api/gateway/v1/healthz", p, 120)
            login = httpx.post(f"{base}/ui/login", data={"admin_key": ADMIN_KEY})
            cookie = f"ethen_session={login.cookies['ethen_session']}"
            # the empty log draws no table rows or charts to wait for: HTTP only
            results[name] = {"rows": n, "http": http_times(base, cookie, args.repeat, p.pid),
                             "browser": browser_times(base, args.browser_repeat) if n else "not measured"}
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)
        shutil.rmtree(tmp, ignore_errors=True)
    full, empty = results["full"], results["empty"]
    print(f"\nHTTP, ms (median / p95 of {args.repeat}; warm keep-alive client; CPU: the gateway process's "
          f"CPU ms per call, from /proc; baseline: the same gateway config with an empty log, same run)")
    print(f"{'path':<64} {f'{args.rows} rows':>17} {'CPU':>6} {'empty log':>17} {'CPU':>6}")
    for path, (med, p95, cpu) in full["http"].items():
        e = empty["http"].get(path) or (empty["http"].get("/api/admin/v1/requests/none")
                                        if path.startswith("/api/admin/v1/requests/") else None)
        ref = f"{e[0]:7.1f} / {e[1]:7.1f} {e[2]:6.1f}" if e else "-"
        flag = "" if p95 < TARGET_MS or path == OLD_SPEND else "  > 300 ms"
        print(f"{path[:64]:<64} {med:7.1f} / {p95:7.1f} {cpu:6.1f} {ref:>24}{flag}")
    for name in ("full",):
        br = results[name]["browser"]
        if isinstance(br, str):
            print(f"\nbrowser ({name}): {br}")
            continue
        print(f"\nChromium, ms to load and draw each page ({name}: {results[name]['rows']} rows; median of "
              f"{args.browser_repeat})")
        for tab, ms in br.items():
            print(f"  {tab:<20} {ms:7.1f}{'' if ms < TARGET_MS else '  > 300 ms'}")
    cd = results.get("candidates data")
    if cd:
        b, w = statistics.median(cd["before"]), statistics.median(cd["now"])
        print(f"\nCandidates data in process (last hour of {args.rows} rows: query + 24 buckets; median of "
              f"{args.repeat}, alternated): JSON lists unnested by SQLite (before) {b:.1f} ms, the attempts "
              f"table (now) {w:.1f} ms: {b / w:.1f}x")
    worst = max(p95 for path, (_, p95, _) in full["http"].items() if path != OLD_SPEND)
    print(f"\nworst HTTP p95 with {args.rows} rows: {worst:.1f} ms (target < {TARGET_MS:.0f} ms per page)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
