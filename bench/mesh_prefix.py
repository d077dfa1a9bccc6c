"""Prefix reuse on ``ethen up``'s mesh (issue 45 item 3): time to first token of a request whose ~1,500-token
prefix nobody holds, then of a second request sharing that prefix (its workers seed their KV caches from
their prefix caches and compute only the suffix); the second's greedy text is checked against the
single-process model's (no mesh, no cache).

.venv/bin/python bench/mesh_prefix.py [--prefix-tokens 1500] [--rounds 3] [--max-tokens 16]

``ethen up --port 0`` in a temporary data directory (the model's weight cache is the usual one); each round
uses a fresh random nonce at the start of the shared system prompt, so its first request is cold. Requests are
streamed chat completions (temperature 0) through the gateway; TTFT is from sending to the first content
delta. Medians over the rounds; the route's ``cached_tokens`` and ``prefix_holders`` come from the receipt.

``--gap`` (default 6 s) separates the two requests: a worker's load is its busy fraction over 5 s, and with
the spec's weights a just-busy holder's load term (up to 120) outweighs the prompt term the prefix saves
(``10 * 1472 / 1024`` = 14.4), so right after the first prefill the route may avoid the holders (``--gap 0``
shows it: the second request is then prefilled in full on another chain, same tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ethen.model import SamplingParams, generate, load_model, model_step

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"^Ethen is up\b.*: (http\S+)$", re.M)
KEY = re.compile(r"^API key \([^)]*\):\n  (\S+)$", re.M)
FILLER = ("Shipping policy, section {i}: parcels are weighed at the depot, labelled with a tracking number, "
          "and handed to the carrier before noon; damaged boxes are photographed and reported. ")


def start_up(data: str) -> tuple[subprocess.Popen[str], str, str]:
    env = {**os.environ, "ETHEN_DATA_DIR": data, "PYTHONPATH": str(ROOT)}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C stops") or time.monotonic() > deadline:
            break
    text = "\n".join(lines)
    url, key = URL.search(text), KEY.search(text)
    if url is None or key is None:
        proc.kill()
        raise RuntimeError(f"ethen up did not come up:\n{text}")
    return proc, url.group(1), key.group(1)


def chat(url: str, key: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, Any]:
    """(TTFT s, text, the receipt's mesh route) of one streamed greedy chat completion."""
    body = json.dumps({"model": "ethen/auto", "temperature": 0, "max_tokens": max_tokens, "stream": True,
                       "messages": messages}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", body, {"Authorization": f"Bearer {key}",
                                                                    "Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft: float | None = None
    text, route = "", None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += delta
            mesh = ((event.get("ethen") or {}).get("routing") or {}).get("mesh")
            if mesh:
                route = mesh.get("route")
    assert ttft is not None, "no content streamed"
    return ttft, text, route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gap", type=float, default=6.0,
                    help="seconds between the two requests (the workers' load window is 5 s)")
    args = ap.parse_args()
    model = load_model()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def system_prompt(nonce: str) -> str:
        text, i = f"Session {nonce}. ", 0
        while len(model.tokenizer.encode(text)) < args.prefix_tokens:
            text += FILLER.format(i=i)
            i += 1
        return text

    def reference(messages: list[dict[str, str]]) -> str:
        ids = model.tokenizer.encode(model.chat_template.render(messages, add_generation_prompt=True))
        return generate(model_step(model), model.tokenizer, ids, greedy, model.config.context_length).text

    firsts, seconds, same = [], [], []
    with tempfile.TemporaryDirectory(prefix="ethen-bench-prefix-") as data:
        proc, url, key = start_up(data)
        try:
            chat(url, key, [{"role": "user", "content": "Hello"}], 4)  # warm-up: channels, head, route
            for r in range(args.rounds):
                system = system_prompt(secrets.token_hex(4))
                one = [{"role": "system", "content": system},
                       {"role": "user", "content": "Where is my parcel?"}]
                two = [{"role": "system", "content": system},
                       {"role": "user", "content": "How do I report a damaged box?"}]
                t1, _, route1 = chat(url, key, one, args.max_tokens)
                time.sleep(args.gap)  # Health reports the prefix; the holders' load term decays
                t2, text2, route2 = chat(url, key, two, args.max_tokens)
                ok = text2 == reference(two)
                firsts.append(t1)
                seconds.append(t2)
                same.append(ok)
                cached1 = route1 and route1["cached_tokens"]
                print(f"round {r + 1}: first TTFT {t1 * 1000:.0f} ms (cached {cached1}),"
                      f" second {t2 * 1000:.0f} ms (cached {route2 and route2['cached_tokens']}, holders "
                      f"{route2 and route2['prefix_holders']}), {t1 / t2:.1f}x, same greedy text: {ok}")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    m1, m2 = statistics.median(firsts), statistics.median(seconds)
    print(f"median TTFT: first {m1 * 1000:.0f} ms, second {m2 * 1000:.0f} ms: {m1 / m2:.1f}x faster; "
          f"same greedy text in {sum(same)}/{len(same)} rounds")


if __name__ == "__main__":
    main()
