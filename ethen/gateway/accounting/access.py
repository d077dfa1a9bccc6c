"""Who a request acts for (:class:`Access`): a config key, or a store key of one project. Read by the
accounts (:mod:`ethen.gateway.accounting.accounts`), the budget hold (:mod:`ethen.gateway.accounting.hold`)
and the rate limits."""

from __future__ import annotations

from dataclasses import dataclass

from ethen.store import Principal, Project

__all__ = ["Access"]


@dataclass(frozen=True, slots=True)
class Access:
    """Who a request acts for: a config key (``principal`` is ``None``) or a store key of one project."""

    name: str
    principal: Principal | None = None

    @property
    def project(self) -> Project | None:
        return self.principal.project if self.principal is not None else None
