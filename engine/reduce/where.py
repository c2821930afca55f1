"""A view's row filter applied to the changelog's units (`view.where`; the condition
itself: `refold.model.predicate`).

The filter applies to every event alike, so the view stays exact under retraction:
a unit's `+A` or `-R` is kept when its row passes; of a `-C`/`+C` pair both are kept
when both rows pass, the pair becomes `-R` old when only the old row passes and
`+A` new when only the new one does, and it is dropped when neither does. The view
is the view of the filtered changelog. A row the condition cannot compare (a number
against a string) refuses the unit: `schema mismatch` at that event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from refold.model.changelog import Op
from refold.model.predicate import Condition, FilterTypeError, compile_condition, parse_condition
from refold.model.reasons import Reason
from refold.reduce.types import Rejected, SourceEvent


@lru_cache(maxsize=64)
def condition_of(where: str) -> Condition:
    """The compiled condition of a `where` text (compiled once per process)."""
    return compile_condition(parse_condition(where))


def filter_unit(condition: Condition, unit: Sequence[SourceEvent]) -> list[tuple[int, SourceEvent]]:
    """What passes of one unit: (index in the unit, event, its op changed where a pair
    lost a side). Raises Rejected at the first event the condition cannot compare."""
    passes = []
    for index, event in enumerate(unit):
        try:
            passes.append(condition(event.row) is True)
        except FilterTypeError as exc:
            raise Rejected(Reason.SCHEMA_MISMATCH, index, f"where: {exc}") from None
    if len(unit) == 2 and unit[0].op is Op.CORRECT_FROM:
        old, new = passes
        if old and new:
            return [(0, unit[0]), (1, unit[1])]
        if old:
            return [(0, unit[0]._replace(op=Op.RETRACT))]
        if new:
            return [(1, unit[1]._replace(op=Op.APPEND))]
        return []
    return [(index, event) for index, event in enumerate(unit) if passes[index]]



def filter_units(condition: Condition | None, units: Sequence[Any], refuse: Callable[[Any, int, str], None]) -> list[Any]:
    """Units of (event, its record) pairs with the events `condition` (`view.where`)
    keeps; a unit it keeps nothing of is left out, and a unit it cannot compare goes to
    `refuse(unit, index, reason)` (its dead letters) instead."""
    if condition is None:
        return list(units)
    kept_units = []
    for unit in units:
        try:
            kept = filter_unit(condition, [event for event, _ in unit])
        except Rejected as rejected:
            refuse(unit, rejected.index, rejected.reason)
            continue
        if kept:
            kept_units.append(tuple((event, unit[index][1]) for index, event in kept))
    return kept_units
