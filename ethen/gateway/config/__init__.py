"""The gateway's one config file: TOML (stdlib ``tomllib``), validated with pydantic at start.

Layout (see ``examples/gateway.toml``)::

    [server]            host, port, header_timeout_s (10), body_timeout_s (60), max_connections (1000),
                        max_connections_per_client, max_pending_headers_per_client (32): slow-client limits
                        and the per-address fair share; trusted_proxies ([]: IPs / CIDRs whose
                        X-Forwarded-For is believed) (see ethen.gateway.api.connections)
    [[providers]]       id, kind ("openai_compat" | "anthropic" | "gemini" | "azure_openai"), base_url
                        (or api_base / endpoint), api_key_env, api_version (azure_openai), headers,
                        max_connections, [providers.timeouts] connect_s / first_byte_s / total_s
    [[providers]]       id, kind = "mesh", [providers.workers] node_id = "host:port" (at least one),
                        [providers.weights] latency / load / capacity / hop / prompt (route cost weights,
                        unset = the spec's defaults), fallback_model, health_interval_s, forward_timeout_s,
                        progress_timeout_s (a stage call's deadline per 128 rows: stuck nodes),
                        admission_timeout_s (a request's wait for worker slots: 503 mesh_saturated),
                        max_queue (per chain: requests waiting for a first token; then another chain),
                        start_timeout_s, join, member_expiry_s (10: a joined worker silent this long
                        leaves; ethen.mesh.orchestrator.members), insecure (a join registry without a
                        token), allow_private_join (Joins at private addresses) (see
                        ``examples/gateway-mesh.toml``)
    [[routes]]          route profiles: model (gateway-visible id), provider, upstream_model (default: model),
                        catalog_model (catalog lookup id, default: upstream_model), catalog_provider
                        (catalog provider id, default: provider),
                        [routes.info] ModelInfo overrides, [routes.prices] Prices overrides (USD/Mtok),
                        endpoint ("chat" | "embeddings": served by POST /embeddings only, see
                        ethen.gateway.api.embeddings)
    [[api_keys]]        name, sha256 (hex SHA-256 of the full key; keys start with "ethen"), rpm, tpm
                        (rate limits: requests / tokens per [rate_limits] window;
                        ethen.gateway.accounting.ratelimit)
    [[canaries]]        alias, candidate ("provider/model"), percent, min_success_rate, min_samples
                        (the spec's camelCase minSuccessRate / minSamples are accepted too)
    [[shadows]]         alias, candidate ("provider/model"), percent (0-100), project (pays),
                        max_in_flight (8), min_success_rate (0.95), min_samples (20): shadow evaluation,
                        needs [store] (see ethen.gateway.api.shadow)
    [policy]            allowed_providers, allowed_models, remaining_budget_usd
    [store]             url or url_env (SQLAlchemy URL: sqlite:///ethen.db, postgresql://...),
                        admin_key_sha256, lease_s, instance_id, release_dangling (see ethen.store.admission)
    [circuit]           cooldown_s (2.0), max_cooldown_s (10.0), probe (true): half-open recovery of a
                        provider excluded by the failing gate (see ethen.gateway.circuit)
    [shared]            redis_url or redis_url_env, key_prefix ("ethen"), timeout_s (0.5): state shared by
                        several gateway instances (telemetry, rate limits; see ethen.gateway.shared)
    [rate_limits]       window_s (60), [rate_limits.projects.NAME] / [rate_limits.keys.KEY_ID] rpm, tpm
                        (store projects and keys; see ethen.gateway.accounting.ratelimit)
    [log]               retention_days (30), max_rows (1,000,000), memory_rows (10,000), queue_size,
                        prune_interval_s, admin_key_sha256: the request log (see
                        ethen.gateway.observation.requestlog)
    [otel]              endpoint (OTLP/HTTP traces; unset: off), service_name (see
                        ethen.gateway.observation.tracing)
    [model_map]         "glob" = "alias or route": model names of the Messages API (Claude Code's), first
                        match in file order (see ethen.gateway.api.messages)
    [compat]            drop_unsupported_tools (true): hosted Responses tools no candidate can run are
                        dropped and named in the answer; false: 400 (see ethen.gateway.api.responses_tools)

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

from .accounts import *  # noqa: F403
from .accounts import __all__ as _accounts_all
from .build import *  # noqa: F403
from .build import __all__ as _build_all
from .load import *  # noqa: F403
from .load import __all__ as _load_all
from .overlay import *  # noqa: F403
from .overlay import __all__ as _overlay_all
from .providers import *  # noqa: F403
from .providers import __all__ as _providers_all
from .routes import *  # noqa: F403
from .routes import __all__ as _routes_all
from .schema import *  # noqa: F403
from .schema import __all__ as _schema_all
from .server import *  # noqa: F403
from .server import __all__ as _server_all
from .services import *  # noqa: F403
from .services import __all__ as _services_all

__all__ = [
    *_schema_all,
    *_server_all,
    *_providers_all,
    *_routes_all,
    *_accounts_all,
    *_services_all,
    *_load_all,
    *_build_all,
    *_overlay_all,
]
