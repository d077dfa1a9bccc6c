"""The request log (issue 14): every finished request's outcome, written off the request path.

The request path (:mod:`ethen.gateway.api.pipeline`, :mod:`ethen.gateway.api.relay`) builds one small frozen
:class:`RequestRecord` per finished request, holding references it already has (the decision, the attempts,
the served candidate, the usage) and a few numbers, and hands it to :meth:`RequestLog.record`: an append to a
bounded queue, nothing else. Everything else happens in the writer task, in batches: the ``ethen.routing``
receipt is built (the same function the answer's receipt came from), the row serialized, the per-project and
per-model metrics counted (:meth:`~ethen.gateway.observation.metrics.GatewayMetrics.account`), the
OpenTelemetry spans
emitted (:mod:`ethen.gateway.observation.tracing`, when configured), and the batch written in one transaction.

Choices where the issue is silent:
- Batches: the writer handles queued records every 50 ms (rows built, metrics counted, spans emitted: the
  metrics lag the requests by about that), but inserts the rows into the store only once the oldest pending
  one waited 250 ms (or 500 are pending): a transaction's fixed cost (begin, commit, the hop to the ledger
  writer's thread) dominated the log's CPU with ~5 rows per insert at 100 requests/s (50 ms);
  ``bench/requestlog_write.py`` measures CPU per row at 5, 25 and 500 rows per insert. Rows show up in the
  stored log up to ~300 ms after their request, and a ``kill -9`` loses at most that much of the log (never
  the ledger).
- Encoding: each row's JSON columns are serialized once, here (``ethen.store.requests.encode_row``), and
  the batch inserted raw with its attempts (``request_attempts``). Text no column can hold (NUL, which
  Postgres refuses, or a lone surrogate) is stored with U+FFFD in its place, in every field (issue 23). A
  row that cannot be encoded, or that the database refuses (e.g. a number no column holds), is dropped alone
  (the refused batch's halves are retried down to that row), logged and counted in
  ``ethen_gateway_request_log_rows_dropped_total``; the other rows of its batch are stored.
- Queue full (``[log] queue_size``, 10,000 records): the record is dropped and counted in
  ``ethen_gateway_request_log_dropped_total``; the request never waits. A failed write (store down) drops the
  batch, logs one WARNING per failure streak and counts ``ethen_gateway_request_log_write_errors_total``.
- Where: with a ``[store]`` in its ``request_log`` table (:mod:`ethen.store.requests`), pruned at start and
  every ``prune_interval_s`` (rows older than ``retention_days``, and all but the newest ``max_rows``);
  without one, a memory ring of the last ``memory_rows`` (lost at restart).
- Key: the store key's id, or ``config:<name>`` for a ``[[api_keys]]`` key; never the key. No message body
  is logged (the requested model and the receipt only).
- Cost: the served candidate's usage priced by :func:`ethen.gateway.accounting.pricing.cost_of`
(genai-prices with cache
  reads/writes, else the route's prices); the breakdown is the receipt's ``cost``; the row keeps the cache
  reads and writes and what the reads saved (``saved_usd``: reads x (input - cache-read price), issue 45).
  The ledger's settled
  amount may differ when the usage was not credible (then it settles the reservation).
- A request that failed on its only attempt records that attempt from its error (provider and code; the
  model is the chain's first candidate of that provider); a failed fallback chain records every attempt. An
  attempt the upstream refused because of the client's request (``UpstreamBadRequestError``) has outcome
  ``client_error``: the Candidates page and ``ethen_gateway_attempts_total{outcome="error"}`` do not count it
  as the provider's failure (issue 42).
- Refused requests (401, 402, 422, 429...) are logged too, with what was known when they were refused. One
  refused by routing (422 ``no_smart_route_candidate``, 503 ``no_healthy_candidate``, 402 from the budget
  gate, 404 ``model_not_found``) keeps its decision as its receipt: the requested model, the alias profile,
  ``requirements`` (what the request needed), ``hard_requirements`` and every rejected candidate with its
  reasons (``rejected``), ``chain`` empty (issue 42).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.api.record import CLIENT_ERROR, Attempt, RequestRecord, routing_receipt
from ethen.gateway.routing import Candidate
from ethen.gateway.routing.reasons import HEDGE_WON
from ethen.store import Store, StoreError, StoreInvalidError
from ethen.store.requests import (
    EncodedRow,
    RequestQuery,
    Write,
    encode_row,
    get_request,
    insert_requests,
    list_requests,
    prune_requests,
    public_row,
    row_matches,
)

if TYPE_CHECKING:
    from ethen.gateway.config import LogConfig
    from ethen.gateway.observation.metrics import GatewayMetrics
    from ethen.gateway.observation.tracing import Tracing

__all__ = ["RequestLog", "RequestRecord", "to_row"]

log = logging.getLogger("ethen.gateway.observation.requestlog")
_BATCH = 500  # rows per transaction at most
_LINGER_S = 0.05  # after handling a batch, let the next one gather this long
_WRITE_EVERY_S = 0.25  # pending rows are inserted once the oldest waited this long (or a batch is full)


def _attempt(a: Attempt | Mapping[str, Any]) -> dict[str, Any]:
    d = a.to_dict() if isinstance(a, Attempt) else dict(a)
    provider, _, model = str(d.get("candidate", "")).partition("/")
    d["provider"], d["model"] = provider, model
    d["status"] = d.get("upstream_status") or (200 if d.get("outcome") == "ok" else None)
    return d


def _attempts(rec: RequestRecord) -> list[dict[str, Any]]:
    if rec.attempts:
        return [_attempt(a) for a in rec.attempts]
    if rec.error_provider is not None and rec.decision is not None:  # failed on its only attempt
        sc = next((sc for sc in rec.decision.chain if sc.candidate.provider == rec.error_provider), None)
        if sc is not None:
            return [{"candidate": sc.id, "provider": sc.candidate.provider, "model": sc.candidate.model,
                     "outcome": CLIENT_ERROR if rec.client_error else "error", "code": rec.error_code,
                     "status": None}]
    return []


def _receipt(rec: RequestRecord, attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if rec.receipt is not None:
        return dict(rec.receipt)
    if rec.decision is None:
        return None
    if rec.served is not None:  # served: the attempts are the executor's own
        attempts_ = [a for a in rec.attempts if isinstance(a, Attempt)]
        out = routing_receipt(rec.decision, attempts_, _Served(rec.served), rec.extra)  # type: ignore[arg-type]
    else:
        out = rec.decision.receipt.to_dict()
        out["attempts"] = attempts
    if rec.stream and rec.overhead_s is not None:
        out["overhead_ms"] = round(rec.overhead_s * 1000, 3)
    return out


@dataclass(frozen=True, slots=True)
class _Served:
    """What :func:`~ethen.gateway.api.pipeline.routing_receipt` reads of a route target."""

    candidate: Candidate


def _hedge_won(receipt: Mapping[str, Any] | None) -> bool:
    """A hedge answered first and nothing failed (issue 27): served by rank 2, but no fallback."""
    return receipt is not None and HEDGE_WON in (receipt.get("reason_codes") or ())


def to_row(rec: RequestRecord) -> dict[str, Any]:
    """The stored row of a record (done by the writer, off the request path)."""
    attempts = _attempts(rec)
    receipt = _receipt(rec, attempts)
    primary = rec.decision.chain[0].candidate if rec.decision is not None and rec.decision.chain else None
    served = rec.served
    if served is None and receipt is not None and rec.decision is None:  # an endpoint's own receipt
        sp, sm = receipt.get("selected_provider"), receipt.get("selected_model")
    else:
        sp, sm = (served.provider, served.model) if served is not None else (None, None)
    usage = rec.usage
    priced = cost_of(served, usage) if served is not None and usage is not None else None
    cost = priced.total_usd if priced is not None else None
    if cost is None and receipt is not None and (receipt.get("cache") or {}).get("hit") is True:
        cost = 0.0  # a response-cache hit (issue 27): no upstream call, it costs nothing
    if priced is not None and receipt is not None:  # the breakdown: cache read/write tokens, cost parts
        receipt["cost"] = priced.to_dict()
    canary = rec.decision.canary if rec.decision is not None else None
    model = rec.requested_model if isinstance(rec.requested_model, str) else None
    return {
        "request_id": rec.request_id,
        "at": datetime.fromtimestamp(rec.at, UTC),
        "endpoint": rec.endpoint,
        "stream": rec.stream,
        "project": rec.project,
        "key_id": rec.key_id,
        "requested_model": model[:200] if model is not None else None,
        "selected_provider": sp,
        "selected_model": sm,
        "primary_provider": primary.provider if primary is not None else None,
        "primary_model": primary.model if primary is not None else None,
        "fallback_used": (served is not None and primary is not None and served.id != primary.id
                          and not _hedge_won(receipt))
        or (served is None and len(attempts) > 1),
        "canary_hit": canary.hit if canary is not None else None,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "completion_tokens": usage.completion_tokens if usage is not None else None,
        "cost_nano": round(cost * 1e9) if cost is not None else None,
        "cache_read_tokens": usage.cache_read_tokens if usage is not None else None,
        "cache_write_tokens": usage.cache_write_tokens if usage is not None else None,
        "saved_nano": round(priced.saved_usd * 1e9) if priced is not None else None,
        "ttft_ms": round(rec.ttft_s * 1000, 3) if rec.ttft_s is not None else None,
        "latency_ms": round(rec.latency_s * 1000, 3),
        "overhead_ms": round(rec.overhead_s * 1000, 3) if rec.overhead_s is not None else None,
        "status": rec.status,
        "outcome": rec.outcome,
        "error_code": rec.error_code,
        "attempts": attempts,
        "receipt": receipt,
    }


class RequestLog:
    """The bounded queue, its writer task, and the reads of the admin API (store or memory ring)."""

    def __init__(self, cfg: LogConfig, metrics: GatewayMetrics, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.tracing = tracing
        self.store: Callable[[], Store | None] = lambda: None  # set by the app: the accounts' open store
        #: set by the app: the ledger writer's transaction runner (``Admission.write``), when there is one
        self.write: Callable[[], Write | None] = lambda: None
        self._queue: deque[RequestRecord] = deque()
        self._max = cfg.queue_size
        self._wake = asyncio.Event()
        self.ring: deque[dict[str, Any]] = deque(maxlen=cfg.memory_rows)
        self._next_id = 1
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._last_prune = 0.0
        self._pending: list[EncodedRow] = []  # rows handled, waiting for their database write
        self._pending_since = 0.0
        self.written = 0  # records handled by the writer (rows built and counted; ringed or pending/stored)
        #: rows dropped alone: not encodable, or refused by the database (the rest of their batch is stored)
        self.rows_dropped = Counter(
            "ethen_gateway_request_log_rows_dropped",
            "Request-log rows dropped alone: a row that could not be encoded or that the database refused "
            "(the other rows of its batch are stored).", registry=metrics.registry)

    # -- the request path ------------------------------------------------------------------------------
    def record(self, rec: RequestRecord) -> None:
        """Queue a record (never blocks; drops and counts it when the queue is full)."""
        q = self._queue
        if len(q) >= self._max:
            self.metrics.log_dropped.inc()
            return
        q.append(rec)
        if len(q) == 1:
            self._wake.set()

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ethen-request-log")

    async def aclose(self) -> None:
        """Stop the writer after writing what is queued."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()
        if self.tracing is not None:
            self.tracing.shutdown()

    async def flush(self) -> None:
        """Handle everything queued and write every pending row now (tests, shutdown)."""
        while self._queue:
            self._handle_batch()
        while self._pending:
            await self._write_pending()

    async def _run(self) -> None:
        await self._maybe_prune()
        while True:
            if not self._queue and not self._pending:
                self._wake.clear()
                await self._wake.wait()
            self._handle_batch()
            pending = self._pending
            waited = time.monotonic() - self._pending_since
            if pending and (len(pending) >= _BATCH or waited >= _WRITE_EVERY_S):
                await self._write_pending()
            await self._maybe_prune()
            if len(self._queue) < _BATCH:
                await asyncio.sleep(_LINGER_S)

    def _handle_batch(self) -> None:
        """Up to a batch of queued records: rows built, metrics counted, spans emitted, then ringed (no
        store) or encoded into the rows pending for the database."""
        q = self._queue
        batch = [q.popleft() for _ in range(min(len(q), _BATCH))]
        if not batch:
            return
        st = self.store()
        for rec in batch:
            try:
                row = to_row(rec)
                enc = encode_row(row) if st is not None else None  # JSON once: a bad row is dropped alone
                self.metrics.account(rec, row)
                if self.tracing is not None:
                    self.tracing.emit(rec, row)
            except Exception:  # a bug here must not stop the writer
                log.exception("request log: could not record request %s", rec.request_id)
                self.rows_dropped.inc()
                continue
            if enc is None:
                row["id"] = self._next_id
                self._next_id += 1
                self.ring.append(row)
                continue
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(enc)
        self.written += len(batch)

    async def _write_pending(self) -> None:
        """Insert up to a batch of the pending rows (one transaction); dropped and counted on failure."""
        rows, self._pending = self._pending[:_BATCH], self._pending[_BATCH:]
        self._pending_since = time.monotonic()
        st = self.store()
        if st is None or not rows:
            return
        await self._insert(st, rows)

    async def _insert(self, st: Store, rows: list[EncodedRow]) -> None:
        """One transaction of ``rows``. When the database refuses a value of one of them, each half is retried
        on its own, down to the bad row, dropped alone and counted (a batch of ``n`` rows with one bad row
        takes about ``2 log2 n`` transactions); when the store fails, the batch is dropped and counted."""
        try:
            await insert_requests(st, rows, self.write())
        except StoreInvalidError as exc:
            if len(rows) > 1:
                half = len(rows) // 2
                await self._insert(st, rows[:half])
                await self._insert(st, rows[half:])
                return
            self.rows_dropped.inc()
            log.warning("request log: a row the database refused was dropped: %s", exc.message)
        except StoreError as exc:
            self.metrics.log_write_errors.inc()
            if not self._failing:
                log.warning("request log: writing %d row(s) failed: %s (dropped)", len(rows), exc.message)
            self._failing = True
            return
        self._failing = False

    async def _maybe_prune(self) -> None:
        st = self.store()
        now = time.monotonic()
        if st is None or (self._last_prune and now - self._last_prune < self.cfg.prune_interval_s):
            return
        self._last_prune = now
        before = datetime.now(UTC) - timedelta(days=self.cfg.retention_days)
        try:
            n = await prune_requests(st, before=before, max_rows=self.cfg.max_rows, write=self.write())
        except StoreError as exc:
            log.warning("request log: pruning failed: %s", exc.message)
            return
        if n:
            log.info("request log: pruned %d row(s) (retention %s days, max %s rows)",
                     n, self.cfg.retention_days, self.cfg.max_rows)

    @property
    def queued(self) -> int:
        """Records waiting for the writer."""
        return len(self._queue)

    # -- reads (admin API) -----------------------------------------------------------------------------
    async def query(self, q: RequestQuery) -> list[dict[str, Any]]:
        """Rows passing ``q``, newest first (store or ring)."""
        st = self.store()
        if st is not None:
            return await list_requests(st, q)
        out: list[dict[str, Any]] = []
        for row in reversed(self.ring):
            if row_matches(row, q):
                out.append(public_row(row, receipt=False))
                if len(out) >= q.limit:
                    break
        return out

    async def get(self, request_id: str) -> dict[str, Any] | None:
        st = self.store()
        if st is not None:
            return await get_request(st, request_id)
        row = next((r for r in reversed(self.ring) if r["request_id"] == request_id), None)
        return public_row(row) if row is not None else None
