"""The response cache (issue 27): answers of deterministic requests served again without an upstream call.

A pure core (:mod:`.policy`: verdict, ``Cache-Control``, key), the entry encoding (:mod:`.entry`), the
backends (:mod:`.backends`: memory LRU, ``[shared]`` Redis), the stream wrappers (:mod:`.replay`) and the
shell the request path calls (:mod:`.shell`). Behaviour and choices: ``docs/gateway.md``, "Response cache
(issue 27)".
"""

from __future__ import annotations

from .backends import Backend, MemoryBackend, RedisBackend
from .entry import Entry, decode, encode_body, encode_stream
from .policy import IGNORED, CachePolicy, cache_key, canonical, deterministic, directive, verdict
from .replay import RecordingStream, ReplayStream
from .shell import CacheCall, ResponseCache, response_cache_for

__all__ = [
    "IGNORED",
    "Backend",
    "CacheCall",
    "CachePolicy",
    "Entry",
    "MemoryBackend",
    "RecordingStream",
    "RedisBackend",
    "ReplayStream",
    "ResponseCache",
    "cache_key",
    "canonical",
    "decode",
    "deterministic",
    "directive",
    "encode_body",
    "encode_stream",
    "response_cache_for",
    "verdict",
]
