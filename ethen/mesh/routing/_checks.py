"""Input checks shared by the routing dataclasses: each raises :class:`InvalidMeshInput` naming the field."""

from __future__ import annotations

import math
import sys
from typing import Final

from ethen.mesh.routing.errors import InvalidMeshInput

__all__ = ["MAX_INDEX", "check_bool", "check_count", "check_layer_pair", "check_number"]

#: Largest layer number or prompt size accepted (``sys.maxsize``): Python ints are unbounded, a 64-bit
#: worker is not, and a larger value would no longer convert to a float in the cost terms.
MAX_INDEX: Final = sys.maxsize


def _shown(value: object) -> str:
    """``repr`` of a value, except for huge integers (thousands of digits in an error message help no one)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def check_number(field: str, value: object, *, non_negative: bool) -> float:
    """A finite real number (``bool`` is refused), optionally ``>= 0``; returned as ``float``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMeshInput(f"{field} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise InvalidMeshInput(f"{field} must be finite, got {_shown(value)}") from None
    if math.isnan(number):
        raise InvalidMeshInput(f"{field} must not be NaN")
    if math.isinf(number):
        raise InvalidMeshInput(f"{field} must be finite, got {value!r}")
    if non_negative and number < 0:
        raise InvalidMeshInput(f"{field} must be >= 0, got {value!r}")
    return number


def check_count(field: str, value: object, maximum: int | None = None) -> int:
    """A non-negative ``int`` (``bool`` is refused), at most ``maximum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidMeshInput(f"{field} must be an integer, got {value!r}")
    if value < 0:
        raise InvalidMeshInput(f"{field} must be >= 0, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise InvalidMeshInput(f"{field} must be <= {maximum}, got {_shown(value)}")
    return value


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidMeshInput(f"{field} must be true or false, got {value!r}")
    return value


def check_layer_pair(field: str, value: object) -> tuple[int, int]:
    """An inclusive ``(first, last)`` layer pair of non-negative ints with ``first <= last``."""
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list) or len(value) != 2:
        raise InvalidMeshInput(f"{field} must be a (first, last) pair of layers, got {value!r}")
    first = check_count(f"{field} first layer", value[0], MAX_INDEX)
    last = check_count(f"{field} last layer", value[1], MAX_INDEX)
    if first > last:
        raise InvalidMeshInput(f"{field} is inverted: first layer {first} > last layer {last}")
    return first, last
