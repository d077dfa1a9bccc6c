"""The sections of who may call and what they may spend: ``[[api_keys]]`` (config keys), ``[policy]``,
``[store]`` (durable projects, keys and budgets: :mod:`ethen.store`) and ``[rate_limits]``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

from .base import _float, _Strict

__all__ = [
    "ApiKeyConfig",
    "PolicyConfig",
    "RateLimitConfig",
    "RateLimitsConfig",
    "StoreConfig",
]


class ApiKeyConfig(_Strict):
    name: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    rpm: int | None = Field(default=None, ge=1)  # requests per [rate_limits] window (accounting.ratelimit)
    tpm: int | None = Field(default=None, ge=1)  # tokens per [rate_limits] window

class PolicyConfig(_Strict):
    allowed_providers: list[str] | None = None
    allowed_models: list[str] | None = None
    remaining_budget_usd: float | None = Field(default=None, ge=0)

    @field_validator("remaining_budget_usd", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class StoreConfig(_Strict):
    """Durable projects/keys/budgets/receipts (``ethen.store``). ``url_env`` names an environment variable
    holding the URL (use it when the URL has a password). ``admin_key_sha256`` enables the admin API."""

    url: str | None = Field(None, min_length=1)
    url_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    admin_key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    reservation_ttl_s: float = Field(900.0, gt=0)  # accepted for older configs; holds now expire with lease_s
    release_dangling: bool = True  # log what start-up released (only dead instances' holds)
    #: A dead (killed, frozen) instance's budget grants count this long after its last renewal (heartbeat
    #: every lease_s/5; it admits from memory only while its last renewal is younger than 3/5 of it).
    lease_s: float = Field(2.5, ge=1.0, le=3600.0)
    instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,64}$")  # default: random per process
    #: SQLite only. NORMAL (default, as Rails and Litestream set WAL databases up): a settled entry is in the
    #: WAL before the answer leaves, so it survives a crash or ``kill -9`` of the gateway, not a power loss or
    #: a kernel crash. FULL: also those (an fsync per group commit, ~0.4 ms more per request here).
    sqlite_synchronous: Literal["FULL", "NORMAL", "EXTRA"] = "NORMAL"
    #: Postgres only: ``synchronous_commit`` of the ledger's settlements. off (default, the counterpart of
    #: SQLite's NORMAL): a settled entry is committed and visible to every instance before the answer
    #: leaves, and survives a crash or ``kill -9`` of the gateway, but a crash of the Postgres server loses
    #: the last <= 600 ms of settlements. on (Postgres's own default): also flushed to the server's WAL on
    #: disk first (~1 ms more per request here). Other writes keep the server's setting.
    postgres_synchronous_commit: Literal["on", "off"] = "off"

    @field_validator("reservation_ttl_s", "lease_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

class RateLimitConfig(_Strict):
    """Requests (``rpm``) and tokens (``tpm``) per ``[rate_limits] window_s`` (a minute by default)."""

    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)


_Name = Annotated[str, StringConstraints(min_length=1)]


class RateLimitsConfig(_Strict):
    """Rate limits of store projects (by name) and store keys (by key id); config keys set ``rpm``/``tpm`` in
    ``[[api_keys]]``. ``window_s``: the sliding window the limits count over (60 s: per minute)."""

    window_s: float = Field(default=60.0, gt=0, le=86_400)
    projects: dict[_Name, RateLimitConfig] = Field(default_factory=dict)
    keys: dict[_Name, RateLimitConfig] = Field(default_factory=dict)

    @field_validator("window_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)
