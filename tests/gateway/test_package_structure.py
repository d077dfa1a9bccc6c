"""Code-structure rules checked on the packages themselves: an explicit ``__all__`` in every package and
module, and one exception tree per package (every exception class a package defines derives from its
one root)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

from ethen.gateway.errors import GatewayError
from ethen.mesh.errors import MeshError
from ethen.mesh.routing.errors import MeshRoutingError
from ethen.model.errors import GGUFFormatError, ModelError, WeightsNotFoundError
from ethen.store.errors import StoreError

# package (or module) -> the root of its exception tree (ethen.admin maps everything into the gateway's tree)
ROOTS: dict[str, type[Exception]] = {
    "ethen.gateway": GatewayError,
    "ethen.admin": GatewayError,
    "ethen.store": StoreError,
    "ethen.mesh": MeshError,
    "ethen.mesh.routing": MeshRoutingError,
}


def _modules(package: str) -> list[ModuleType]:
    pkg = importlib.import_module(package)
    out = [pkg]
    for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=f"{package}."):
        out.append(importlib.import_module(info.name))
    return out


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_module_has_an_explicit_all(package: str) -> None:
    missing = [
        m.__name__ for m in _modules(package)
        if not isinstance(getattr(m, "__all__", None), list | tuple)
        and not m.__name__.endswith(("_pb2", "_pb2_grpc"))  # protoc's generated modules
    ]
    assert not missing, f"modules without __all__: {missing}"


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_one_exception_tree_per_package(package: str) -> None:
    root = ROOTS[package]
    strays = [
        f"{m.__name__}.{name}"
        for m in _modules(package)
        for name, cls in vars(m).items()
        if inspect.isclass(cls)
        and issubclass(cls, BaseException)
        and cls.__module__ == m.__name__
        and not name.startswith("_")
        and not issubclass(cls, root)
    ]
    assert not strays, f"exceptions outside {root.__name__}'s tree: {strays}"


def test_the_request_path_does_not_live_in_the_admin_package() -> None:
    """``ethen.admin`` is the operator's surfaces (HTTP API, dashboard, sessions, CLI); the request path's
    accounts are the gateway's (``ethen.gateway.accounting.accounts``), and no gateway module imports the
    admin package (the composition module ``ethen.app`` mounts it; tests/test_import_graph.py checks every
    import)."""
    admin = [m.__name__ for m in _modules("ethen.admin")]
    assert "ethen.admin.accounts" not in admin
    for mod in _modules("ethen.gateway"):
        assert "from ethen.admin" not in inspect.getsource(mod), f"{mod.__name__} imports ethen.admin"


def test_the_gateway_folder_shows_its_jobs() -> None:
    """The gateway's modules sit in one sub-package per job (issue 25)."""
    jobs = {
        "api": ["app", "chat", "completions", "embeddings", "responses", "pipeline", "execute", "relay"],
        "accounting": ["accounts", "hold", "ratelimit"],
        "observation": ["requestlog", "metrics", "tracing", "telemetry_store"],
    }
    for job, names in jobs.items():
        for name in names:
            importlib.import_module(f"ethen.gateway.{job}.{name}")
    importlib.import_module("ethen.gateway.routing.decide")
    importlib.import_module("ethen.gateway.providers.base")


def test_the_config_package_exports_every_section_model() -> None:
    """``ethen.gateway.config`` is a package of small modules: every public class or function of its modules
    is importable from the package itself (callers never need to know which module holds it)."""
    import ethen.gateway.config as config

    for mod in _modules("ethen.gateway.config")[1:]:
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == mod.__name__ \
                    and not name.startswith("_"):
                assert name in config.__all__ and getattr(config, name) is obj, f"{mod.__name__}.{name}"


def test_the_mesh_has_one_root_and_the_routing_core_a_branch_of_it() -> None:
    """``MeshError`` is the mesh's root (issue 25): the worker's, orchestrator's, credentials' and CLI errors
    derive from it, not from the routing core's ``MeshRoutingError``."""
    from ethen.mesh.auth import CredentialsError
    from ethen.mesh.cli import CliInputError
    from ethen.mesh.orchestrator.errors import MeshRuntimeError
    from ethen.mesh.worker.errors import WorkerError

    assert issubclass(MeshRoutingError, MeshError)
    for cls in (CredentialsError, CliInputError, MeshRuntimeError, WorkerError):
        assert issubclass(cls, MeshError) and not issubclass(cls, MeshRoutingError), cls
    assert issubclass(CredentialsError, ValueError) and issubclass(CliInputError, ValueError)


def test_a_malformed_gguf_is_not_a_missing_one() -> None:
    """``GGUFFormatError`` (there, but not a readable GGUF) is a sibling of ``WeightsNotFoundError``
    under ``ModelError``, not a kind of it (issue 25)."""
    assert issubclass(GGUFFormatError, ModelError)
    assert not issubclass(GGUFFormatError, WeightsNotFoundError)
