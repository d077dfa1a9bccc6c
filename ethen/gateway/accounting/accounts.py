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
- **Budget errors**: HTTP **402** with code ``budget_exceeded`` (type ``insufficient_quota``): 429 would make
  OpenAI SDKs retry automatically, which cannot help until the window rolls over or the budget is raised.
  It is used both when the reservation loses a race and when ``decide`` finds no candidate and one the
  project may use was rejected *only* because of the remaining window budget (then the rejections are
  attached, as for ``no_smart_route_candidate``). Candidates outside the project's allow-list never decide it.
- A store failure is a 503 ``store_unavailable``; the message names no key, URL or password.
- Settling (credible usage, the actual cost, cancellation): :mod:`ethen.gateway.accounting.hold`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from ethen.gateway.accounting.access import Access
from ethen.gateway.accounting.auth import KeyRing
from ethen.gateway.accounting.hold import (
    PROMPT_FACTOR,
    PROMPT_SLACK_TOKENS,
    Hold,
    credible_usage,
    max_completion_tokens,
    max_cost_usd,
)
from ethen.gateway.config import GatewayConfig, store_url
from ethen.gateway.errors import (
    AccountsUnavailableError,
    AuthenticationError,
    BudgetExceededError,
    GatewayConfigError,
    NoSmartRouteCandidateError,
)
from ethen.gateway.routing import (
    Candidate,
    Decision,
    LiveCertification,
    ProjectPolicy,
    RoutingContext,
    decide,
)
from ethen.gateway.routing.reasons import OVER_PROJECT_BUDGET
from ethen.store import (
    Admission,
    CertificationReceipt,
    Store,
    StoreError,
    parse_key,
)
from ethen.store.engine import normalize_url
from ethen.store.escrow import DEFAULT_LEASE

__all__ = [
    "PROMPT_FACTOR",
    "PROMPT_SLACK_TOKENS",
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
_ONLY_BUDGET = (OVER_PROJECT_BUDGET,)

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


class Accounts:
    """Authentication, project policy and budget admission. Without a store URL only config keys exist."""

    def __init__(
        self,
        keyring: KeyRing,
        *,
        store_url: str | None = None,
        lease: timedelta = DEFAULT_LEASE,
        instance_id: str | None = None,
        release_dangling: bool = True,
        sqlite_synchronous: str = "NORMAL",
        postgres_synchronous_commit: str = "off",
    ) -> None:
        self.keyring = keyring
        self.sqlite_synchronous = sqlite_synchronous
        self.postgres_synchronous_commit = postgres_synchronous_commit
        self.store_url = store_url
        self.store: Store | None = None
        self.admission: Admission | None = None  # key cache, grants, group commit
        self.lease = lease
        self.instance_id = instance_id
        self.release_dangling = release_dangling
        #: called with the provider's id when its usage report is not credible (the app counts it)
        self.on_not_credible: Callable[[str], None] | None = None
        self.on_capped: Callable[[str], None] | None = None

    async def start(self) -> None:
        if self.store_url is None or self.store is not None:
            return
        try:
            self.store = await Store.open(self.store_url, sqlite_synchronous=self.sqlite_synchronous,
                                          postgres_synchronous_commit=self.postgres_synchronous_commit)
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
                budget = BudgetExceededError(
                    f"Project {access.project.name!r} has not enough budget left in this "
                    f"{access.project.budget_window} for this request's estimated cost.",
                    rej,
                )
                budget.receipt = err.receipt  # the refused decision, for the request log
                raise budget from None
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
            self.admission, access, decision, request_id, reservation, amount, self.on_not_credible,
            self.on_capped
        )

    async def admit_extra(self, access: Access, decision: Decision, request_id: str) -> Hold | None:
        """A second hold for a hedge of an admitted request (issue 27): the same amount :meth:`admit`
        reserved (the largest maximum cost over the chain, so either attempt's cost fits under it), or
        ``None`` when the project's budget cannot cover it (the hedge is skipped). Without a budget: a hold
        that reserves nothing (and settles the ledger row like :meth:`admit`'s)."""
        try:
            return await self.admit(access, decision, request_id)
        except (BudgetExceededError, AccountsUnavailableError):
            return None


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
        postgres_synchronous_commit=sc.postgres_synchronous_commit,
    )
