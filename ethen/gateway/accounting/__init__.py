"""Accounting: who a request acts for (keys, ``access``), the accounts (projects, budgets, the store
behind them), the budget hold (reserve, settle, release) and the rpm / tpm rate limits."""

__all__: list[str] = []
