"""The root of ``ethen.mesh``'s one exception tree: :class:`MeshError`.

Under it: the routing core's :class:`~ethen.mesh.routing.errors.MeshRoutingError` (``NoRouteAvailable``,
``RoutingFailure``, ``InvalidMeshInput``), the orchestrator's
:class:`~ethen.mesh.orchestrator.errors.MeshRuntimeError`, the worker's
:class:`~ethen.mesh.worker.errors.WorkerError`, and the credentials and command-line errors
(:class:`~ethen.mesh.auth.CredentialsError`, ``ethen.mesh.cli.CliInputError``, both also ``ValueError``). A
caller (the gateway's ``mesh`` provider) catches the whole mesh with ``except MeshError``.
"""

from __future__ import annotations

__all__ = ["MeshError"]


class MeshError(Exception):
    """Base of every error raised by ``ethen.mesh``."""
