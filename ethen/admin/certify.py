"""Live certification: send one probe request to a configured provider/model and store a dated receipt.

The probe is a minimal chat completion (``"Reply with OK."``, ``max_tokens`` 16, temperature 0) sent through
the same provider code the gateway uses (same base URL, credentials, timeouts). It passes when the upstream
answers 2xx with a chat completion that has at least one choice; the receipt records the probe's latency,
the upstream model and usage, never a credential. A failed probe stores nothing and raises
:class:`CertificationError`. The receipt is valid on ``[now, now + valid_for)``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ethen.gateway.config import GatewayConfig
from ethen.gateway.errors import GatewayError
from ethen.gateway.providers import build_providers
from ethen.gateway.providers.base import UpstreamCall
from ethen.store import CertificationReceipt, Store

__all__ = ["CertificationError", "UnknownTargetError", "certify", "parse_duration"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class CertificationError(GatewayError):
    """The probe could not run or failed (message names the target, never a secret). Part of the gateway's
    one exception tree, like every error ``ethen.admin`` raises."""

    default_code = "certification_failed"
    exit_code = 1  # the CLI's exit status: the probe ran and failed


class UnknownTargetError(CertificationError):
    """PROVIDER/MODEL is not a route of the config."""

    exit_code = 2  # a usage error


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``24h``, ``7d`` -> timedelta (> 0)."""
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"duration = {text!r}: use a positive number with s, m, h or d (e.g. 7d)")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


async def certify(
    cfg: GatewayConfig,
    store: Store,
    target: str,
    *,
    valid_for: timedelta,
    env: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> CertificationReceipt:
    provider_id, sep, model = target.partition("/")
    route = next((r for r in cfg.routes if r.provider == provider_id and r.model == model), None)
    if not sep or route is None:
        known = ", ".join(f"{r.provider}/{r.model}" for r in cfg.routes)
        raise UnknownTargetError(
            f"target = {target!r}: no such provider/model route in the config (known: {known})"
        )
    try:
        providers = build_providers(cfg.model_copy(update={"providers": [cfg.provider(provider_id)]}), env)
    except GatewayError as exc:
        raise CertificationError(f"{target}: {exc.message}") from None
    provider = providers[provider_id]
    body: dict[str, Any] = {
        "model": route.upstream,
        "messages": [{"role": "user", "content": "Reply with OK."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    rid = f"certify-{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    try:
        comp = await provider.complete(UpstreamCall(body, route.upstream, rid))
    except GatewayError as exc:
        raise CertificationError(f"{target}: probe failed ({exc.code}): {exc.message}") from None
    finally:
        await provider.aclose()
    latency_ms = (time.perf_counter() - t0) * 1000
    choices = comp.body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise CertificationError(f"{target}: probe answer has no choices")
    at = datetime.now(UTC) if now is None else now
    probe = {
        "status": "ok",
        "request_id": rid,
        "latency_ms": round(latency_ms, 3),
        "upstream_model": route.upstream,
        "response_model": comp.body.get("model"),
        "usage": comp.usage.to_openai() if comp.usage else None,
    }
    return await store.add_certification(
        provider_id, model, certified_at=at, expires_at=at + valid_for, probe=probe
    )
