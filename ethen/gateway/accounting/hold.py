"""One admitted request's budget hold: settle it (served) or release it (not served), exactly once.

:class:`Hold` is made by :meth:`ethen.gateway.accounting.accounts.Accounts.admit` with the request's
reservation; the
pipeline settles it with the served candidate's usage (:meth:`Hold.settle_soon`: queued at once, awaited
before the answer leaves) or releases it.

Choices where the spec is silent:
- **Credible usage** (:func:`credible_usage`): an upstream's report is billed only if its completion tokens
  are within ``n`` x the request's max output (or the model's when unset), its prompt tokens within
  ``PROMPT_FACTOR`` (4) x the estimate + ``PROMPT_SLACK_TOKENS`` (1,024: provider-side prompts such as a
  tool-use preamble; a tokenizer yields at most one token per byte, 3x the bytes/3 estimate), no count is
  negative and the total is within twice the context window. Otherwise the request settles its served
  candidate's maximum cost (what its reservation held), the ledger row is flagged ``estimated``, a WARNING is
  logged and ``ethen_gateway_usage_not_credible_total{provider}`` counts it.
- **A reservation too small for a credible report** (a prompt tokenized above the bytes/3 estimate, e.g. a
  provider-side preamble or chat template; issue 42): the hold is topped up to the reported cost from the
  project's budget (:meth:`ethen.store.Admission.extend`, in memory) and the request settles what it really
  cost. Only when the budget cannot cover the difference does it settle its reservation instead: a WARNING
  and ``ethen_gateway_settled_capped_total{provider}`` say so. Either way a project's settled spend never
  exceeds its budget. (Shadow calls reserve :func:`max_credible_cost_usd` up front, so theirs never needs a
  top-up: a shadow its project cannot afford is not sent.)
- **Actual cost** = the upstream usage priced by :func:`ethen.gateway.accounting.pricing.cost_of`
(genai-prices' own
  calculation with cache reads/writes and tiers; the route's prices for a model genai-prices does not
  know). When the upstream reports no usage (e.g.
  a stream cut before its usage chunk), the served candidate's *estimated* cost is settled and the ledger row
  is flagged ``estimated``.
- A settlement is queued to the ledger writer synchronously (no await before it is queued) and releasing is
  shielded from cancellation, so a client hanging up mid-stream still settles, and
  so does one that hangs up before the first byte (the stream's generator settles when the server closes it;
  ``test_service_budget.py::test_client_gone_before_the_first_byte_settles_and_releases``). A reservation
  that is somehow never settled (a gateway killed mid-request) stops counting when the process's lease
  expires (``[store] lease_s``, 2.5 s; :mod:`ethen.store.escrow`): budget is held back that long, never
  overspent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio

from ethen.gateway.accounting.pricing import cost_of
from ethen.gateway.errors import AccountsUnavailableError
from ethen.gateway.providers.base import Usage
from ethen.gateway.routing import Candidate, Decision, Requirements
from ethen.store import Admission, StoreError, Ticket

if TYPE_CHECKING:
    from ethen.gateway.accounting.access import Access

__all__ = [
    "PROMPT_FACTOR",
    "PROMPT_SLACK_TOKENS",
    "Hold",
    "credible_usage",
    "max_completion_tokens",
    "max_cost_usd",
    "max_credible_cost_usd",
]

log = logging.getLogger("ethen.accounts")
T = TypeVar("T")
#: Reported prompt tokens are credible up to PROMPT_FACTOR x the request's estimate + PROMPT_SLACK_TOKENS.
PROMPT_FACTOR = 4
PROMPT_SLACK_TOKENS = 1024


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


def max_credible_cost_usd(candidate: Candidate, req: Requirements) -> float:
    """The most a usage report :func:`credible_usage` accepts can cost on ``candidate`` at its route prices:
    ``PROMPT_FACTOR`` x the estimated input + ``PROMPT_SLACK_TOKENS`` prompt tokens plus
    :func:`max_completion_tokens` (what a shadow call reserves, so it settles its real usage)."""
    p = candidate.prices
    prompt = PROMPT_FACTOR * req.input_tokens + PROMPT_SLACK_TOKENS
    return (prompt * p.input_per_mtok + max_completion_tokens(candidate, req) * p.output_per_mtok) / 1e6


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
        on_capped: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._access = access
        self._decision = decision
        self._rid = request_id
        self._reservation = reservation
        self._reserved_usd = reserved_usd  # the settled cost's cap (None: no budget, nothing reserved)
        self._on_not_credible = on_not_credible  # the metric (set by the app)
        self._on_capped = on_capped  # the metric of a settlement capped at its reservation (set by the app)
        self._done = store is None or access.principal is None
        self._queued = False

    @property
    def queued(self) -> bool:
        """True once :meth:`settle_soon` queued a settlement to the ledger writer (its commit under way)."""
        return self._queued

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
        self._queued = True
        return self._committed(committed)

    def settle_input_soon(self, candidate: Candidate, usage: Usage | None) -> Awaitable[None]:
        """Settle an attempt cancelled before it answered (a hedge's loser, issue 27): at what its upstream
        reported when it reported usage, else at its estimated *input* cost (the request's estimated input
        tokens at the candidate's input price; ledger row flagged ``estimated``). Otherwise as
        :meth:`settle_soon`."""
        if usage is not None or self._done:
            return self.settle_soon(candidate, usage)
        req = self._decision.requirements if self._decision is not None else None
        cost = req.input_tokens * candidate.prices.input_per_mtok / 1e6 if req is not None else 0.0
        self._done = True
        try:
            committed = self._queue(candidate, None, cost)
        except StoreError as exc:
            return self._unavailable(exc)
        self._queued = True
        return self._committed(committed)

    async def settle_rendering(self, candidate: Candidate, usage: Usage | None, render: Callable[[], T]) -> T:
        """Queue the settlement, run ``render`` (the answer's body) while it commits, then await the commit
        (raising :class:`AccountsUnavailableError` if the spend could not be recorded): the answer leaves
        only after its ledger entry is durable. With a settlement queued, the loop gets one turn before
        ``render``: the ledger writer, woken by the entry, sends its batch (Postgres: the statement; SQLite
        FULL: the COMMIT to its thread) so the render overlaps the commit's round trip instead of preceding
        it (``bench/gateway_versions.py HEAD~ --store URL``)."""
        committed = self.settle_soon(candidate, usage)
        try:
            if self.queued:
                await asyncio.sleep(0)
            return render()
        finally:
            await committed

    async def _committed(self, committed: asyncio.Future[None]) -> None:
        # the entry is queued already: a cancelled waiter leaves it to commit (the writer commits every entry
        # it took and sets only futures not done, so the waiter awaits the writer's future itself: no
        # asyncio.shield, whose second future costs a loop turn; anyio's CancelScope cost ~0.1 ms)
        try:
            await committed
        except StoreError as exc:
            await self._unavailable(exc)

    async def _unavailable(self, exc: StoreError) -> None:
        log.error("request %s: settling spend failed: %s", self._rid, exc.message)
        raise AccountsUnavailableError("The gateway could not record the request's spend.") from None

    def _queue(
        self, candidate: Candidate, usage: Usage | None, input_cost: float | None = None
    ) -> asyncio.Future[None]:
        assert self._store is not None and self._access.principal is not None
        req = self._decision.requirements if self._decision is not None else None
        saved = 0.0  # what the usage's cache reads saved (issue 45; the ledger's saved_nano)
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
        elif usage is not None:  # genai-prices' calculation (cache reads/writes, tiers), else route prices
            priced = cost_of(candidate, usage)
            cost, saved = priced.total_usd, priced.saved_usd
        elif input_cost is not None:  # a cancelled hedge loser (settle_input_soon)
            cost = input_cost
        else:
            chain = self._decision.chain if self._decision is not None else ()
            cost = next((sc.estimated_cost_usd for sc in chain if sc.candidate.id == candidate.id), 0.0)
        if self._reserved_usd is not None and cost > self._reserved_usd and not self._top_up(cost):
            log.warning(
                "request %s: %s's usage costs $%.6f, above the $%.6f reserved, and the project's budget "
                "cannot cover the difference; settling the reservation (the budget is never overspent)",
                self._rid, candidate.id, cost, self._reserved_usd,
            )
            if self._on_capped is not None:
                self._on_capped(candidate.provider)
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
            cache_read_tokens=usage.cache_read_tokens if usage else 0,
            cache_write_tokens=usage.cache_write_tokens if usage else 0,
            saved_usd=saved,
        )

    def _top_up(self, cost: float) -> bool:
        """Grow the reservation to ``cost`` from the budget (in memory: :meth:`Admission.extend`); ``False``
        when the budget cannot cover it."""
        if self._reservation is None or self._store is None:
            return False
        grown = self._store.extend(self._reservation, cost)
        if grown is None:
            return False
        self._reservation, self._reserved_usd = grown, cost
        return True

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
