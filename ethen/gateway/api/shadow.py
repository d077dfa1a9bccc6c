"""Shadow evaluation's shell (issue 27): send a sampled request also to a ``[[shadows]]`` candidate, in the
background, and record the pair. The decisions are pure (:mod:`ethen.gateway.routing.shadow`: sampling,
hard gates, the in-flight bound; :mod:`ethen.gateway.observation.agreement`: how far the answers agree).

When and how (:class:`ShadowRunner`):

- Only a request to an alias with a ``[[shadows]]`` rule comes here, and only once its answer is produced:
  buffered, when :meth:`~ethen.gateway.api.pipeline.Pipeline.served` counts it (the answer is rendered and
  its spend committed; its bytes are written right after, the shadow runs as a separate task); streamed,
  when the stream ended normally (its chunks are kept while they are relayed, so the primary's text can be
  compared). A cache hit, a failed request and a broken or abandoned stream are not shadowed; nor is
  ``/embeddings``.
- A shadow never delays, changes or fails the client's answer: it is an ``asyncio`` task of its own, every
  error in it is caught, counted and logged, and the client's answer has been produced before it starts.
- It never counts against the client: no rate-limit ticket, no budget hold of the client's project. The rule's
  ``project`` pays: the most a usage report the gateway bills can cost on the candidate
  (:func:`~ethen.gateway.accounting.hold.max_credible_cost_usd`: 4 x the estimated input + 1,024 prompt
  tokens, plus the max output) is reserved on that project's budget (``skipped_budget`` when it cannot:
  the call is refused rather than settled below its cost; ``skipped_project`` when the store has no such
  project), then settled at the shadow's reported usage, what the pair records (issue 42: it was capped at
  a smaller reservation); the ledger row has key id ``shadow`` and the client's request id. Released when
  the call failed. A rule naming a project the store lacks at start is a config error then
  (:meth:`ShadowRunner.check_projects`).
- The candidate is called directly (buffered, whatever the client asked: the stream flags are dropped), with
  the client's body as sent upstream; its TTFT is its latency (a buffered answer's first byte is its whole
  body). It does not feed the telemetry store, the circuits nor the request log (it is no client request; the
  router should not learn from traffic no client sees) and has no fallback.
- ``max_in_flight`` bounds the shadow calls of one rule running at once; past it a sampled request is
  dropped and counted (``dropped_in_flight``). A skipped or dropped shadow writes no pair.
- Metrics: ``ethen_gateway_shadows_total{outcome}``: ``sent`` (a call went out), then ``ok`` or ``failed``
  (its outcome); ``dropped_in_flight``, ``skipped_gate``, ``skipped_budget``, ``skipped_project``,
  ``record_failed`` (the store refused the pair); ``ethen_gateway_shadows_in_flight`` (a gauge). The
  receipt does not mention the shadow (it is decided after the answer is produced).
- Shutdown (:meth:`ShadowRunner.aclose`, before the store closes): no new shadow starts; the running ones get
  ``close_timeout_s`` to finish and record, then are cancelled (their holds released).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ethen.gateway.accounting.access import Access
from ethen.gateway.accounting.hold import Hold, max_credible_cost_usd
from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.api.record import RouteTarget
from ethen.gateway.errors import AccountsUnavailableError, GatewayConfigError, GatewayError
from ethen.gateway.observation.agreement import (
    Agreement,
    Answer,
    agreement,
    answer_of_chunks,
    answer_of_completion,
    schema_of,
)
from ethen.gateway.providers.base import UpstreamCall, Usage
from ethen.gateway.routing import Candidate, Decision, ProjectPolicy
from ethen.gateway.routing.shadow import ShadowFacts, ShadowPlan, ShadowRule, plan_shadows, sampled
from ethen.store import Principal, Project, Store, StoreError, StoreNotFoundError
from ethen.store.shadows import insert_pair
from ethen.store.values import to_nano

if TYPE_CHECKING:
    from ethen.gateway.accounting.accounts import Accounts
    from ethen.gateway.observation.metrics import GatewayMetrics

__all__ = ["Primary", "ShadowRequest", "ShadowRunner"]

log = logging.getLogger("ethen.gateway.shadow")
#: the ledger's key id of a shadow call's settlement
SHADOW_KEY_ID = "shadow"


@dataclass(frozen=True, slots=True)
class Primary:
    """What the client got: the candidate that served it, its latency / TTFT (ms), usage, cost, status
    (``ok``) and its answer (a buffered body, or a stream's kept chunks)."""

    candidate: Candidate
    latency_ms: float
    ttft_ms: float | None
    usage: Usage | None
    status: str
    stream: bool
    body: Mapping[str, Any] | None = None
    chunks: tuple[bytes, ...] = ()

    def answer(self) -> Answer:
        return answer_of_completion(self.body) if self.body is not None else answer_of_chunks(self.chunks)


@dataclass(frozen=True, slots=True)
class ShadowRequest:
    """The client's request as the shadow needs it."""

    rid: str
    decision: Decision
    body: Mapping[str, Any]  # the chat body (for its JSON schema)
    payload: Mapping[str, Any]  # as sent upstream
    policy: ProjectPolicy


class ShadowRunner:
    """The ``[[shadows]]`` rules of one gateway and their background calls (module docstring)."""

    def __init__(self, rules: Iterable[ShadowRule], targets: Mapping[str, RouteTarget], accounts: Accounts,
                 metrics: GatewayMetrics, *, close_timeout_s: float = 5.0) -> None:
        self.rules = tuple(rules)
        self.by_alias: dict[str, tuple[ShadowRule, ...]] = {}
        for rule in self.rules:
            self.by_alias[rule.alias] = (*self.by_alias.get(rule.alias, ()), rule)
        self.targets = targets
        self.pool = {cid: t.candidate for cid, t in targets.items()}
        self.accounts = accounts
        self.metrics = metrics
        metrics.shadowing()
        self.close_timeout_s = close_timeout_s
        self.in_flight: dict[tuple[str, str], int] = {}
        #: (alias, candidate) -> outcome (``skipped_gate:<gate>``, ``dropped_in_flight``...) -> count
        self.skipped: dict[tuple[str, str], dict[str, int]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def check_projects(self, store: Store | None) -> None:
        """At start, with the store open: every rule's ``project`` exists, else ``GatewayConfigError`` naming
        the rule's key and value (it would otherwise be found per request, each sampled shadow skipped). A
        project removed later is still skipped per request (``skipped_project``)."""
        if store is None:
            return
        try:
            names = {p.name for p in await store.list_projects()}
        except StoreError as exc:
            raise GatewayConfigError(f"store: {exc.message}") from None
        for i, rule in enumerate(self.rules):
            if rule.project not in names:
                msg = (f"shadows[{i}].project = {rule.project!r}: no such project in the store (the "
                       f"rule for {rule.alias} -> {rule.candidate} pays its shadow calls with it); create it "
                       f"first (ethen projects create {rule.project} --budget 5 --window day) or name an "
                       "existing one")
                log.error("%s", msg)
                raise GatewayConfigError(msg)

    def rule(self, alias: str, candidate: str) -> ShadowRule | None:
        return next((r for r in self.by_alias.get(alias, ()) if r.candidate == candidate), None)

    def applies(self, decision: Decision | None) -> bool:
        """Whether the request's alias has a rule (the only requests this runner looks at)."""
        return decision is not None and decision.requirements.model in self.by_alias

    def sampled_any(self, decision: Decision, rid: str) -> bool:
        """Whether some rule of the request's alias samples it (a stream keeps its chunks only then)."""
        return any(sampled(r, rid)[0] for r in self.by_alias.get(decision.requirements.model, ()))

    def plan(self, req: ShadowRequest, served: Candidate) -> tuple[ShadowPlan, ...]:
        d = req.decision
        facts = ShadowFacts(req.rid, d.requirements.model, served.id, d.requirements, d.profile.gates,
                            req.policy, self.pool, self.in_flight, datetime.now(UTC))
        return plan_shadows(self.by_alias.get(d.requirements.model, ()), facts)

    def launch(self, req: ShadowRequest, primary: Primary) -> tuple[ShadowPlan, ...]:
        """Plan the request's shadows and start the ones to send (never raises, never awaits)."""
        if self.closed:
            return ()
        try:
            plans = self.plan(req, primary.candidate)
        except Exception:  # a bug here must not fail the client's answer
            log.exception("request %s: planning its shadows failed", req.rid)
            return ()
        for p in plans:
            if p.reason in ("skipped_gate", "dropped_in_flight"):
                self._skip(p.rule, p.reason, p.gate_reasons)
                if p.reason == "skipped_gate":
                    log.info("request %s: shadow %s skipped: %s", req.rid, p.rule.candidate,
                             ",".join(p.gate_reasons))
            if not p.send:
                continue
            key = p.rule.key
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.metrics.shadows_in_flight.inc()
            task = asyncio.get_running_loop().create_task(self._run(p.rule, req, primary))
            self.tasks.add(task)
            task.add_done_callback(self._done(key))
        return plans

    def _skip(self, rule: ShadowRule, outcome: str, reasons: tuple[str, ...] = ()) -> None:
        """Count a shadow not sent: the metric, and per rule by outcome and gate (the admin API shows it)."""
        self.metrics.shadows.labels(outcome).inc()
        counts = self.skipped.setdefault(rule.key, {})
        for name in (f"{outcome}:{r}" for r in reasons) if reasons else (outcome,):
            counts[name] = counts.get(name, 0) + 1

    def _done(self, key: tuple[str, str]) -> Any:
        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            self.in_flight[key] -= 1
            self.metrics.shadows_in_flight.dec()
            if not task.cancelled() and task.exception() is not None:
                log.error("shadow task failed", exc_info=task.exception())

        return done

    async def _hold(self, rule: ShadowRule, req: ShadowRequest, cand: Candidate) -> Hold | None:
        """A budget hold on the rule's project for the candidate's maximum cost; ``None`` (counted) when the
        project does not exist or its budget cannot cover it."""
        acc = self.accounts
        store, admission = acc.store, acc.admission
        if store is None or admission is None:
            self._skip(rule, "skipped_project")
            return None
        try:
            project: Project = await store.get_project(rule.project)
        except StoreNotFoundError:
            log.warning("shadow %s of %s: project %r does not exist in the store; skipped", rule.candidate,
                        rule.alias, rule.project)
            self._skip(rule, "skipped_project")
            return None
        amount = max_credible_cost_usd(cand, req.decision.requirements)  # settles its real usage
        ticket = None
        if project.budget_usd is not None:
            ticket = await admission.reserve(project, amount)
            if ticket is None:
                self._skip(rule, "skipped_budget")
                return None
        access = Access(f"shadow:{project.name}", Principal(SHADOW_KEY_ID, project))
        return Hold(admission, access, req.decision, req.rid, ticket,
                    amount if project.budget_usd is not None else None, acc.on_not_credible, acc.on_capped)

    async def _run(self, rule: ShadowRule, req: ShadowRequest, primary: Primary) -> None:
        await asyncio.sleep(0)  # the client's answer goes out first
        target = self.targets[rule.candidate]
        cand = target.candidate
        try:
            hold = await self._hold(rule, req, cand)
        except StoreError as exc:
            log.error("shadow %s of request %s: reserving its budget failed: %s", rule.candidate, req.rid,
                      exc.message)
            self._skip(rule, "skipped_budget")
            return
        if hold is None:
            return
        self.metrics.shadows.labels("sent").inc()
        t0 = time.perf_counter()
        usage: Usage | None = None
        body: Mapping[str, Any] | None = None
        try:
            comp = await hold.guard(target.provider.complete(UpstreamCall(req.payload, target.upstream_model,
                                                                          req.rid)))
        except GatewayError as err:
            status = err.code or "error"
        except Exception as exc:  # a provider bug: the shadow fails, the gateway carries on
            log.warning("shadow %s of request %s failed: %s", rule.candidate, req.rid, type(exc).__name__)
            status = "internal_error"
        else:
            body, usage, status = comp.body, comp.usage, "ok"
        latency_ms = (time.perf_counter() - t0) * 1000
        self.metrics.shadows.labels("ok" if status == "ok" else "failed").inc()
        if status == "ok":
            with contextlib.suppress(AccountsUnavailableError):  # logged by the hold
                await hold.settle(cand, usage)
        agreed: Agreement | None = None
        if body is not None:
            agreed = await asyncio.to_thread(agreement, primary.answer(), answer_of_completion(body),
                                             schema_of(req.body))
        row = _pair(rule, req, primary, cand, latency_ms, usage, status, agreed)
        try:
            store = self.accounts.store
            admission = self.accounts.admission
            if store is None:
                raise StoreError("the store is closed")
            await insert_pair(store, row, admission.write if admission is not None else None)
        except StoreError as exc:
            log.error("shadow %s of request %s: recording the pair failed: %s", rule.candidate, req.rid,
                      exc.message)
            self.metrics.shadows.labels("record_failed").inc()

    async def aclose(self) -> None:
        """Stop starting shadows; let the running ones finish (``close_timeout_s``), then cancel them."""
        self.closed = True
        tasks = list(self.tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.close_timeout_s)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(BaseException):
                await t


def _cost_nano(cand: Candidate, usage: Usage | None) -> int | None:
    return to_nano(cost_of(cand, usage).total_usd) if usage is not None else None


def _pair(rule: ShadowRule, req: ShadowRequest, primary: Primary, cand: Candidate, latency_ms: float,
          usage: Usage | None, status: str, agreed: Agreement | None) -> dict[str, Any]:
    pu = primary.usage
    return {
        "request_id": req.rid,
        "alias": rule.alias,
        "primary_candidate": primary.candidate.id,
        "candidate": cand.id,
        "at": datetime.now(UTC),
        "stream": primary.stream,
        "primary_latency_ms": primary.latency_ms,
        "primary_ttft_ms": primary.ttft_ms,
        "candidate_latency_ms": latency_ms,
        "candidate_ttft_ms": latency_ms if status == "ok" else None,
        "primary_prompt_tokens": pu.prompt_tokens if pu is not None else None,
        "primary_completion_tokens": pu.completion_tokens if pu is not None else None,
        "candidate_prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "candidate_completion_tokens": usage.completion_tokens if usage is not None else None,
        "primary_cost_nano": _cost_nano(primary.candidate, pu),
        "candidate_cost_nano": _cost_nano(cand, usage),
        "primary_status": primary.status,
        "candidate_status": status[:100],
        "exact": agreed.exact if agreed is not None else None,
        "similarity": agreed.similarity if agreed is not None else None,
        "tool_calls_equal": agreed.tool_calls_equal if agreed is not None else None,
        "schema_valid": agreed.schema_valid if agreed is not None else None,
        "primary_schema_valid": agreed.primary_schema_valid if agreed is not None else None,
    }
