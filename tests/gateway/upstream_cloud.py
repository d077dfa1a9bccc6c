"""Scripted Gemini and Azure OpenAI upstreams (issue 26), served with the scripted OpenAI/Anthropic upstream
of :mod:`upstream` by one app on 127.0.0.1. Their wire formats follow the providers' public API references:

- Gemini: ``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse`` (each SSE
  ``data:`` a whole ``GenerateContentResponse``, no ``[DONE]``), the key in ``x-goog-api-key``, errors as
  ``{"error": {"code", "message", "status"}}``, a blocked prompt as ``promptFeedback.blockReason`` without
  candidates, ``usageMetadata`` with cached and thoughts tokens; explicit context caching: ``POST
  /v1beta/cachedContents`` (refused under a minimum size with Gemini's 400), and a generate call naming
  ``cachedContent`` answered over the cache's contents, refused (400) when it also sets
  ``systemInstruction``, ``tools`` or ``toolConfig``, 403 when the cache is unknown or gone (its cached
  tokens in ``cachedContentTokenCount`` and ``promptTokenCount``);
- Azure OpenAI: ``POST /openai/deployments/{deployment}/chat/completions?api-version=...``, the key in
  ``api-key``, a missing ``api-version`` 404, the content filter's 400 (``code: content_filter`` with
  ``innererror.content_filter_result``) and ``finish_reason: content_filter``.

Behaviour per model (Gemini) / deployment (Azure): :class:`CloudBehavior`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ethen.app import create_app
from ethen.gateway.config import parse_config
from tests.gateway.service_harness import ENV, PROVIDER_KEY, Live, config_dict
from tests.gateway.upstream import Behavior, Script, ServerThread, _Cut, _failure, make_upstream_app

__all__ = ["AZURE_VERSION", "CloudBehavior", "cache_tokens", "cloud_app", "live_cloud"]

AZURE_VERSION = "2024-10-21"
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}  # fmt: skip


@dataclass
class CloudBehavior(Behavior):
    cached_tokens: int = 0  # Gemini cachedContentTokenCount
    thoughts_tokens: int = 0  # Gemini thoughtsTokenCount
    block_reason: str | None = None  # Gemini: the prompt is blocked (promptFeedback.blockReason)
    finish: str = "STOP"  # Gemini finishReason of a text answer
    signature: str | None = None  # Gemini: the thoughtSignature on a functionCall part
    content_filter: bool = False  # Azure: the prompt is refused by the content filter (400)
    filter_completion: bool = False  # Azure: the completion is cut by the filter (finish_reason)
    cache_min_tokens: int = 0  # Gemini: cachedContents under this many tokens is refused (400)
    cache_fail_status: int | None = None  # Gemini: cachedContents answers this status
    cache_gone: bool = False  # Gemini: every cache is gone (a generate call naming one gets 403)
    cache_latency_s: float = 0.0  # Gemini: cachedContents answers after this delay


def cache_tokens(cached: dict[str, Any]) -> int:
    """The scripted Gemini's token count of a cache: 4 bytes of its JSON a token."""
    keys = ("contents", "systemInstruction", "tools", "toolConfig")
    return len(json.dumps({k: cached[k] for k in keys if k in cached}).encode()) // 4


def _gemini_call(body: dict[str, Any], b: Behavior) -> dict[str, Any] | None:
    decls = [d for t in body.get("tools") or () for d in t.get("functionDeclarations") or ()]
    if not decls or not b.tool_call:
        return None
    names = [d["name"] for d in decls]
    if b.tool_name is not None and b.tool_name not in names:
        return None
    last = (body.get("contents") or [{}])[-1]
    if b.answer_tool_results and any("functionResponse" in p for p in last.get("parts") or ()):
        return None
    part: dict[str, Any] = {
        "functionCall": {"name": b.tool_name or names[0], "args": json.loads(b.tool_args)}
    }
    if isinstance(b, CloudBehavior) and b.signature:
        part["thoughtSignature"] = b.signature
    return part


def _usage(b: Behavior, cached: int = 0) -> dict[str, Any]:
    prompt = b.prompt_tokens + cached
    out: dict[str, Any] = {"promptTokenCount": prompt, "candidatesTokenCount": len(b.pieces),
                           "totalTokenCount": prompt + len(b.pieces)}  # fmt: skip
    if cached:
        out["cachedContentTokenCount"] = cached
    elif isinstance(b, CloudBehavior) and b.cached_tokens:
        out["cachedContentTokenCount"] = b.cached_tokens
    if isinstance(b, CloudBehavior) and b.thoughts_tokens:
        out["thoughtsTokenCount"] = b.thoughts_tokens
        out["totalTokenCount"] += b.thoughts_tokens
    return out


def _google_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message,
                                   "status": _GOOGLE_STATUS.get(status, "UNKNOWN")}}, status_code=status)


def _gemini_routes(script: Script) -> list[Route]:
    caches: dict[str, dict[str, Any]] = {}  # name -> the cachedContents body and its token count

    async def cached_contents(request: Request) -> Response:
        body = json.loads(await request.body())
        if script.record:
            script.calls.append({"path": "gemini:cachedContents", "body": body,
                                 "headers": dict(request.headers)})
        if request.headers.get("x-goog-api-key") != PROVIDER_KEY:
            return _google_error(400, "API key not valid. Please pass a valid API key.")
        model = str(body.get("model", "")).removeprefix("models/")
        b = script.behavior(model)
        cb = b if isinstance(b, CloudBehavior) else CloudBehavior()
        await asyncio.sleep(cb.cache_latency_s)
        if cb.cache_fail_status is not None:
            return _google_error(cb.cache_fail_status, f"scripted failure {cb.cache_fail_status}")
        tokens = cache_tokens(body)
        if tokens < cb.cache_min_tokens:
            return _google_error(400, f"Cached content is too small. total_token_count={tokens}, "
                                      f"min_total_token_count={cb.cache_min_tokens}")
        ttl = float(str(body.get("ttl", "3600s")).removesuffix("s"))
        name = f"cachedContents/c{len(caches) + 1}"
        caches[name] = {**body, "tokens": tokens}
        expire = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + ttl)) + ".123456789Z"
        return JSONResponse({"name": name, "model": body.get("model"), "expireTime": expire,
                             "usageMetadata": {"totalTokenCount": tokens}})

    async def gemini(request: Request) -> Response:
        model, _, method = request.path_params["rest"].partition(":")
        body = json.loads(await request.body())
        if script.record:
            script.calls.append(
                {
                    "path": f"gemini:{method}",
                    "body": {**body, "model": model},
                    "headers": dict(request.headers),
                    "query": dict(request.query_params),
                }
            )
        b = script.behavior(model)
        if request.headers.get("x-goog-api-key") != PROVIDER_KEY:
            return JSONResponse(
                {
                    "error": {
                        "code": 400,
                        "message": "API key not valid. Please pass a valid API key.",
                        "status": "INVALID_ARGUMENT",
                    }
                },
                status_code=400,
            )
        status = _failure(b)
        if status is not None:
            return JSONResponse(
                {
                    "error": {
                        "code": status,
                        "message": f"scripted failure {status}",
                        "status": _GOOGLE_STATUS.get(status, "UNKNOWN"),
                    }
                },
                status_code=status,
            )
        cb = b if isinstance(b, CloudBehavior) else CloudBehavior()
        cached = 0
        if "cachedContent" in body:
            if any(k in body for k in ("systemInstruction", "tools", "toolConfig")):
                return _google_error(400, "CachedContent can not be used with GenerateContent request "
                                          "setting system_instruction, tools or tool_config.")
            cache = caches.get(str(body["cachedContent"]))
            if cache is None or cb.cache_gone:
                return _google_error(403, "CachedContent not found (or permission denied)")
            cached = cache["tokens"]
            body = {**{k: v for k, v in cache.items() if k not in ("model", "ttl", "tokens")}, **body,
                    "contents": [*cache.get("contents", ()), *body.get("contents", ())]}
        if cb.block_reason is not None:
            n = b.prompt_tokens
            blocked = {"promptFeedback": {"blockReason": cb.block_reason, "safetyRatings": []},
                       "usageMetadata": {"promptTokenCount": n, "totalTokenCount": n},
                       "modelVersion": model}  # fmt: skip
            if method == "generateContent":
                return JSONResponse(blocked)
            return StreamingResponse(
                iter([b"data: " + json.dumps(blocked).encode() + b"\r\n\r\n"]), media_type="text/event-stream"
            )
        call = _gemini_call(body, b)
        finish = "STOP" if call else cb.finish
        if method == "generateContent":
            parts = [call] if call else [{"text": "".join(b.pieces)}]
            return JSONResponse(
                {
                    "candidates": [
                        {
                            "content": {"role": "model", "parts": parts},
                            "finishReason": finish,
                            "index": 0,
                            "safetyRatings": [],
                        }
                    ],
                    "usageMetadata": _usage(b, cached),
                    "modelVersion": model,
                    "responseId": "gem-resp-1",
                }
            )
        if method != "streamGenerateContent" or request.query_params.get("alt") != "sse":
            return JSONResponse({"error": {"code": 404, "message": "not found", "status": "NOT_FOUND"}}, 404)

        def data(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"

        async def gen() -> AsyncIterator[bytes]:
            pieces: list[dict[str, Any]] = [call] if call else [{"text": p} for p in b.pieces]
            for i, part in enumerate(pieces):
                if b.cut_after is not None and i >= b.cut_after:
                    raise _Cut("scripted mid-stream cut")
                cand: dict[str, Any] = {"content": {"role": "model", "parts": [part]}, "index": 0}
                last = i == len(pieces) - 1
                if last:
                    cand["finishReason"] = finish
                usage = _usage(b, cached) if last else {"promptTokenCount": b.prompt_tokens + cached}
                yield data(
                    {
                        "candidates": [cand],
                        "usageMetadata": usage,
                        "modelVersion": model,
                        "responseId": "gem-resp-1",
                    }
                )

        return StreamingResponse(gen(), media_type="text/event-stream")

    return [Route("/v1beta/models/{rest:path}", gemini, methods=["POST"]),
            Route("/v1beta/cachedContents", cached_contents, methods=["POST"])]


async def _prefixed(first: bytes, resp: StreamingResponse) -> AsyncIterator[bytes]:
    yield first
    async for part in resp.body_iterator:
        yield part if isinstance(part, bytes) else str(part).encode()


def _azure_routes(script: Script, chat: Any, embeddings: Any) -> list[Route]:
    async def azure(request: Request) -> Response:
        deployment = request.path_params["deployment"]
        if request.headers.get("api-key") != PROVIDER_KEY:
            return JSONResponse(
                {
                    "error": {
                        "code": "401",
                        "message": "Access denied due to invalid subscription key or wrong API endpoint.",
                    }
                },
                status_code=401,
            )
        if not request.query_params.get("api-version"):
            return JSONResponse({"error": {"code": "404", "message": "Resource not found"}}, status_code=404)
        b = script.behavior(deployment)
        body = json.loads(await request.body())
        if isinstance(b, CloudBehavior) and b.content_filter:
            if script.record:
                script.calls.append(
                    {
                        "path": "azure",
                        "body": body,
                        "headers": dict(request.headers),
                        "query": dict(request.query_params),
                    }
                )
            return JSONResponse(
                {
                    "error": {
                        "message": "The response was filtered due to the prompt triggering Azure OpenAI's "
                        "content management policy. Please modify your prompt and retry.",
                        "type": None,
                        "param": "prompt",
                        "code": "content_filter",
                        "status": 400,
                        "innererror": {
                            "code": "ResponsibleAIPolicyViolation",
                            "content_filter_result": {
                                "hate": {"filtered": False, "severity": "safe"},
                                "self_harm": {"filtered": False, "severity": "safe"},
                                "sexual": {"filtered": False, "severity": "safe"},
                                "violence": {"filtered": True, "severity": "medium"},
                            },
                        },
                    }
                },
                status_code=400,
            )
        body["model"] = deployment  # the scripted chat handler looks its behaviour up by model
        raw = json.dumps(body).encode()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        resp: Response = await chat(Request(request.scope, receive))
        if script.record:
            script.calls[-1].update(path="azure", query=dict(request.query_params))
        if isinstance(b, CloudBehavior) and b.filter_completion and isinstance(resp, JSONResponse):
            obj = json.loads(bytes(resp.body))
            obj["choices"][0]["finish_reason"] = "content_filter"
            obj["choices"][0]["message"]["content"] = "Hello"
            return JSONResponse(obj)
        if isinstance(resp, StreamingResponse):  # Azure opens a stream with the prompt's filter results
            first = {"id": "", "object": "", "created": 0, "model": "", "choices": [],
                     "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {
                         "hate": {"filtered": False, "severity": "safe"}}}]}  # fmt: skip
            return StreamingResponse(
                _prefixed(b"data: " + json.dumps(first).encode() + b"\n\n", resp),
                media_type="text/event-stream",
            )
        return resp

    async def azure_embeddings(request: Request) -> Response:
        if request.headers.get("api-key") != PROVIDER_KEY or not request.query_params.get("api-version"):
            return JSONResponse({"error": {"code": "404", "message": "Resource not found"}}, status_code=404)
        body = {**json.loads(await request.body()), "model": request.path_params["deployment"]}
        raw = json.dumps(body).encode()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        resp: Response = await embeddings(Request(request.scope, receive))
        if script.record:
            script.calls[-1].update(path="azure-embeddings", query=dict(request.query_params))
        return resp

    return [
        Route("/openai/deployments/{deployment}/chat/completions", azure, methods=["POST"]),
        Route("/openai/deployments/{deployment}/embeddings", azure_embeddings, methods=["POST"]),
    ]


def cloud_app(script: Script) -> Starlette:
    """The scripted OpenAI / Anthropic upstream plus Gemini and Azure OpenAI."""
    base = make_upstream_app(script)
    ends = {r.path: r.endpoint for r in base.routes if isinstance(r, Route)}
    azure = _azure_routes(script, ends["/v1/chat/completions"], ends["/v1/embeddings"])
    return Starlette(routes=[*base.routes, *_gemini_routes(script), *azure])


_INFO = {"context_window": 1_000_000, "max_output_tokens": 8_000, "supports_tools": True,
         "supports_vision": True, "supports_structured_output": True, "quality": 0.8, "latency_ms": 500.0,
         "ttft_ms": 200.0}  # fmt: skip
CLOUD_ROUTES: list[dict[str, Any]] = [
    {"model": "gem-flash", "provider": "gem", "upstream_model": "up-gem-flash", "info": _INFO,
     "prices": {"input_per_mtok": 0.3, "output_per_mtok": 2.5}},
    {"model": "az-gpt", "provider": "az", "upstream_model": "up-az-deploy", "info": _INFO,
     "prices": {"input_per_mtok": 2.5, "output_per_mtok": 10.0}},
]  # fmt: skip


def cloud_config(url: str, **overrides: Any) -> dict[str, Any]:
    data = config_dict(url, **overrides)
    t = data["providers"][0]["timeouts"]
    data["providers"] += [
        {"id": "gem", "kind": "gemini", "base_url": url, "api_key_env": "ALPHA_KEY", "timeouts": t},
        {"id": "az", "kind": "azure_openai", "api_base": url, "api_version": AZURE_VERSION,
         "api_key_env": "ALPHA_KEY", "timeouts": t},
    ]  # fmt: skip
    if "routes" not in overrides:
        data["routes"] = data["routes"] + CLOUD_ROUTES
    return data


@contextmanager
def live_cloud(behaviors: dict[str, Behavior] | None = None, **cfg_overrides: Any) -> Iterator[Live]:
    script = Script(behaviors=dict(behaviors or {}))
    with ServerThread(cloud_app(script)) as up:
        cfg = parse_config(cloud_config(up.url, **cfg_overrides))
        with ServerThread(create_app(cfg, env=ENV)) as gw:
            yield Live(script, up, gw, cfg)
