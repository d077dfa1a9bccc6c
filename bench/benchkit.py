"""Shared pieces of the gateway benches (bench/hedging.py, bench/shadow.py, bench/response_cache.py): a free
loopback port, waiting for a child process to serve, a percentile, an open-loop load generator and a
Prometheus counter read by outcome. Imported as a sibling module (``python bench/x.py`` puts ``bench/`` on
``sys.path``)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

__all__ = [
    "Reply", "counter_by_outcome", "free_port", "ok_latencies", "open_loop", "percentile", "stop_all",
    "wait_ready",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Poll ``url`` until it answers below 500; fail if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by the nearest index; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q * (len(s) - 1))))]


@dataclass(frozen=True, slots=True)
class Reply:
    """One request of an open-loop run: its index, HTTP status (0: transport error or timeout), latency from
    its intended start (ms) and the response headers (lower-case names)."""

    i: int
    status: int
    latency_ms: float
    headers: Mapping[str, str]


def open_loop(url: str, body: bytes, total: int, rate: float,
              headers: Callable[[int], Mapping[str, str]], timeout_s: float = 30) -> list[Reply]:
    """Open-loop load (no coordinated omission): request ``i`` leaves at ``start + i / rate`` whatever the
    others are doing, and its latency counts from that intended start. ``headers(i)`` gives its headers."""
    import aiohttp
    import uvloop

    replies: list[Reply] = []

    async def go() -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000), timeout=timeout) as s:
            clock = time.perf_counter

            async def one(i: int, intended: float) -> None:
                try:
                    async with s.post(url, data=body, headers=dict(headers(i))) as r:
                        await r.read()
                        got = {k.lower(): v for k, v in r.headers.items()}
                        replies.append(Reply(i, r.status, (clock() - intended) * 1000, got))
                except (aiohttp.ClientError, TimeoutError, OSError):
                    replies.append(Reply(i, 0, (clock() - intended) * 1000, {}))

            start = clock() + 0.05
            tasks = []
            for i in range(total):
                intended = start + i / rate
                delay = intended - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, intended)))
            await asyncio.gather(*tasks)

    uvloop.run(go())
    return sorted(replies, key=lambda r: r.i)


def counter_by_outcome(base: str, metric: str) -> dict[str, float]:
    """A Prometheus counter's samples by their ``outcome`` label, read from ``{base}/metrics``."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(metric + "{") and 'outcome="' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def ok_latencies(replies: list[Reply]) -> list[float]:
    """The latencies (ms) of the replies that answered 200."""
    return [r.latency_ms for r in replies if r.status == 200]


def stop_all(procs: list[subprocess.Popen[bytes]], wait_s: float = 10) -> None:
    """SIGTERM each still-running process group (started with ``start_new_session=True``), then SIGKILL the
    ones not gone after ``wait_s``."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
