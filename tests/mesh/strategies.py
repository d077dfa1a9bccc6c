"""Hypothesis strategies for small meshes (small enough for the brute-force oracle)."""

from __future__ import annotations

from hypothesis import strategies as st

from ethen.mesh import NodeState, RouteWeights

NODE_IDS = ["a", "b", "c", "d", "e", "f", "B", "aa"]

# Few distinct values, so that equal costs (ties) are frequent; plus arbitrary floats now and then.
latencies = st.one_of(
    st.sampled_from([0.0, 0.1, 0.2, 1.1, 2.5, 6.0, 9.0, 40.0, 5e-324, 1e300]),  # extremes: exact-int fallback
    st.floats(0, 100, allow_nan=False),
)
loads = st.one_of(st.sampled_from([0.0, 0.2, 0.5, 1.0]), st.floats(0, 2, allow_nan=False))
scores = st.one_of(
    st.sampled_from([-1.0, 0.0, 0.005, 1.0, 3.0, 6.0, 10.0]), st.floats(-5, 50, allow_nan=False)
)


@st.composite
def fragments(draw: st.DrawFn, max_layer: int = 7) -> tuple[int, int]:
    first = draw(st.integers(0, max_layer))
    return first, draw(st.integers(first, min(max_layer, first + 4)))


@st.composite
def node_states(draw: st.DrawFn, max_nodes: int = 5) -> list[NodeState]:
    ids = draw(st.lists(st.sampled_from(NODE_IDS), min_size=1, max_size=max_nodes, unique=True))
    return [
        NodeState(
            node_id=node_id,
            latency_ms=draw(latencies),
            current_load=draw(loads),
            capacity_score=draw(scores),
            served_layers=draw(st.lists(fragments(), min_size=0, max_size=3)),
            alive=draw(st.sampled_from([True, True, True, False])),
        )
        for node_id in ids
    ]


windows = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 7), st.integers(0, 4)).map(lambda t: (t[0], min(7, t[0] + t[1]))),
)

weights = st.one_of(
    st.just(RouteWeights()),
    st.builds(
        RouteWeights,
        latency=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        load=st.sampled_from([0.0, 1.0, 1.5]),
        capacity=st.sampled_from([0.0, 0.1, 0.35]),
        hop=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
        prompt=st.sampled_from([0.0, 0.2, 1.0]),
    ),
)
