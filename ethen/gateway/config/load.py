"""Reading a gateway config: TOML -> :class:`~.schema.GatewayConfig` with errors that name the key and the
value, cross-section checks, secrets from the environment."""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.routing import ALIASES, RECENT_MAX_OUTCOMES

from .providers import _KINDS, MESH_MODEL, MeshProviderConfig, ProviderConfig
from .schema import GatewayConfig

__all__ = [
    "load_config",
    "parse_config",
    "resolve_secret",
    "shared_redis_url",
    "skip_providers_without_keys",
    "store_url",
]

log = logging.getLogger("ethen.gateway.config")


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
    _check_cache(cfg)
    for i, c in enumerate(cfg.canaries):
        if c.alias not in ALIASES:
            raise GatewayConfigError(
                f"canaries[{i}].alias = {c.alias!r}: unknown alias (known: {sorted(ALIASES)})"
            )
        if c.candidate not in routes:
            raise GatewayConfigError(
                f"canaries[{i}].candidate = {c.candidate!r}: no such provider/model in [[routes]]"
            )
    _check_aliases("hedges", [h.alias for h in cfg.hedges])  # issue 27
    for i, h in enumerate(cfg.hedges):
        if h.after_percentile is not None and h.min_samples > RECENT_MAX_OUTCOMES:
            raise GatewayConfigError(
                f"hedges[{i}].min_samples = {h.min_samples!r}: at most {RECENT_MAX_OUTCOMES} (a candidate's "
                f"TTFT samples are its last {RECENT_MAX_OUTCOMES} successful attempts in the telemetry "
                "window: a larger minimum would never be met and the rule would never hedge)"
            )
    _check_shadows(cfg, routes)
    _check_aliases("wait_targets", [w.alias for w in cfg.wait_targets])  # issue 44
    chat_routes = [r for r in cfg.routes if r.endpoint == "chat"]
    chat = {r.model for r in chat_routes} | {f"{r.provider}/{r.model}" for r in chat_routes}
    for pattern, target in cfg.model_map.items():  # [model_map]: Messages API model names (issue 26)
        if target not in ALIASES and target not in chat:
            raise GatewayConfigError(f"model_map.{pattern!r} = {target!r}: not an ethen/* alias nor a chat "
                                     "route's model or provider/model")
    for key in ("allowed_providers",):
        for j, v in enumerate(cfg.policy.allowed_providers or ()):
            if v not in seen:
                raise GatewayConfigError(f"policy.{key}[{j}] = {v!r}: unknown provider (known: {known})")


def _check_shadows(cfg: GatewayConfig, routes: Mapping[str, int]) -> None:
    """``[[shadows]]`` (issue 27): need ``[store]`` (the pairs are recorded there), a known alias, a chat
    route as candidate, one entry per (alias, candidate)."""
    seen: dict[tuple[str, str], int] = {}
    for i, sh in enumerate(cfg.shadows):
        if cfg.store is None:
            raise GatewayConfigError(
                f"shadows[{i}].alias = {sh.alias!r}: [[shadows]] needs a [store] section (store.url or "
                "store.url_env): shadow pairs are recorded durably and paid from a store project's budget"
            )
        if sh.alias not in ALIASES:
            raise GatewayConfigError(
                f"shadows[{i}].alias = {sh.alias!r}: unknown alias (known: {sorted(ALIASES)})"
            )
        if abs(sh.percent * 100 - round(sh.percent * 100)) > 1e-6:
            raise GatewayConfigError(
                f"shadows[{i}].percent = {sh.percent!r}: at most two decimals (sampling is in steps of "
                f"0.01 %: this value would sample {round(sh.percent * 100) / 100!r} %)"
            )
        j = routes.get(sh.candidate)
        if j is None or cfg.routes[j].endpoint != "chat":
            raise GatewayConfigError(
                f"shadows[{i}].candidate = {sh.candidate!r}: no such chat provider/model in [[routes]]"
            )
        key = (sh.alias, sh.candidate)
        if key in seen:
            raise GatewayConfigError(
                f"shadows[{i}].candidate = {sh.candidate!r}: duplicate for alias {sh.alias!r} "
                f"(also shadows[{seen[key]}])"
            )
        seen[key] = i


def _check_cache(cfg: GatewayConfig) -> None:
    """``[cache]`` (issue 27): the redis backend needs ``[shared]``; the opt-in lists name known aliases and
    chat routes."""
    cc = cfg.cache
    if cc.backend == "redis" and cfg.shared is None:
        raise GatewayConfigError(
            "cache.backend = 'redis': needs a [shared] section (redis_url or redis_url_env) to share"
        )
    for j, a in enumerate(cc.aliases or ()):
        if a not in ALIASES:
            raise GatewayConfigError(f"cache.aliases[{j}] = {a!r}: unknown alias (known: {sorted(ALIASES)})")
    chat_routes = [r for r in cfg.routes if r.endpoint == "chat"]
    chat = {r.model for r in chat_routes} | {f"{r.provider}/{r.model}" for r in chat_routes}
    for j, r in enumerate(cc.routes or ()):
        if r not in chat:
            raise GatewayConfigError(
                f"cache.routes[{j}] = {r!r}: no chat route has this model or provider/model"
            )


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
    """``cfg`` without the providers whose ``api_key_env`` variable is unset or empty, nor their routes,
    canaries and shadows; one WARNING per skipped provider names it and the variable. Raises
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
        "shadows": [sh for sh in cfg.shadows if sh.candidate.partition("/")[0] not in missing],
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


def _check_aliases(section: str, aliases: list[str]) -> None:
    """Each entry of a per-alias section (``[[hedges]]``, ``[[wait_targets]]``): a known alias, once."""
    seen: dict[str, int] = {}
    for i, alias in enumerate(aliases):
        if alias not in ALIASES:
            raise GatewayConfigError(
                f"{section}[{i}].alias = {alias!r}: unknown alias (known: {sorted(ALIASES)})"
            )
        if alias in seen:
            raise GatewayConfigError(
                f"{section}[{i}].alias = {alias!r}: duplicate (also {section}[{seen[alias]}])"
            )
        seen[alias] = i
