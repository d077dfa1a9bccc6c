"""Prompt-cache benchmark (issue 45): what a 30-turn agent conversation costs through the gateway with prompt
caching (``[prompt_cache] auto_breakpoints = true`` and cache-aware scoring, the defaults) beside the same
conversation with ``auto_breakpoints = false`` and cache-blind scoring (``cache_aware_routing = false``).

Set-up (all on 127.0.0.1, each server its own process):
- two scripted upstreams (this file, ``--serve``) that bill a cached prompt prefix as the real ones do:
  * ``anthropic`` (Messages wire format, ``claude-sonnet-4-5``: input $3, cache write $3.75, cache read
    $0.30, output $15 per Mtok): the prompt is a list of blocks (tools, system blocks, message content
    blocks); a prefix is cached only where a ``cache_control`` breakpoint closes it and only from 1,024
    tokens on; a breakpoint reads the longest cached prefix ending at it or at one of the 20 blocks before it;
    entries live 5 minutes from their last use; billed ``cache_read_input_tokens``,
    ``cache_creation_input_tokens`` (the prompt up to the last breakpoint not read) and ``input_tokens``;
  * ``openai`` (chat wire format, ``gpt-4.1``: input $2, cached input $0.50, output $8 per Mtok): requests
    are routed to a cache by ``prompt_cache_key`` plus the hash of the prompt's first 256 tokens; the cached
    share is the longest common prefix with a prompt seen there in the last 5 minutes, when it is >= 1,024
    tokens, in steps of 128 tokens (``prompt_tokens_details.cached_tokens``).
  Tokens are counted alike by both: 4 bytes of the canonical JSON of each block / message a token.
- one ethen gateway per configuration (fresh upstream caches each), model ``agent`` routed to both upstreams.
- the conversation: a ~20k-token system prompt (~17k of instructions, ~3k of tools), then 30 turns, each
  adding a ~900-token user message and the ~100-token answer; turn i enters through chat, Responses and
  Messages in turn (i mod 3). Two scenarios: ``claude-first`` (the Anthropic route's quality is higher, so
  the router starts there) and ``openai-first`` (equal quality; the OpenAI route is cheaper uncached).

Printed per scenario and configuration: the cost (from the upstreams' own bills at the list prices above),
the tokens read from / written to the caches (the upstreams' bills), the cached tokens the routing expected
(the receipts' ``expected_cached_tokens``, summed), the providers used and how many turns moved provider;
the ratio baseline / cached.

Run:  .venv/bin/python bench/prompt_cache.py [--turns 30]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import free_port, stop_all, wait_ready

ROOT = Path(__file__).resolve().parent.parent
CLIENT_KEY = "ethen-bench-pcache-0123456789abcdef0123456789"
UPSTREAM_KEY = "sk-bench-pcache"
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"}
BYTES_PER_TOKEN = 4
TTL_S = 300.0
LOOKBACK_BLOCKS = 20
MIN_CACHED = 1024
# $ per Mtok: input, cache write (5 min), cache read, output
PRICES = {"anthropic": (3.0, 3.75, 0.30, 15.0), "openai": (2.0, 2.0, 0.50, 8.0)}
REPLY = ("Done. I read the files, changed the parser to keep the offsets of each token, and ran the tests: "
         "all pass. Next I would look at the error messages of the lexer, which still name the wrong line "
         "when a string spans two lines; shall I go on with that, or first clean up the imports? ") * 1
TURN_RE = re.compile(r"TURN-(\d+)")


def _tokens(obj: object) -> int:
    return max(1, len(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()) // BYTES_PER_TOKEN)


def _turn_of(obj: object) -> int:
    found = TURN_RE.findall(json.dumps(obj))
    return int(found[-1]) if found else -1


# --- the scripted upstreams (their own processes) ---------------------------------------------------------


def anthropic_blocks(body: Mapping[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """The prompt as Anthropic caches it: tools, system blocks, message content blocks, in order, each with
    whether a ``cache_control`` breakpoint closes it (the mark itself is not part of the prompt)."""
    out: list[tuple[dict[str, Any], bool]] = []

    def block(b: Mapping[str, Any], **extra: Any) -> None:
        out.append(({**extra, **{k: v for k, v in b.items() if k != "cache_control"}}, "cache_control" in b))

    for tool in body.get("tools") or []:
        block(tool, part="tool")
    system = body.get("system") or []
    for b in [{"type": "text", "text": system}] if isinstance(system, str) else system:
        block(b, part="system")
    for m in body.get("messages") or []:
        content = m.get("content")
        for b in [{"type": "text", "text": content}] if isinstance(content, str) else content or []:
            block(b, role=m.get("role"))
    if "cache_control" in body and out:  # automatic caching: the last block
        out[-1] = (out[-1][0], True)
    return out


def anthropic_bill(cache: dict[str, float], body: Mapping[str, Any], now: float) -> dict[str, int]:
    blocks = anthropic_blocks(body)
    cum: list[int] = []
    hashes: list[str] = []
    h = hashlib.sha256()
    total = 0
    for b, _ in blocks:
        total += _tokens(b)
        h.update(json.dumps(b, sort_keys=True).encode())
        cum.append(total)
        hashes.append(h.copy().hexdigest())
    for k in [k for k, exp in cache.items() if exp <= now]:
        del cache[k]
    marks = [i for i, (_, marked) in enumerate(blocks) if marked]
    read = 0
    for bp in marks:
        for j in range(bp, max(-1, bp - LOOKBACK_BLOCKS - 1), -1):
            if hashes[j] in cache:
                read = max(read, cum[j])
                cache[hashes[j]] = now + TTL_S  # a hit refreshes the entry
                break
    cacheable = [bp for bp in marks if cum[bp] >= MIN_CACHED]
    write = max(0, cum[cacheable[-1]] - read) if cacheable else 0
    for bp in cacheable:
        cache[hashes[bp]] = now + TTL_S
    return {"input_tokens": total - read - write, "cache_read_input_tokens": read,
            "cache_creation_input_tokens": write}


def openai_prompt(body: Mapping[str, Any]) -> str:
    """The chat prompt as one canonical string (tools, then each message's role and text)."""
    parts = []
    for tool in body.get("tools") or []:
        fn = tool.get("function", tool)
        keep = {k: fn.get(k) for k in ("name", "description", "parameters")}
        parts.append(json.dumps(keep, sort_keys=True))
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(json.dumps({"role": m.get("role"), "content": content or ""}, sort_keys=True))
    return "\n".join(parts)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def openai_bill(cache: dict[str, list[tuple[str, float]]], body: Mapping[str, Any],
                now: float) -> dict[str, int]:
    prompt = openai_prompt(body)
    total = max(1, len(prompt.encode()) // BYTES_PER_TOKEN)
    head = hashlib.sha256(prompt[:256 * BYTES_PER_TOKEN].encode()).hexdigest()  # the first 256 tokens
    where = f"{body.get('prompt_cache_key')}|{head}"
    seen = [(p, exp) for p, exp in cache.get(where, []) if exp > now]
    best = max((_common(p, prompt) for p, _ in seen), default=0)
    tokens = best // BYTES_PER_TOKEN
    cached = 0 if tokens < MIN_CACHED else MIN_CACHED + (tokens - MIN_CACHED) // 128 * 128
    cache[where] = [*seen[-3:], (prompt, now + TTL_S)]
    return {"prompt_tokens": total, "cached_tokens": min(cached, total)}


def serve(kind: str, port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    bills: list[dict[str, Any]] = []
    acache: dict[str, float] = {}
    ocache: dict[str, list[tuple[str, float]]] = {}
    out_tokens = _tokens(REPLY)

    async def messages(request: Request) -> Response:
        body = json.loads(await request.body())
        usage = {**anthropic_bill(acache, body, time.time()), "output_tokens": out_tokens}
        bills.append({"turn": _turn_of(body.get("messages")), "usage": usage,
                      "breakpoints": sum(marked for _, marked in anthropic_blocks(body))})
        return JSONResponse({"id": f"msg_{len(bills)}", "type": "message", "role": "assistant",
                             "model": body["model"], "content": [{"type": "text", "text": REPLY}],
                             "stop_reason": "end_turn", "stop_sequence": None, "usage": usage})

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        bill = openai_bill(ocache, body, time.time())
        usage = {"prompt_tokens": bill["prompt_tokens"], "completion_tokens": out_tokens,
                 "total_tokens": bill["prompt_tokens"] + out_tokens,
                 "prompt_tokens_details": {"cached_tokens": bill["cached_tokens"]}}
        bills.append({"turn": _turn_of(body.get("messages")), "usage": usage,
                      "prompt_cache_key": body.get("prompt_cache_key")})
        return JSONResponse({"id": f"chatcmpl-{len(bills)}", "object": "chat.completion",
                             "created": int(time.time()), "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": REPLY}}],
                             "usage": usage})

    async def stats(request: Request) -> Response:
        return JSONResponse(bills)

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"]), Route("/stats", stats)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def cost_usd(kind: str, usage: Mapping[str, Any]) -> tuple[float, int, int]:
    """(dollars, cache-read tokens, cache-write tokens) of one bill at the list prices."""
    inp, wr, rd, out = PRICES[kind]
    if kind == "anthropic":
        r, w = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        usd = usage["input_tokens"] * inp + w * wr + r * rd + usage["output_tokens"] * out
        return usd / 1e6, r, w
    r = usage["prompt_tokens_details"]["cached_tokens"]
    usd = (usage["prompt_tokens"] - r) * inp + r * rd + usage["completion_tokens"] * out
    return usd / 1e6, r, 0


# --- the conversation -------------------------------------------------------------------------------------


def _words(seed: str, n_bytes: int) -> str:
    """Deterministic varied prose of about ``n_bytes`` bytes."""
    out: list[str] = []
    size = 0
    i = 0
    while size < n_bytes:
        word = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[: 3 + i % 7]
        out.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(out)


SYSTEM = ("You are a careful coding agent. Follow the rules below.\n"
          + _words("system", 17_000 * BYTES_PER_TOKEN))
TOOLS = [{"name": f"tool_{k}", "description": _words(f"tool{k}", 1_000),
          "parameters": {"type": "object", "properties": {
              "path": {"type": "string", "description": _words(f"path{k}", 80)},
              "query": {"type": "string", "description": _words(f"query{k}", 80)}},
              "required": ["path"]}} for k in range(10)]  # ~3k tokens


def user_message(turn: int) -> str:
    return f"TURN-{turn}: " + _words(f"user{turn}", 900 * BYTES_PER_TOKEN)


def request(api: str, history: list[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
    """The path and body of one turn entering through ``api`` (chat, responses or messages)."""
    if api == "chat":
        return "chat/completions", {
            "model": "agent", "max_tokens": 200,
            "tools": [{"type": "function", "function": t} for t in TOOLS],
            "messages": [{"role": "system", "content": SYSTEM},
                         *({"role": r, "content": c} for r, c in history)]}
    if api == "responses":
        return "responses", {
            "model": "agent", "max_output_tokens": 200, "instructions": SYSTEM,
            "tools": [{"type": "function", **t} for t in TOOLS],
            "input": [{"role": r, "content": c} for r, c in history]}
    return "messages", {
        "model": "agent", "max_tokens": 200, "system": SYSTEM,
        "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                  for t in TOOLS],
        "messages": [{"role": r, "content": c} for r, c in history]}


def reply_text(api: str, body: Mapping[str, Any]) -> str:
    if api == "chat":
        return str(body["choices"][0]["message"]["content"])
    if api == "responses":
        return "".join(p.get("text", "") for item in body["output"] if item.get("type") == "message"
                       for p in item["content"])
    return "".join(b.get("text", "") for b in body["content"] if b.get("type") == "text")


@dataclass
class Run:
    label: str
    turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cost(self) -> float:
        return sum(t["usd"] for t in self.turns)

    @property
    def providers(self) -> list[str]:
        return [t["provider"] for t in self.turns]

    @property
    def moves(self) -> int:
        p = self.providers
        return sum(1 for a, b in itertools.pairwise(p) if a != b)


def converse(base: str, turns: int, label: str, bills: dict[str, str]) -> Run:
    history: list[tuple[str, str]] = []
    apis = ("chat", "responses", "messages")
    seen = {kind: 0 for kind in bills}
    run = Run(label)
    for turn in range(turns):
        api = apis[turn % 3]
        history.append(("user", user_message(turn)))
        path, body = request(api, history)
        r = httpx.post(f"{base}/{path}", json=body, headers=HEADERS, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"turn {turn} ({api}): {r.status_code} {r.text[:500]}")
        out = r.json()
        history.append(("assistant", reply_text(api, out)))
        served = None
        for kind, url in bills.items():
            got = httpx.get(f"{url}/stats", timeout=5).json()
            for bill in got[seen[kind]:]:
                served = (kind, bill)
            seen[kind] = len(got)
        assert served is not None and served[1]["turn"] == turn, (turn, served)
        usd, read, write = cost_usd(served[0], served[1]["usage"])
        receipt = (out.get("ethen") or {}).get("routing") or {}
        run.turns.append({"turn": turn, "api": api, "provider": served[0], "usd": usd, "read": read,
                          "write": write, "expected_cached": receipt.get("expected_cached_tokens")})
    return run


def write_config(path: Path, urls: dict[str, str], claude_quality: float, aware: bool) -> None:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    flag = "true" if aware else "false"
    info = "context_window = 200000, max_output_tokens = 8192, supports_tools = true"
    path.write_text(f"""
[[providers]]
id = "anthropic"
kind = "anthropic"
base_url = "{urls['anthropic']}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"

[[providers]]
id = "openai"
kind = "openai_compat"
base_url = "{urls['openai']}/v1"
api_key_env = "BENCH_UPSTREAM_KEY"

[[routes]]
model = "agent"
provider = "anthropic"
upstream_model = "claude-sonnet-4-5"
info = {{ {info}, quality = {claude_quality} }}
prices = {{ input_per_mtok = 3.0, output_per_mtok = 15.0 }}

[[routes]]
model = "agent"
provider = "openai"
upstream_model = "gpt-4.1"
info = {{ {info}, quality = 0.8 }}
prices = {{ input_per_mtok = 2.0, output_per_mtok = 8.0 }}

[circuit]
probe = false

[prompt_cache]
auto_breakpoints = {flag}
cache_aware_routing = {flag}

[[api_keys]]
name = "bench"
sha256 = "{digest}"
""")


def spawn(procs: list[subprocess.Popen[bytes]], cmd: list[str], log: Path,
          env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(env), cwd=ROOT,
                             start_new_session=True)
    procs.append(p)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return

    tmp = Path(tempfile.mkdtemp(prefix="ethen-bench-pcache-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
    print(f"system prompt + tools: ~{_tokens(SYSTEM) + sum(_tokens(t) for t in TOOLS)} tokens; "
          f"a turn adds ~{_tokens(user_message(0)) + _tokens(REPLY)} tokens; {args.turns} turns")
    results: list[tuple[str, Run, Run]] = []
    try:
        for scenario, quality in (("claude-first", 0.95), ("openai-first", 0.8)):
            runs: list[Run] = []
            for label, aware in (("cached", True), ("baseline", False)):
                procs: list[subprocess.Popen[bytes]] = []
                try:
                    urls: dict[str, str] = {}
                    for kind in ("anthropic", "openai"):
                        port = free_port()
                        p = spawn(procs, [sys.executable, __file__, "--serve", kind, str(port)],
                                  tmp / f"{kind}.log", env)
                        urls[kind] = f"http://127.0.0.1:{port}"
                        wait_ready(f"{urls[kind]}/stats", p, 30)
                    cfg = tmp / f"{scenario}-{label}.toml"
                    write_config(cfg, urls, quality, aware)
                    gport = free_port()
                    cmd = [sys.executable, "-m", "ethen", "gateway", "--config", str(cfg),
                           "--port", str(gport)]
                    p = spawn(procs, cmd, tmp / f"{scenario}-{label}.log", env)
                    root = f"http://127.0.0.1:{gport}"
                    wait_ready(f"{root}/api/gateway/v1/healthz", p, 60)
                    runs.append(converse(f"{root}/api/gateway/v1", args.turns, label, urls))
                finally:
                    stop_all(procs)
            results.append((scenario, runs[0], runs[1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for scenario, cached, base in results:
        print(f"\n{scenario}: {args.turns} turns (chat, Responses, Messages in turn)")
        print(f"{'config':9} {'cost $':>9} {'read tok':>9} {'write tok':>9} {'expected':>9} {'moves':>5}  "
              "providers")
        for run in (cached, base):
            used = ", ".join(f"{k} x{run.providers.count(k)}" for k in dict.fromkeys(run.providers))
            expected = sum(t["expected_cached"] or 0 for t in run.turns)
            print(f"{run.label:9} {run.cost:9.4f} {sum(t['read'] for t in run.turns):9} "
                  f"{sum(t['write'] for t in run.turns):9} {expected:9} {run.moves:5}  {used}")
        print(f"baseline / cached: {base.cost / cached.cost:.2f}x")
    cached_total = sum(c.cost for _, c, _ in results)
    base_total = sum(b.cost for _, _, b in results)
    print(f"\nboth scenarios: cached ${cached_total:.4f}, baseline ${base_total:.4f}: "
          f"{base_total / cached_total:.2f}x")


if __name__ == "__main__":
    main()
