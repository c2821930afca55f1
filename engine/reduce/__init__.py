"""The reducers: live rows per key in, view changes, delta rows and state records out.

The contract, for the rest of the engine: `make_reducer(spec)` gives a `ViewReducer`
that `apply`s one unit (an event, or a `-C`/`+C` pair) at a time and returns the
view changes of that unit in output-key order, or raises `Rejected` (state
unchanged); `take_deltas`/`take_state_changes` drain what a batch produced;
`restore` rebuilds from `P.state` records (`encode_state`/`decode_state`).
`refold.reference` is the pure model these are tested against.
"""

from refold.reduce.views import (
    Rejected,
    SourceEvent,
    Tag,
    ViewChange,
    ViewReducer,
    compact_changes,
    decode_state,
    encode_state,
    key_problem,
    make_reducer,
    scalar_problem,
    value_order,
)

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
]
