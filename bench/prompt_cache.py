"""Prompt-cache benchmark (issue 45): what a 30-turn agent conversation costs through the gateway with prompt
caching (``[prompt_cache] auto_breakpoints = true`` and cache-aware scoring, the defaults) beside the same
conversation with ``auto_breakpoints = false`` and cache-blind scoring (``cache_aware_routing = false``).

Set-up (all on 127.0.0.1, each server its own process):
- two scripted upstreams (this file, ``--serve``) that bill a cached prompt prefix as the real ones do, on
  their own clock (the driver sets it before each request: the bench is not timed, a conversation's turns
  are ``TURN_S`` = 20 s apart on it, an agent's pace of generation and tool calls):
  * ``anthropic`` (Messages wire format, ``claude-sonnet-4-5``: input $3, cache write $3.75, cache read
    $0.30, output $15 per Mtok): the prompt is a list of blocks (tools, system blocks, message content
    blocks); a prefix is cached only where a ``cache_control`` breakpoint closes it and only from 1,024
    tokens on; a breakpoint reads the longest cached prefix ending at it or at one of the 20 blocks before it;
    entries live 5 minutes from their last use; billed ``cache_read_input_tokens``,
    ``cache_creation_input_tokens`` (the prompt up to the last breakpoint not read) and ``input_tokens``;
  * ``openai`` (chat wire format, ``gpt-4.1``: input $2, cached input $0.50, output $8 per Mtok), routed and
    cached as OpenAI's prompt-caching guide describes: a request's bucket is its ``prompt_cache_key`` (none
    is a key of its own) plus the hash of the prompt's first 256 tokens; each bucket has a home machine (a
    hash of the bucket, one of ``MACHINES`` = 8); a bucket that got more than ``OVERFLOW_PER_MIN`` = 15
    requests in the last 60 s (before this one) overflows: the request goes to one of the 8 machines drawn
    by a seeded RNG (reproducible; the home one included) instead of its home. Each machine has its own
    cache, by content (any prompt it served, whatever its key): the cached share is the longest common prefix
    with a prompt that machine served in the last 5 minutes, when it is >= 1,024 tokens, in steps of 128
    tokens (``prompt_tokens_details.cached_tokens``).
  Tokens are counted alike by both: 4 bytes of the canonical JSON of each block / message a token.
- one ethen gateway per configuration (fresh upstream caches each), model ``agent``.
- the conversation: a ~20k-token system prompt (~17k of instructions, ~3k of tools), then 30 turns, each
  adding a ~900-token user message and the ~100-token answer; turn i enters through chat, Responses and
  Messages in turn (i mod 3). Three scenarios:
  * ``claude-first``: one conversation, ``agent`` routed to both upstreams, the Anthropic route's quality
    higher, so the router starts there;
  * ``openai-first``: the same with equal quality (the OpenAI route is cheaper uncached);
  * ``openai-agents``: ``--conversations`` (8) concurrent conversations, each with the same system prompt and
    tools and its own user turns, interleaved round robin (conversation c's turn i at (i + c / 8) * 20 s on
    the upstream's clock), ``agent`` routed to the OpenAI upstream alone. Without a key they all share one
    bucket (8 x 3 = 24 requests a minute: over 15, so they overflow across the machines); with the
    gateway's per-conversation ``prompt_cache_key`` each conversation is its own bucket at 3 a minute.

Printed per scenario and configuration: the cost (from the upstreams' own bills at the list prices above),
the tokens read from / written to the caches (the upstreams' bills), the cached tokens the routing expected
(the receipts' ``expected_cached_tokens``, summed), the providers used and how many turns moved provider
(within a conversation); the ratio baseline / cached; for ``openai-agents`` how many requests overflowed.

Run:  .venv/bin/python bench/prompt_cache.py [--turns 30] [--conversations 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
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
STEP_TOKENS = 128  # OpenAI: the cached share grows in steps of 128 tokens
HEAD_TOKENS = 256  # OpenAI: a request is routed by a hash of its first 256 tokens (and its key)
MACHINES = 8  # OpenAI: the machines a bucket's requests may overflow to
OVERFLOW_PER_MIN = 15  # OpenAI: a bucket with more requests than this in the last 60 s overflows
OVERFLOW_SEED = 45
TURN_S = 20.0  # a conversation's turns are this far apart on the upstreams' clock
# $ per Mtok: input, cache write (5 min), cache read, output
PRICES = {"anthropic": (3.0, 3.75, 0.30, 15.0), "openai": (2.0, 2.0, 0.50, 8.0)}
REPLY = ("Done. I read the files, changed the parser to keep the offsets of each token, and ran the tests: "
         "all pass. Next I would look at the error messages of the lexer, which still name the wrong line "
         "when a string spans two lines; shall I go on with that, or first clean up the imports? ") * 1
TURN_RE = re.compile(r"TURN-(\d+)")
CONV_RE = re.compile(r"CONV-(\d+) TURN-")


def _tokens(obj: object) -> int:
    return max(1, len(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()) // BYTES_PER_TOKEN)


def _turn_of(obj: object) -> int:
    found = TURN_RE.findall(json.dumps(obj))
    return int(found[-1]) if found else -1


def _conv_of(obj: object) -> int:
    """The conversation a request belongs to (its user turns' ``CONV-c`` mark; conversation 0 has none)."""
    found = CONV_RE.findall(json.dumps(obj))
    return int(found[-1]) if found else 0


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


@dataclass
class OpenAIUpstream:
    """OpenAI's routing and caches: buckets, their home machines, overflow, one cache per machine."""

    machines: int = MACHINES
    rng: random.Random = field(default_factory=lambda: random.Random(OVERFLOW_SEED))
    #: bucket -> the times of its requests in the last 60 s
    recent: dict[str, deque[float]] = field(default_factory=dict)
    #: per machine: the hash of a cached prefix (1,024 tokens, then 128-token steps) -> when it expires
    caches: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.caches = [{} for _ in range(self.machines)]

    def route(self, bucket: str, now: float) -> tuple[int, bool]:
        """(machine, overflowed) for one request of ``bucket`` at ``now``."""
        times = self.recent.setdefault(bucket, deque())
        while times and times[0] <= now - 60.0:
            times.popleft()
        overflow = len(times) > OVERFLOW_PER_MIN
        times.append(now)
        if overflow:
            return self.rng.randrange(self.machines), True
        return int(hashlib.sha256(bucket.encode()).hexdigest()[:8], 16) % self.machines, False


def _prefix_hashes(prompt: bytes) -> list[str]:
    """The hashes of the prompt's prefixes of 1,024 tokens, 1,152, 1,280, ... (as long as the prompt)."""
    out: list[str] = []
    h = hashlib.sha256()
    pos = 0
    for end in range(MIN_CACHED * BYTES_PER_TOKEN, len(prompt) + 1, STEP_TOKENS * BYTES_PER_TOKEN):
        h.update(prompt[pos:end])
        pos = end
        out.append(h.hexdigest())
    return out


def openai_bill(up: OpenAIUpstream, body: Mapping[str, Any], now: float) -> dict[str, Any]:
    prompt = openai_prompt(body).encode()
    total = max(1, len(prompt) // BYTES_PER_TOKEN)
    head = hashlib.sha256(prompt[:HEAD_TOKENS * BYTES_PER_TOKEN]).hexdigest()
    machine, overflow = up.route(f"{body.get('prompt_cache_key')}|{head}", now)
    cache = up.caches[machine]
    prefixes = _prefix_hashes(prompt)
    # the longest cached prefix: prefixes are stored together, so the shorter ones live at least as long
    steps = next((i for i, d in enumerate(prefixes) if cache.get(d, 0.0) <= now), len(prefixes))
    cached = 0 if steps == 0 else MIN_CACHED + (steps - 1) * STEP_TOKENS
    if len(cache) > 200_000:
        for d in [d for d, exp in cache.items() if exp <= now]:
            del cache[d]
    for d in prefixes:
        cache[d] = now + TTL_S
    return {"prompt_tokens": total, "cached_tokens": min(cached, total), "machine": machine,
            "overflow": overflow}


def serve(kind: str, port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    bills: list[dict[str, Any]] = []
    acache: dict[str, float] = {}
    oup = OpenAIUpstream()
    clock: dict[str, float] = {}  # "now": the time the driver set (the real clock until it sets one)
    out_tokens = _tokens(REPLY)

    def now() -> float:
        return clock.get("now", time.time())

    async def messages(request: Request) -> Response:
        body = json.loads(await request.body())
        usage = {**anthropic_bill(acache, body, now()), "output_tokens": out_tokens}
        bills.append({"turn": _turn_of(body.get("messages")), "conv": _conv_of(body.get("messages")),
                      "usage": usage, "breakpoints": sum(marked for _, marked in anthropic_blocks(body))})
        return JSONResponse({"id": f"msg_{len(bills)}", "type": "message", "role": "assistant",
                             "model": body["model"], "content": [{"type": "text", "text": REPLY}],
                             "stop_reason": "end_turn", "stop_sequence": None, "usage": usage})

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        bill = openai_bill(oup, body, now())
        usage = {"prompt_tokens": bill["prompt_tokens"], "completion_tokens": out_tokens,
                 "total_tokens": bill["prompt_tokens"] + out_tokens,
                 "prompt_tokens_details": {"cached_tokens": bill["cached_tokens"]}}
        bills.append({"turn": _turn_of(body.get("messages")), "conv": _conv_of(body.get("messages")),
                      "usage": usage, "prompt_cache_key": body.get("prompt_cache_key"),
                      "machine": bill["machine"], "overflow": bill["overflow"]})
        return JSONResponse({"id": f"chatcmpl-{len(bills)}", "object": "chat.completion",
                             "created": int(time.time()), "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": REPLY}}],
                             "usage": usage})

    async def stats(request: Request) -> Response:
        return JSONResponse(bills[int(request.query_params.get("since", "0")):])

    async def set_clock(request: Request) -> Response:
        clock["now"] = float(json.loads(await request.body())["now"])
        return JSONResponse(clock)

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"]), Route("/stats", stats),
                            Route("/clock", set_clock, methods=["POST"])])
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


def user_message(turn: int, conv: int = 0) -> str:
    """Turn ``turn``'s user message of conversation ``conv`` (conversation 0's as in the first scenarios)."""
    if conv == 0:
        return f"TURN-{turn}: " + _words(f"user{turn}", 900 * BYTES_PER_TOKEN)
    return f"CONV-{conv} TURN-{turn}: " + _words(f"user{conv}-{turn}", 900 * BYTES_PER_TOKEN)


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
        return float(sum(t["usd"] for t in self.turns))

    @property
    def providers(self) -> list[str]:
        return [t["provider"] for t in self.turns]

    @property
    def moves(self) -> int:
        """Turns served by another provider than the conversation's previous turn."""
        last: dict[int, str] = {}
        n = 0
        for t in self.turns:
            n += t["conv"] in last and last[t["conv"]] != t["provider"]
            last[t["conv"]] = t["provider"]
        return n


def converse(base: str, turns: int, conversations: int, label: str, bills: dict[str, str]) -> Run:
    """Run ``conversations`` conversations of ``turns`` turns, interleaved round robin; each request is
    preceded by setting the upstreams' clock to its time."""
    histories: list[list[tuple[str, str]]] = [[] for _ in range(conversations)]
    apis = ("chat", "responses", "messages")
    seen = {kind: 0 for kind in bills}
    run = Run(label)
    for turn in range(turns):
        api = apis[turn % 3]
        for conv, history in enumerate(histories):
            at = (turn + conv / conversations) * TURN_S
            for url in bills.values():
                httpx.post(f"{url}/clock", json={"now": at}, timeout=5).raise_for_status()
            history.append(("user", user_message(turn, conv)))
            path, body = request(api, history)
            r = httpx.post(f"{base}/{path}", json=body, headers=HEADERS, timeout=60)
            if r.status_code != 200:
                raise RuntimeError(f"conversation {conv} turn {turn} ({api}): {r.status_code} {r.text[:500]}")
            out = r.json()
            history.append(("assistant", reply_text(api, out)))
            served = None
            for kind, url in bills.items():
                got = httpx.get(f"{url}/stats", params={"since": seen[kind]}, timeout=5).json()
                for bill in got:
                    served = (kind, bill)
                seen[kind] += len(got)
            assert served is not None and (served[1]["turn"], served[1]["conv"]) == (turn, conv), \
                (conv, turn, served)
            usd, read, write = cost_usd(served[0], served[1]["usage"])
            receipt = (out.get("ethen") or {}).get("routing") or {}
            run.turns.append({"turn": turn, "conv": conv, "api": api, "provider": served[0], "usd": usd,
                              "read": read, "write": write,
                              "expected_cached": receipt.get("expected_cached_tokens"),
                              "overflow": served[1].get("overflow", False),
                              "key": served[1].get("prompt_cache_key")})
    return run


def write_config(path: Path, urls: dict[str, str], claude_quality: float | None, aware: bool) -> None:
    """The gateway's config; ``claude_quality`` None: ``agent`` routed to the OpenAI upstream alone."""
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    flag = "true" if aware else "false"
    info = "context_window = 200000, max_output_tokens = 8192, supports_tools = true"
    claude = "" if claude_quality is None else f"""[[routes]]
model = "agent"
provider = "anthropic"
upstream_model = "claude-sonnet-4-5"
info = {{ {info}, quality = {claude_quality} }}
prices = {{ input_per_mtok = 3.0, output_per_mtok = 15.0 }}

"""
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

{claude}[[routes]]
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


SCENARIOS: dict[str, tuple[float | None, bool]] = {  # name: (the Anthropic route's quality, many agents)
    "claude-first": (0.95, False), "openai-first": (0.8, False), "openai-agents": (None, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--conversations", type=int, default=8,
                    help="concurrent conversations of the openai-agents scenario (default 8)")
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                    help="run only this scenario (repeatable; default: all)")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    if args.turns < 1 or args.conversations < 1:
        ap.error("--turns and --conversations must be >= 1")

    tmp = Path(tempfile.mkdtemp(prefix="ethen-bench-pcache-"))
    env = {**os.environ, "BENCH_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONPATH": str(ROOT)}
    print(f"system prompt + tools: ~{_tokens(SYSTEM) + sum(_tokens(t) for t in TOOLS)} tokens; "
          f"a turn adds ~{_tokens(user_message(0)) + _tokens(REPLY)} tokens; {args.turns} turns")
    results: list[tuple[str, int, Run, Run]] = []
    try:
        for scenario in args.scenario or list(SCENARIOS):
            quality, agents = SCENARIOS[scenario]
            conversations = args.conversations if agents else 1
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
                    runs.append(converse(f"{root}/api/gateway/v1", args.turns, conversations, label, urls))
                finally:
                    stop_all(procs)
            results.append((scenario, conversations, runs[0], runs[1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for scenario, conversations, cached, base in results:
        many = f"{conversations} conversations x " if conversations > 1 else ""
        print(f"\n{scenario}: {many}{args.turns} turns (chat, Responses, Messages in turn)")
        print(f"{'config':9} {'cost $':>9} {'read tok':>9} {'write tok':>9} {'expected':>9} {'moves':>5}  "
              "providers")
        for run in (cached, base):
            used = ", ".join(f"{k} x{run.providers.count(k)}" for k in dict.fromkeys(run.providers))
            expected = sum(t["expected_cached"] or 0 for t in run.turns)
            print(f"{run.label:9} {run.cost:9.4f} {sum(t['read'] for t in run.turns):9} "
                  f"{sum(t['write'] for t in run.turns):9} {expected:9} {run.moves:5}  {used}")
        if conversations > 1:
            for run in (cached, base):
                keys = {t["key"] for t in run.turns}
                n = sum(t["overflow"] for t in run.turns)
                print(f"{run.label}: {n} of {len(run.turns)} requests overflowed (sent to a drawn machine, "
                      f"not their home); {len(keys)} prompt_cache_key value(s)"
                      + (" (none)" if keys == {None} else ""))
        print(f"baseline / cached: {base.cost / cached.cost:.2f}x")
    cached_total = sum(c.cost for _, _, c, _ in results)
    base_total = sum(b.cost for _, _, _, b in results)
    print(f"\nscenarios together ({len(results)}): cached ${cached_total:.4f}, baseline ${base_total:.4f}: "
          f"{base_total / cached_total:.2f}x")


if __name__ == "__main__":
    main()
