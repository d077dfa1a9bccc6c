"""Router inputs: a node's telemetry (:class:`NodeState`) and the request (:class:`RoutingRequest`).

Both are frozen and validated on construction, so the DP never sees a malformed value.

Choices where the spec is silent:

- ``latency_ms`` and ``current_load`` must be finite and ``>= 0`` (NaN, infinities and negatives are refused);
  a load above 1 is allowed (an overcommitted node). ``capacity_score`` must be finite; a value below 0.01,
  negative included, is clamped to 0.01 by the cost formula, as §2.1 says.
- ``served_layers`` keeps the fragments as given (order, overlaps and duplicates included), as a
  :class:`LayerSpans` (a tuple of ``(first, last)`` int pairs that also compares equal to any list/tuple of
  pairs with the same values, so ``ns.served_layers == [[7, 9]]`` holds); each must be non-negative, at most
  ``sys.maxsize``, and not inverted (``prompt_tokens`` has the same bound). A number too large for a float is
  refused like an infinity.
- :meth:`NodeState.from_dict` reads the health JSON of §7. ``node_id``, ``latency_ms``, ``capacity_score``
  and ``served_layers`` are required; ``alive`` defaults to ``true``. ``current_load`` falls back to the
  data-plane ``load`` when absent (a worker's ``Health`` reply carries ``load``; §7 says it is aggregated
  into the node). The diagnostic fields ``served_requests``/``failed_requests`` (non-negative ints) and
  ``load`` (a number) are checked when present but do not enter the cost. Other keys are ignored, so newer
  workers can add fields.
- It also reads the worker's ``Health`` reply converted by protobuf's
  ``json_format.MessageToDict(reply, preserving_proto_field_name=True)``: ``uint64`` counters arrive as
  decimal strings (``"served_requests": "5"``) and fragments as ``{"first": 7, "last": 9}`` objects (a
  missing ``first``/``last`` is 0, as proto3 omits zero values). *Caveat:* ``MessageToDict`` also omits every
  other zero-valued field unless told not to (``always_print_fields_with_no_presence=True``): a reply with
  ``alive=false`` then has no ``alive`` key and reads as alive, and one with ``load=0`` has no load. Convert
  health replies with that option.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ethen.mesh.routing._checks import MAX_INDEX, check_bool, check_count, check_layer_pair, check_number
from ethen.mesh.routing.errors import InvalidMeshInput

__all__ = ["LayerSpans", "NodeState", "RoutingRequest", "node_states_from_json"]

_REQUIRED = ("node_id", "latency_ms", "capacity_score", "served_layers")
_FIELD_ORDER = ("node_id", "latency_ms", "current_load", "capacity_score", "served_layers")


class LayerSpans(tuple[tuple[int, int], ...]):
    """``NodeState.served_layers``: a tuple of ``(first, last)`` pairs.

    It compares equal to any list or tuple of pairs with the same values (``[[7, 9]]``, ``[(7, 9)]``,
    ``((7, 9),)``) and hashes like a plain tuple.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list | tuple) and not isinstance(other, LayerSpans):
            pairs: list[tuple[object, ...]] = []
            for item in other:
                if not isinstance(item, list | tuple) or len(item) != 2:
                    return False
                pairs.append(tuple(item))
            return tuple.__eq__(self, tuple(pairs))
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__


@dataclass(frozen=True, slots=True)
class NodeState:
    """Telemetry of one worker node: what it costs to run a stage there and which fragments it serves."""

    node_id: str
    latency_ms: float
    current_load: float
    capacity_score: float
    served_layers: Sequence[tuple[int, int]]
    alive: bool = True
    _starts: frozenset[int] = field(init=False, repr=False, compare=False)
    """First layers of the fragments, precomputed once for the router's DP."""

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id.strip():
            raise InvalidMeshInput(f"node_id must be a non-empty string, got {self.node_id!r}")
        who = f"node {self.node_id!r}"
        object.__setattr__(
            self, "latency_ms", check_number(f"{who}: latency_ms", self.latency_ms, non_negative=True)
        )
        object.__setattr__(
            self, "current_load", check_number(f"{who}: current_load", self.current_load, non_negative=True)
        )
        object.__setattr__(
            self,
            "capacity_score",
            check_number(f"{who}: capacity_score", self.capacity_score, non_negative=False),
        )
        check_bool(f"{who}: alive", self.alive)
        layers = self.served_layers
        if isinstance(layers, str | bytes | Mapping) or not isinstance(layers, Sequence):
            raise InvalidMeshInput(f"{who}: served_layers must be a list of pairs, got {layers!r}")
        object.__setattr__(
            self,
            "served_layers",
            LayerSpans(check_layer_pair(f"{who}: served_layers[{i}]", pair) for i, pair in enumerate(layers)),
        )
        object.__setattr__(self, "_starts", frozenset(a for a, _ in self.served_layers))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeState:
        """Build from decoded §7 health JSON; a malformed document raises ``InvalidMeshInput``."""
        if not isinstance(data, Mapping):
            raise InvalidMeshInput(f"health JSON must be an object, got {type(data).__name__}")
        name = data.get("node_id")
        who = f"health JSON of node {name!r}" if isinstance(name, str) and name else "health JSON"
        missing = [key for key in _REQUIRED if key not in data]
        if "current_load" not in data and "load" not in data:
            missing.append("current_load")
            missing.sort(key=_FIELD_ORDER.index)
        if missing:
            raise InvalidMeshInput(f"{who}: missing field(s) {', '.join(missing)}")
        for key in ("served_requests", "failed_requests"):
            if key in data:
                check_count(f"{who}: {key}", _proto_uint(data[key]))
        if "load" in data:
            check_number(f"{who}: load", data["load"], non_negative=True)
        layers = data["served_layers"]
        if not isinstance(layers, list | tuple):
            raise InvalidMeshInput(f"{who}: served_layers must be a list of [first, last], got {layers!r}")
        pairs = [
            check_layer_pair(f"{who}: served_layers[{i}]", _layer_range(f"{who}: served_layers[{i}]", pair))
            for i, pair in enumerate(layers)
        ]
        return cls(
            node_id=data["node_id"],
            latency_ms=data["latency_ms"],
            current_load=data["current_load"] if "current_load" in data else data["load"],
            capacity_score=data["capacity_score"],
            served_layers=pairs,
            alive=data.get("alive", True),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeState:
        """Parse one health JSON document; invalid JSON raises ``InvalidMeshInput`` too."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidMeshInput(f"health JSON is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The §7 health JSON of this state (round-trips through :meth:`from_dict`)."""
        return {
            "node_id": self.node_id,
            "latency_ms": self.latency_ms,
            "current_load": self.current_load,
            "capacity_score": self.capacity_score,
            "served_layers": [list(pair) for pair in self.served_layers],
            "alive": self.alive,
        }


def _proto_uint(value: object) -> object:
    """A protobuf-JSON ``uint64`` (a decimal string such as ``"5"``) as an ``int``; other values unchanged."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


def _layer_range(field: str, value: object) -> object:
    """A protobuf-JSON ``LayerRange`` object ``{"first": 7, "last": 9}`` as the pair ``(7, 9)``.

    A missing ``first`` or ``last`` is 0 (proto3 omits zero values); other keys are refused. Anything that is
    not a mapping is returned unchanged for :func:`check_layer_pair`.
    """
    if not isinstance(value, Mapping):
        return value
    extra = sorted(str(k) for k in value if k not in ("first", "last"))
    if extra:
        raise InvalidMeshInput(
            f"{field} must be a [first, last] pair or a {{first, last}} object, got {value!r}"
        )
    return (value.get("first", 0), value.get("last", 0))


def node_states_from_json(data: object) -> tuple[NodeState, ...]:
    """A mesh document: a JSON list of health objects, or an object whose ``nodes`` key holds that list, or
    one single health object (it has a ``node_id`` key and no ``nodes`` key), read as a one-node list.

    Errors name the offending entry (``nodes[2]: ...``). Duplicate node ids are refused here too.
    """
    if isinstance(data, Mapping) and "nodes" not in data and "node_id" in data:
        return (NodeState.from_dict(data),)
    if isinstance(data, Mapping):
        if "nodes" not in data:
            raise InvalidMeshInput(
                "mesh JSON object must have a 'nodes' list (or be one health object with a 'node_id')"
            )
        data = data["nodes"]
    if not isinstance(data, list):
        raise InvalidMeshInput(f"mesh JSON 'nodes' must be a list of objects, got {type(data).__name__}")
    states: list[NodeState] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        try:
            state = NodeState.from_dict(item)
        except InvalidMeshInput as exc:
            raise InvalidMeshInput(f"nodes[{i}]: {exc}") from exc
        if state.node_id in seen:
            raise InvalidMeshInput(f"nodes[{i}]: duplicate node_id {state.node_id!r}")
        seen.add(state.node_id)
        states.append(state)
    return tuple(states)


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """Which layers to cover (inclusive; ``None`` = all layers live nodes serve) and the prompt size."""

    layer_range: tuple[int, int] | None = None
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.layer_range is not None:
            object.__setattr__(self, "layer_range", check_layer_pair("layer_range", self.layer_range))
        check_count("prompt_tokens", self.prompt_tokens, MAX_INDEX)
