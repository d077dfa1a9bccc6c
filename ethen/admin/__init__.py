"""Administration of the gateway's durable state: the request-path accounts (keys, project policy, budget
admission and settlement), the admin HTTP API and the ``ethen keys / projects / usage / certify`` commands."""

from .accounts import (
    Access,
    Accounts,
    AccountsUnavailableError,
    BudgetExceededError,
    Hold,
    with_certifications,
)

__all__ = [
    "Access",
    "Accounts",
    "AccountsUnavailableError",
    "BudgetExceededError",
    "Hold",
    "with_certifications",
]
