"""The mesh routing exception tree.

Everything the routing core raises derives from :class:`MeshRoutingError`, so a caller can catch the whole
package with one ``except``. Bad input is :class:`InvalidMeshInput`, which is also a :class:`ValueError`
(the issue asks for ``ValueError`` naming the field).
"""

from __future__ import annotations

from ethen.mesh.errors import MeshError

__all__ = ["InvalidMeshInput", "MeshRoutingError", "NoRouteAvailable", "RoutingFailure"]


class MeshRoutingError(MeshError):
    """Base of every error of :mod:`ethen.mesh.routing` (under the mesh's root, :class:`MeshError`)."""


class InvalidMeshInput(MeshRoutingError, ValueError):
    """An input field is malformed; the message names the field and the value."""


class NoRouteAvailable(MeshRoutingError):
    """No chain of whole fragments from live nodes covers the requested window.

    ``window`` is the ``(first, last)`` window that could not be covered, or ``None`` when no live node
    serves any layer (so no window could be derived). ``reached`` is the highest layer boundary a chain
    of whole fragments could reach from ``first`` (``first`` itself when nothing starts there).
    """

    def __init__(self, window: tuple[int, int] | None, detail: str, reached: int | None = None) -> None:
        self.window = window
        self.reached = reached
        if window is None:  # nothing to name: say why there is no window instead of repeating the detail
            super().__init__(f"no route: {detail}, so there is no default window to cover")
        else:
            first, last = window
            super().__init__(f"no route covers layers {first}-{last} (window ({first}, {last})): {detail}")


class RoutingFailure(MeshRoutingError):
    """Failover found no live substitute for some layers and no fallback model was given (spec §6.4)."""

    def __init__(self, failed_node: str, missing_layers: tuple[int, ...], detail: str) -> None:
        self.failed_node = failed_node
        self.missing_layers = missing_layers
        super().__init__(detail)
