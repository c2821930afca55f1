"""The reducers: live rows per key in, view changes, delta rows and state records out.

The contract, for the rest of the engine: `make_reducer(spec)` gives a `ViewReducer`
that `apply`s one unit (an event, or a `-C`/`+C` pair) at a time and returns the
view changes of that unit in output-key order, or raises `Rejected` (state
unchanged); `take_deltas`/`take_state_changes` drain what a batch produced;
`restore` rebuilds from `P.state` records (`encode_state`/`decode_state`).
`refold.reference` is the pure model these are tested against.

Inside: `types` (the values in and out, the `ViewReducer` protocol), `values` (row
identity, key order, value order, key checks), `statecodec` (`P.state` records),
`grouped` (`key` + `columns` views), `topn` (`top_n` views) and `join` (`view.join`: its
`apply` takes the side of each unit; not driven by the runtime yet).
"""

from refold.config import ViewSpec
from refold.reduce.grouped import GroupedReducer
from refold.reduce.statecodec import decode_state, encode_state
from refold.reduce.topn import TopNReducer
from refold.reduce.types import Rejected, SourceEvent, Tag, ViewChange, ViewReducer
from refold.reduce.values import compact_changes, key_problem, scalar_problem, value_order
from refold.reduce.windowed import WindowedReducer, whole_state


def make_reducer(spec: ViewSpec, emit: str = "per_event") -> ViewReducer:
    """The reducer of one view: windowed when the spec has `window` (`emit`: the view
    output's), else Top-N when it has `top_n`, grouped otherwise."""
    if spec.window is not None:
        return WindowedReducer(spec, emit)
    if spec.top_n is not None:
        return TopNReducer(spec)
    return GroupedReducer(spec)


__all__ = [
    "Rejected",
    "SourceEvent",
    "Tag",
    "ViewChange",
    "ViewReducer",
    "compact_changes",
    "decode_state",
    "encode_state",
    "key_problem",
    "make_reducer",
    "scalar_problem",
    "value_order",
    "whole_state",
]
