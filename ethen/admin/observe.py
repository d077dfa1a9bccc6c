"""JSON for the dashboard's Providers, Canaries and Mesh pages (issue 14), under the admin API's prefix.

::

    GET /api/admin/v1/observe/providers?window_s=3600&buckets=24
        per candidate and per provider: attempts, success rate, latency p50/p95 and circuit-open fraction
        per time bucket (the request log's attempts; the circuit board's transitions), and the live state
    GET /api/admin/v1/observe/canaries?window_s=86400
        each canary target: percent, requests and hits in the window, telemetry samples, acceptance
    GET /api/admin/v1/observe/spend?limit=2000
        the newest logged requests' time, project, served model and cost (the Spend tab's charts)
    GET /api/admin/v1/observe/mesh?prompt_tokens=1
        each mesh provider: nodes, layers, health, the route chosen now with its cost breakdown, and its load
        (issue 44: queue, sessions, predicted wait now and over the last 10 minutes, share spilled)

The same guard as the rest of the admin API (:class:`ethen.admin.sessions.AdminAuth`: the admin key as a
bearer token, or a dashboard session); none of these routes exist without an admin key. What the numbers
mean: :mod:`ethen.admin.observe_data`.

Choices where the issue is silent: buckets are aligned to multiples of their width (the last one holds
now); ``window_s`` is 60 s to 30 days, ``buckets`` 1-120; the attempts are read from the newest
:data:`MAX_ROWS` rows of the window (``truncated`` says when older ones were left out), so a page costs the
same at 10k or 1M logged requests. Without a store the memory ring is read the same way.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ethen.admin.http import query_int
from ethen.admin.observe_data import (
    bucket_attempts,
    canary_rows,
    flatten,
    live_state,
    mesh_view,
    open_fractions,
)
from ethen.gateway.accounting.accounts import AccountsUnavailableError
from ethen.gateway.errors import AuthenticationError, GatewayError, http_status
from ethen.store import StoreError
from ethen.store.requeststats import AttemptRow, attempts_between, canary_counts, newest_costs

if TYPE_CHECKING:
    from ethen.admin.sessions import AdminAuth
    from ethen.gateway.state import Gateway

__all__ = ["MAX_ROWS", "observe_routes"]

PREFIX = "/api/admin/v1/observe"
MAX_ROWS = 20_000


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status, media_type="application/json",
                    headers={"cache-control": "no-store"})


async def _attempts(gw: Gateway, since: float, until: float) -> tuple[Sequence[AttemptRow], int, bool]:
    """The window's attempts, how many rows they came from, and whether older rows were left out."""
    st = gw.requestlog.store()
    lo, hi = datetime.fromtimestamp(since, UTC), datetime.fromtimestamp(until, UTC)
    if st is not None:
        return await attempts_between(st, lo, hi, MAX_ROWS)
    rows: list[tuple[float, Any]] = []
    for row in reversed(gw.requestlog.ring):
        if lo <= row["at"] < hi:
            rows.append((row["at"].timestamp(), row["attempts"]))
            if len(rows) > MAX_ROWS:
                return flatten(rows[:MAX_ROWS]), MAX_ROWS, True
    return flatten(rows), len(rows), False


async def providers(gw: Gateway, window_s: int, buckets: int) -> dict[str, Any]:
    """The Providers and candidates page's data (see the module docstring)."""
    wall, mono = time.time(), gw.circuits.clock()
    bucket_s = window_s / buckets
    start = (math.floor(wall / bucket_s) - buckets + 1) * bucket_s
    end = start + buckets * bucket_s
    attempts, n_rows, truncated = await _attempts(gw, start, end)
    cands, provs = bucket_attempts(attempts, start, bucket_s, buckets)
    board = gw.circuits
    history = [(wall - (mono - t), key, opened) for t, key, opened in list(board.history)]
    opened = open_fractions(history, list(board.circuits), start, bucket_s, buckets)
    live_c, live_p = live_state(gw.store.snapshot(), board, [c.id for c in gw.pool], mono)

    def merge(stats: dict[str, dict[str, Any]], live: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for key in sorted(set(stats) | set(live)):
            s = stats.get(key) or _blank(buckets)
            s["series"]["circuit_open"] = opened.get(key, [0.0] * buckets)
            out.append({"key": key, **s, "live": live.get(key)})
        return out

    return {"since": start, "until": end, "bucket_s": bucket_s,
            "buckets": [start + i * bucket_s for i in range(buckets)], "rows": n_rows,
            "truncated": truncated, "candidates": merge(cands, live_c), "providers": merge(provs, live_p)}


def _blank(buckets: int) -> dict[str, Any]:
    none: list[float | None] = [None] * buckets
    return {"attempts": 0, "successes": 0, "success_rate": None, "p50_ms": None, "p95_ms": None,
            "series": {"attempts": [0] * buckets, "success_rate": none, "p50_ms": none, "p95_ms": none}}


async def canaries(gw: Gateway, window_s: int) -> dict[str, Any]:
    """The Canaries page's data."""
    until = datetime.now(UTC)
    since = datetime.fromtimestamp(until.timestamp() - window_s, UTC)
    st = gw.requestlog.store()
    if st is not None:
        counts = await canary_counts(st, since, until, MAX_ROWS)
    else:
        tally: dict[str, list[int]] = {}
        for row in gw.requestlog.ring:
            canary = (row.get("receipt") or {}).get("canary")
            if row["canary_hit"] is None or not isinstance(canary, dict) or not since <= row["at"] < until:
                continue
            n = tally.setdefault(str(canary.get("candidate")), [0, 0])
            n[0] += 1
            n[1] += bool(row["canary_hit"])
        counts = {k: (v[0], v[1]) for k, v in tally.items()}
    return {"since": since.isoformat(), "until": until.isoformat(),
            "data": canary_rows(gw.canaries, gw.store.snapshot(), counts)}


async def spend(gw: Gateway, limit: int) -> dict[str, Any]:
    """The Spend tab's chart data: the newest ``limit`` rows, narrow (no attempts, no receipt)."""
    st = gw.requestlog.store()
    if st is not None:
        rows = await newest_costs(st, limit)
    else:
        rows = [(r["at"], r["project"], r["selected_provider"], r["selected_model"], r["cost_nano"])
                for r in itertools.islice(reversed(gw.requestlog.ring), limit)]
    return {"object": "list", "data": [
        {"at": at.isoformat(), "project": project, "selected_provider": provider, "selected_model": model,
         "cost_usd": nano / 1e9 if nano is not None else None}
        for at, project, provider, model, nano in rows]}


def observe_routes(gw: Gateway, auth: AdminAuth | None) -> list[Route]:
    """The four routes (none without an admin key)."""
    if auth is None:
        return []

    async def guard(request: Request, build: Any) -> Response:
        if not auth.allows(request):
            err = AuthenticationError("A valid admin key is required: 'Authorization: Bearer <admin key>' "
                                      "(or a dashboard session).")
            return _json(err.to_dict(), http_status(err))
        try:
            return _json(await build(request))
        except GatewayError as err:
            return _json(err.to_dict(), http_status(err))
        except StoreError:
            down = AccountsUnavailableError("The gateway's store is unavailable.")
            return _json(down.to_dict(), http_status(down))

    async def providers_page(request: Request) -> Response:
        async def build(r: Request) -> dict[str, Any]:
            window_s = query_int(r, "window_s", 3600, 60, 30 * 86400)
            return await providers(gw, window_s, query_int(r, "buckets", 24, 1, 120))
        return await guard(request, build)

    async def canaries_page(request: Request) -> Response:
        async def build(r: Request) -> dict[str, Any]:
            return await canaries(gw, query_int(r, "window_s", 86400, 60, 30 * 86400))
        return await guard(request, build)

    async def spend_page(request: Request) -> Response:
        async def build(r: Request) -> dict[str, Any]:
            return await spend(gw, query_int(r, "limit", 2000, 1, MAX_ROWS))
        return await guard(request, build)

    async def mesh_page(request: Request) -> Response:
        async def build(r: Request) -> dict[str, Any]:
            spilled: dict[str, float] = {}
            for metric in gw.metrics.spillover.collect():  # issue 44: requests spilled away, per provider
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        key = sample.labels["from"]
                        spilled[key] = spilled.get(key, 0.0) + sample.value
            return {"data": mesh_view(gw.providers, query_int(r, "prompt_tokens", 1, 0, 1_000_000), spilled)}
        return await guard(request, build)

    return [Route(f"{PREFIX}/providers", providers_page, methods=["GET"]),
            Route(f"{PREFIX}/canaries", canaries_page, methods=["GET"]),
            Route(f"{PREFIX}/spend", spend_page, methods=["GET"]),
            Route(f"{PREFIX}/mesh", mesh_page, methods=["GET"])]
