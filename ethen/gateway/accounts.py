"""Projects, keys and budgets on the gateway's request path (the shell between the HTTP app and the store).

Per request: :meth:`Accounts.authenticate` (config keys first, then store keys) -> :meth:`Accounts.prepare`
(the project's effective policy and remaining window budget, its default alias, live certification receipts
into the routing context) -> ``decide`` through :meth:`Accounts.decide` -> :meth:`Accounts.admit` (reserve the
estimated cost) -> execution -> :meth:`Hold.settle` (actual cost into the ledger, reservation released) or
:meth:`Hold.release` (nothing was served).

Choices where the spec is silent:
- **Config keys keep working** and act for no project: the config's ``[policy]`` applies, no budget, no
  ledger. Store keys act for their project only; the project's policy is intersected with the config's
  ``[policy]`` (allowed sets intersect, budgets take the smaller).
- **Default alias**: applied when the body has no ``model`` key at all.
- **Reserved amount**: the largest *maximum* cost over the decision's whole fallback chain (any of them may
  end up serving): the estimated input tokens plus ``n`` x the request's ``max_tokens``/
  ``max_completion_tokens``, or the model's max output when both are unset (:func:`max_cost_usd`). Set
  ``max_tokens`` to reserve less.
- **Credible usage** (:func:`credible_usage`): an upstream's report is billed only if its completion tokens
  are within ``n`` x the request's max output (or the model's when unset), its prompt tokens within
  ``PROMPT_FACTOR`` (4) x the estimate + ``PROMPT_SLACK_TOKENS`` (1,024: provider-side prompts such as a
  tool-use preamble; a tokenizer yields at most one token per byte, 3x the bytes/3 estimate), no count is
  negative and the total is within twice the context window. Otherwise the request settles its served
  candidate's maximum cost (what its reservation held), the ledger row is flagged ``estimated``, a WARNING is
  logged and ``ethen_gateway_usage_not_credible_total{provider}`` counts it. Whatever an upstream says, a
  request's settled cost never exceeds its reservation (a credible report priced above it, from a prompt
  tokenized above the estimate, settles the reservation), so a project's settled spend never exceeds its
  budget.
- **Budget errors**: HTTP **402** with code ``budget_exceeded`` (type ``insufficient_quota``): 429 would make
  OpenAI SDKs retry automatically, which cannot help until the window rolls over or the budget is raised.
  It is used both when the reservation loses a race and when ``decide`` finds no candidate and one the
  project may use was rejected *only* because of the remaining window budget (then the rejections are
  attached, as for ``no_smart_route_candidate``). Candidates outside the project's allow-list never decide it.
- **Actual cost** = upstream usage x the served candidate's prices. When the upstream reports no usage (e.g.
  a stream cut before its usage chunk), the served candidate's *estimated* cost is settled and the ledger row
  is flagged ``estimated``.
- A store failure is a 503 ``store_unavailable``; the message names no key, URL or password.
- A settlement is queued to the ledger writer synchronously (no await before it is queued) and releasing is
  shielded from cancellation, so a client hanging up mid-stream still settles, and
  so does one that hangs up before the first byte (the stream's generator settles when the server closes it;
  ``test_service_budget.py::test_client_gone_before_the_first_byte_settles_and_releases``). A reservation
  that is somehow never settled (a gateway killed mid-request) stops counting when the process's lease
  expires (``[store] lease_s``, 15 s; :mod:`ethen.store.admission`): budget is held back that long, never
  overspent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import anyio

from ethen.gateway.auth import KeyRing
from ethen.gateway.config import GatewayConfig, store_url
from ethen.gateway.errors import (
    AccountsUnavailableError,
    AuthenticationError,
    BudgetExceededError,
    GatewayConfigError,
    NoSmartRouteCandidateError,
)
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import (
    Candidate,
    Decision,
    LiveCertification,
    ProjectPolicy,
    Requirements,
    RoutingContext,
    decide,
)
from ethen.gateway.routing.reasons import OVER_PROJECT_BUDGET
from ethen.store import (
    Admission,
    CertificationReceipt,
    Principal,
    Project,
    Store,
    StoreError,
    Ticket,
    parse_key,
)
from ethen.store.engine import normalize_url

__all__ = [
    "Access",
    "Accounts",
    "AccountsUnavailableError",
    "BudgetExceededError",
    "Hold",
    "credible_usage",
    "max_completion_tokens",
    "max_cost_usd",
    "with_certifications",
]

log = logging.getLogger("ethen.accounts")
T = TypeVar("T")
_ONLY_BUDGET = (OVER_PROJECT_BUDGET,)
#: Reported prompt tokens are credible up to PROMPT_FACTOR x the request's estimate + PROMPT_SLACK_TOKENS.
PROMPT_FACTOR = 4
PROMPT_SLACK_TOKENS = 1024





@dataclass(frozen=True, slots=True)
class Access:
    """Who a request acts for: a config key (``principal`` is ``None``) or a store key of one project."""

    name: str
    principal: Principal | None = None

    @property
    def project(self) -> Project | None:
        return self.principal.project if self.principal is not None else None


def _intersect(a: frozenset[str] | None, b: tuple[str, ...] | None) -> frozenset[str] | None:
    if b is None:
        return a
    return frozenset(b) if a is None else a & frozenset(b)


def _wants_live(body: Mapping[str, Any]) -> bool:
    meta = body.get("metadata")
    routing = meta.get("routing") if isinstance(meta, Mapping) else None
    return isinstance(routing, Mapping) and routing.get("certification_level") == "live"


def with_certifications(
    pool: tuple[Candidate, ...], receipts: list[CertificationReceipt]
) -> tuple[Candidate, ...]:
    """The pool with each candidate's newest receipt attached (candidates without one are unchanged)."""
    newest: dict[tuple[str, str], CertificationReceipt] = {}
    for r in receipts:
        cur = newest.get((r.provider, r.model))
        if cur is None or r.expires_at > cur.expires_at:
            newest[(r.provider, r.model)] = r
    out = []
    for c in pool:
        got = newest.get((c.provider, c.model))
        if got is not None:
            c = dataclasses.replace(
                c, certification=LiveCertification(got.receipt_id, got.certified_at, got.expires_at)
            )
        out.append(c)
    return tuple(out)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def max_completion_tokens(candidate: Candidate, req: Requirements) -> int:
    """The most completion tokens a request may produce on ``candidate``: ``n`` x its max output (requested,
    or the model's max output when unset)."""
    out = req.max_output_tokens if req.max_output_tokens is not None else candidate.info.max_output_tokens
    return req.choices * out


def max_cost_usd(candidate: Candidate, req: Requirements) -> float:
    """The most a request may cost on ``candidate``: its estimated input plus :func:`max_completion_tokens`,
    at the candidate's prices (the routing estimate when the request sets ``max_tokens`` and ``n`` <= 1)."""
    p = candidate.prices
    out = max_completion_tokens(candidate, req)
    return (req.input_tokens * p.input_per_mtok + out * p.output_per_mtok) / 1e6


def credible_usage(candidate: Candidate, usage: Usage, req: Requirements | None = None) -> bool:
    """Whether an upstream's reported usage can be billed (module docstring): no negative count, at most
    twice the model's context window in total, and, given the request's requirements, completion tokens
    within its max output (the model's when unset) and prompt tokens within ``PROMPT_FACTOR`` x the estimate
    + ``PROMPT_SLACK_TOKENS``. Beyond that the upstream is wrong (or lying); billing it could overspend."""
    p, c = usage.prompt_tokens, usage.completion_tokens
    if p < 0 or c < 0 or p + c > 2 * candidate.info.context_window:
        return False
    if req is None:
        return True
    prompt_limit = PROMPT_FACTOR * req.input_tokens + PROMPT_SLACK_TOKENS
    return c <= max_completion_tokens(candidate, req) and p <= prompt_limit


async def _nothing() -> None:
    return None


class Hold:
    """One admitted request's budget hold: settle it (served) or release it (not served), exactly once.
    Neither can be cut by cancellation (a client that disconnects must not leave the ledger behind)."""

    def __init__(
        self,
        store: Admission | None,
        access: Access,
        decision: Decision | None,
        request_id: str,
        reservation: Ticket | None,
        reserved_usd: float | None = None,
        on_not_credible: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._access = access
        self._decision = decision
        self._rid = request_id
        self._reservation = reservation
        self._reserved_usd = reserved_usd  # the settled cost's cap (None: no budget, nothing reserved)
        self._on_not_credible = on_not_credible  # the metric (set by the app)
        self._done = store is None or access.principal is None

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work``; if it fails (or is cancelled), release the hold and re-raise."""
        try:
            return await work
        except BaseException:
            await self.release()
            raise

    async def settle_or_log(self, candidate: Candidate, usage: Usage | None) -> bool:
        """:meth:`settle`, for places that cannot answer with an error status any more (a started stream). It
        runs to its end even in a cancelled scope (a client gone mid-stream), so what follows it (the stream's
        metrics and request-log record) runs too."""
        try:
            with anyio.CancelScope(shield=True):
                await self.settle(candidate, usage)
        except AccountsUnavailableError:
            return False
        return True

    async def settle(self, candidate: Candidate, usage: Usage | None) -> None:
        await self.settle_soon(candidate, usage)

    def settle_soon(self, candidate: Candidate, usage: Usage | None) -> Awaitable[None]:
        """Queue the settlement now and return what to await before the answer leaves (its commit): the
        answer can be built while the ledger commits. Awaiting it raises :class:`AccountsUnavailableError`
        when the spend could not be recorded."""
        if self._done:
            return _nothing()
        self._done = True
        try:
            committed = self._queue(candidate, usage)
        except StoreError as exc:
            return self._unavailable(exc)
        return self._committed(committed)

    async def _committed(self, committed: asyncio.Future[None]) -> None:
        # the entry is queued already: a cancelled waiter leaves it to commit (asyncio.shield: the waiter's
        # cancellation does not cancel the writer's future; anyio's CancelScope cost ~0.1 ms per request)
        try:
            await asyncio.shield(committed)
        except StoreError as exc:
            await self._unavailable(exc)

    async def _unavailable(self, exc: StoreError) -> None:
        log.error("request %s: settling spend failed: %s", self._rid, exc.message)
        raise AccountsUnavailableError("The gateway could not record the request's spend.") from None

    def _queue(self, candidate: Candidate, usage: Usage | None) -> asyncio.Future[None]:
        assert self._store is not None and self._access.principal is not None
        req = self._decision.requirements if self._decision is not None else None
        if usage is not None and not credible_usage(candidate, usage, req):
            log.warning(
                "request %s: %s reported %d prompt + %d completion tokens, not credible for this request "
                "(at most %s completion tokens, ~%s estimated prompt tokens); settling its reservation",
                self._rid, candidate.id, usage.prompt_tokens, usage.completion_tokens,
                max_completion_tokens(candidate, req) if req else "?", req.input_tokens if req else "?",
            )
            if self._on_not_credible is not None:
                self._on_not_credible(candidate.provider)
            cost = max_cost_usd(candidate, req) if req is not None else 0.0
            usage = None
        elif usage is not None:
            p = candidate.prices
            cost = (
                usage.prompt_tokens * p.input_per_mtok + usage.completion_tokens * p.output_per_mtok
            ) / 1e6
        else:
            chain = self._decision.chain if self._decision is not None else ()
            cost = next((sc.estimated_cost_usd for sc in chain if sc.candidate.id == candidate.id), 0.0)
        if self._reserved_usd is not None and cost > self._reserved_usd:
            log.warning(
                "request %s: %s's usage costs $%.6f, above the $%.6f reserved; settling the reservation",
                self._rid, candidate.id, cost, self._reserved_usd,
            )
            cost = self._reserved_usd
        return self._store.settle_soon(
            self._access.principal.project,
            reservation_id=self._reservation,
            request_id=self._rid,
            key_id=self._access.principal.key_id,
            provider=candidate.provider,
            model=candidate.model,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            cost_usd=cost,
            estimated=usage is None,
        )

    async def release(self) -> None:
        if self._done:
            return
        self._done = True
        if self._reservation is None or self._store is None:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self._store.release(self._reservation)
        except StoreError as exc:  # the reservation expires on its own (ttl)
            log.error("request %s: releasing reservation failed: %s", self._rid, exc.message)


class Accounts:
    """Authentication, project policy and budget admission. Without a store URL only config keys exist."""

    def __init__(
        self,
        keyring: KeyRing,
        *,
        store_url: str | None = None,
        lease: timedelta = timedelta(seconds=15),
        instance_id: str | None = None,
        release_dangling: bool = True,
        sqlite_synchronous: str = "NORMAL",
    ) -> None:
        self.keyring = keyring
        self.sqlite_synchronous = sqlite_synchronous
        self.store_url = store_url
        self.store: Store | None = None
        self.admission: Admission | None = None  # key cache, grants, group commit
        self.lease = lease
        self.instance_id = instance_id
        self.release_dangling = release_dangling
        #: called with the provider's id when its usage report is not credible (the app counts it)
        self.on_not_credible: Callable[[str], None] | None = None

    async def start(self) -> None:
        if self.store_url is None or self.store is not None:
            return
        try:
            self.store = await Store.open(self.store_url, sqlite_synchronous=self.sqlite_synchronous)
        except StoreError as exc:
            log.error("cannot open the store: %s", exc.message)
            raise GatewayConfigError(f"store: {exc.message}") from None
        adm = Admission(self.store, instance_id=self.instance_id, lease=self.lease)
        try:
            n = await adm.start()  # releases only this id's rows and those of instances whose lease expired
        except StoreError as exc:
            await self.store.aclose()
            self.store = None
            log.error("cannot start budget admission: %s", exc.message)
            raise GatewayConfigError(f"store: {exc.message}") from None
        self.admission = adm
        if n and self.release_dangling:
            log.warning("released %d budget hold(s) of gateway instance(s) whose lease expired", n)

    async def aclose(self) -> None:
        if self.admission is not None:
            await self.admission.aclose()  # commits queued settlements, returns this instance's grants
            self.admission = None
        if self.store is not None:
            await self.store.aclose()
            self.store = None

    async def authenticate(self, authorization: str | None) -> Access:
        try:
            return Access(self.keyring.authenticate(authorization))
        except AuthenticationError as err:
            if self.store is None:
                raise
            key = _bearer(authorization)
            if key is None or parse_key(key) is None:
                raise err from None
            try:
                assert self.admission is not None
                principal = await self.admission.authenticate(key)  # cached; revocations seen within 1 s
            except StoreError as exc:
                log.error("key lookup failed: %s", exc.message)
                raise AccountsUnavailableError("The gateway could not check the API key.") from None
            if principal is None:
                raise AuthenticationError("Incorrect API key provided (unknown or revoked).") from None
            return Access(principal.project.name, principal)

    async def prepare(self, access: Access, body: dict[str, Any], ctx: RoutingContext) -> RoutingContext:
        """The routing context for this access: project policy + remaining budget, live receipts. Applies the
        project's default alias to ``body`` when it has no ``model``."""
        project = access.project
        live = self.store is not None and _wants_live(body)
        if project is None and not live:
            return ctx
        policy, pool = ctx.policy, ctx.pool
        try:
            if project is not None:
                assert self.store is not None
                if "model" not in body and project.default_alias is not None:
                    body["model"] = project.default_alias
                remaining = policy.remaining_budget_usd
                if project.budget_usd is not None:
                    assert self.admission is not None
                    left = await self.admission.remaining_usd(project)  # from memory
                    remaining = left if remaining is None or left is None else min(remaining, left)
                policy = ProjectPolicy(
                    allowed_providers=_intersect(policy.allowed_providers, project.allowed_providers),
                    allowed_models=_intersect(policy.allowed_models, project.allowed_models),
                    remaining_budget_usd=remaining,
                )
            if live:
                assert self.store is not None
                pool = with_certifications(pool, await self.store.certifications(valid_at=ctx.now))
        except StoreError as exc:
            log.error("reading project state failed: %s", exc.message)
            raise AccountsUnavailableError("The gateway could not read the project's budget.") from None
        return dataclasses.replace(ctx, policy=policy, pool=pool)

    def models_for(self, access: Access, models_body: bytes, pool: tuple[Candidate, ...]) -> bytes:
        """``GET /models`` for this access: a project restricted to some providers/models sees only the
        concrete models it may use (and every alias); others get the full list unchanged."""
        project = access.project
        if project is None or (project.allowed_providers is None and project.allowed_models is None):
            return models_body
        ap, am = project.allowed_providers, project.allowed_models
        usable = {
            c.model
            for c in pool
            if (ap is None or c.provider in ap) and (am is None or c.model in am or c.id in am)
        }
        listing = json.loads(models_body)
        listing["data"] = [m for m in listing["data"] if m["id"] in usable or m["owned_by"] == "ethen"]
        return json.dumps(listing, separators=(",", ":")).encode()

    def decide(self, body: Mapping[str, Any], ctx: RoutingContext, access: Access) -> Decision:
        """``decide``, with "a candidate the project may use was rejected only for its budget" as a budget
        error (402): more budget would let the request through. Candidates outside the project's allow-list
        never count (they carry ``provider_not_allowed``/``model_not_allowed``), so a free model the project
        may not use does not turn an exhausted budget into a 422; nor does a candidate with any other reason
        (a capability, a telemetry exclusion: its own error, e.g. 503, stands)."""
        try:
            return decide(body, ctx)
        except NoSmartRouteCandidateError as err:  # and its subclasses
            rej = err.rejections
            if access.project is not None and any(r.reasons == _ONLY_BUDGET for r in rej):
                raise BudgetExceededError(
                    f"Project {access.project.name!r} has not enough budget left in this "
                    f"{access.project.budget_window} for this request's estimated cost.",
                    rej,
                ) from None
            raise

    async def admit(self, access: Access, decision: Decision, request_id: str) -> Hold:
        """Reserve the request's estimated cost against its project's window budget."""
        project = access.project
        if project is None or self.admission is None:
            return Hold(None, access, None, request_id, None)
        reservation = None
        amount: float | None = None
        if project.budget_usd is not None:
            req = decision.requirements
            amount = max(max_cost_usd(sc.candidate, req) for sc in decision.chain)
            try:
                reservation = await self.admission.reserve(project, amount)  # in memory while the grant lasts
            except StoreError as exc:
                log.error("request %s: reserving budget failed: %s", request_id, exc.message)
                msg = "The gateway could not reserve the project's budget."
                raise AccountsUnavailableError(msg) from None
            if reservation is None:
                raise BudgetExceededError(
                    f"Project {project.name!r} has not enough budget left in this {project.budget_window}: "
                    f"the request may cost up to ${amount:.6f} (its estimated input plus max_tokens, or the "
                    "model's max output when max_tokens is unset)."
                )
        return Hold(
            self.admission, access, decision, request_id, reservation, amount, self.on_not_credible
        )


def accounts_for(cfg: GatewayConfig, keyring: KeyRing, env: Mapping[str, str] | None = None) -> Accounts:
    """The accounts of a gateway config (store-backed when it has a ``[store]`` section)."""
    sc = cfg.store
    if sc is None:
        return Accounts(keyring)
    url = store_url(cfg, env)
    assert url is not None
    try:
        normalize_url(url)
    except StoreError as exc:
        raise GatewayConfigError(f"store.url: {exc.message}") from None
    return Accounts(
        keyring,
        store_url=url,
        lease=timedelta(seconds=sc.lease_s),
        instance_id=sc.instance_id,
        release_dangling=sc.release_dangling,
        sqlite_synchronous=sc.sqlite_synchronous,
    )
