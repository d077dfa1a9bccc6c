"""``ethen up --config FILE``: a partial gateway config (an *overlay*) merged into the config ``ethen up``
generates (its mesh provider, the mesh's route, its API key, its store).

:func:`merge_overlay` is the one merge rule, used by ``ethen up`` (``ethen.up_config.gateway_document``) and
by the commands that read an overlay (``ethen shadows promote --config``): its ``[[providers]]``,
``[[routes]]``, ``[[api_keys]]``, ``[[canaries]]`` and ``[[wait_targets]]`` (issue 44) are appended after the
generated ones, its ``[server]`` is ignored (``ethen up --host/--port`` decide), its ``[store]`` replaces the
embedded one (the admin key's digest added when it sets none) and every other section is used as given.
:func:`parse_overlay` validates an overlay as ``ethen up`` would serve it, over a stand-in of the generated
part (a mesh provider at a placeholder address): its errors name the overlay file and say that its entries
come after the mesh's ``providers[0]`` and ``routes[0]``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ethen.gateway.errors import GatewayConfigError
from ethen.paths import default_store_url

from .load import parse_config
from .providers import MESH_MODEL
from .schema import GatewayConfig

__all__ = ["DB_ENV", "MERGED_SECTIONS", "embedded_store", "load_overlay", "merge_overlay", "parse_overlay",
           "read_overlay", "stand_in_document"]

DB_ENV = "ETHEN_DATABASE_URL"
#: the overlay's tables appended after the generated ones (the rest replace them)
MERGED_SECTIONS = ("providers", "routes", "api_keys", "canaries", "wait_targets")
_PLACEHOLDER_SHA = "0" * 64


def embedded_store() -> dict[str, Any]:
    """``ethen up``'s store when the overlay has none: ``$ETHEN_DATABASE_URL`` if set, else SQLite in the
    data directory."""
    return {"url_env": DB_ENV} if os.environ.get(DB_ENV) else {"url": default_store_url()}


def merge_overlay(doc: Mapping[str, Any], overlay: Mapping[str, Any] | None,
                  admin_key_sha256: str | None = None) -> dict[str, Any]:
    """``doc`` (the generated config) with ``overlay`` merged in (see the module). With ``admin_key_sha256``:
    a store (the overlay's, else :func:`embedded_store`) carrying that admin key unless it sets one."""
    user = dict(overlay or {})
    user.pop("server", None)
    out = dict(doc)
    for section in MERGED_SECTIONS:
        extra = user.pop(section, [])
        merged = [*out.get(section, []), *(extra if isinstance(extra, list) else [extra])]
        if merged or section in out:
            out[section] = merged
    if admin_key_sha256 is not None:
        store = user.pop("store", None)
        if store is None:
            store = embedded_store()
        if isinstance(store, dict):  # anything else: validation names it
            store = {**store, "admin_key_sha256": store.get("admin_key_sha256", admin_key_sha256)}
        out["store"] = store
    out.update(user)  # policy, store, and anything unknown (which validation then names)
    return out


def stand_in_document(host: str = "127.0.0.1", port: int = 8080,
                      workers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The generated part of ``ethen up``'s config with placeholder worker addresses and no key: what an
    overlay is merged into to be checked before any worker starts."""
    return {
        "server": {"host": host, "port": port},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": dict(workers or {"gpu": "127.0.0.1:1"})}],
        "routes": [{"model": MESH_MODEL, "provider": "mesh"}],
        "api_keys": [],
    }


def _source(source: str) -> str:
    return f"{source} (an `ethen up` overlay: its entries come after the mesh's providers[0] and routes[0])"


def parse_overlay(overlay: Mapping[str, Any], *, source: str, base: Mapping[str, Any] | None = None,
                  admin_key_sha256: str | None = _PLACEHOLDER_SHA) -> GatewayConfig:
    """The config ``ethen up --config`` serves with ``overlay``, validated (``GatewayConfigError`` naming
    ``source``, the key and the value). ``base``: the generated part (default :func:`stand_in_document`)."""
    doc = merge_overlay(stand_in_document() if base is None else base, overlay, admin_key_sha256)
    return parse_config(doc, source=_source(source))


def read_overlay(path: Path) -> dict[str, Any]:
    """An overlay file's TOML (``GatewayConfigError`` naming the file when it cannot be read or parsed)."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise GatewayConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise GatewayConfigError(f"{path}: not valid TOML: {exc}") from None


def load_overlay(path: Path) -> GatewayConfig:
    """:func:`parse_overlay` of a file."""
    return parse_overlay(read_overlay(path), source=str(path))
