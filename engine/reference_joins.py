"""The reference join: docs/SEMANTICS.md's joins as plain, slow, obvious Python.

It keeps each side's live rows as a plain list (a multiset: one entry per copy),
recomputes the whole joined table from scratch before and after every unit, and emits
the difference as docs/SEMANTICS.md orders it. Nothing here reuses the engine's join
(`refold.reduce.join`): the engine is checked against it, record by record.

A unit is `(side, events)`: side 0 (the join's `left` source) or 1 (`right`), and one
event or a `-C`/`+C` pair of that side, as the engine's units are.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refold.config import JoinSpec
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.reduce.types import SourceEvent, ViewChange


@dataclass
class JoinResult:
    changes: list[ViewChange] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # the joined table at the end
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (unit index, reason)
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ((), ())  # type: ignore[assignment]


def _text(value: Any) -> str:
    """A value as JSON text: two values are equal (and join) exactly when these are."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _identity(row: dict[str, Any]) -> str:
    """A row's identity and its order among rows: JSON with sorted keys, nulls left out
    (a null column equals an absent one, as for every row of Refold)."""
    return _text({k: v for k, v in row.items() if v is not None})


def _matches(spec: JoinSpec, left: dict[str, Any], right: dict[str, Any]) -> bool:
    for lcol, rcol in spec.on:
        lv, rv = left.get(lcol), right.get(rcol)
        if lv is None or rv is None or _text(lv) != _text(rv):
            return False
    return True


def _output(spec: JoinSpec, left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    out = {}
    for name, source in spec.columns.items():
        side, _, column = source.partition(".")
        row = left if side == spec.left else right
        out[name] = None if row is None else row.get(column)
    return out


def joined_table(spec: JoinSpec, lefts: Sequence[dict[str, Any]], rights: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The join of two multisets of rows, as SQL defines it (one entry per copy)."""
    out = []
    matched_right = [False] * len(rights)
    for left in lefts:
        found = False
        for j, right in enumerate(rights):
            if _matches(spec, left, right):
                out.append(_output(spec, left, right))
                found = matched_right[j] = True
        if not found and spec.type in ("left", "full"):
            out.append(_output(spec, left, None))
    if spec.type == "full":
        out.extend(_output(spec, None, right) for j, right in enumerate(rights) if not matched_right[j])
    return out


def _key(spec: JoinSpec, row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[name] for name in (spec.key if spec.key is not None else spec.columns))


def _key_order(key: tuple[Any, ...]) -> bytes:
    return _text(list(key)).encode()


def unit_changes(spec: JoinSpec, before: list[dict[str, Any]], after: list[dict[str, Any]],
                 paired: bool) -> list[ViewChange]:
    """The records of one unit: the joined table's net change (equal rows removed and
    added cancel), by output key; per key, a pair unit's `-C`/`+C` pairs first (removed
    and added rows each in identity order, zipped), then `-R` of the rows removed, then
    `+A` of the rows added, each in identity order."""
    old = Counter(_identity(row) for row in before)
    new = Counter(_identity(row) for row in after)
    by_identity = {_identity(row): row for row in [*before, *after]}
    removed = old - new
    added = new - old
    names = tuple(spec.key if spec.key is not None else spec.columns)
    keys: dict[bytes, tuple[Any, ...]] = {}
    gone: dict[bytes, list[str]] = {}
    came: dict[bytes, list[str]] = {}
    for counter, into in ((removed, gone), (added, came)):
        for identity, copies in counter.items():
            key = _key(spec, by_identity[identity])
            order = _key_order(key)
            keys[order] = key
            into.setdefault(order, []).extend([identity] * copies)
    out: list[ViewChange] = []
    for order in sorted(keys):
        key = keys[order]
        olds = sorted(gone.get(order, []))
        news = sorted(came.get(order, []))
        pairs = min(len(olds), len(news)) if paired else 0
        for a, b in zip(olds[:pairs], news[:pairs], strict=True):
            out.append(ViewChange(Op.CORRECT_FROM, key, by_identity[a], names))
            out.append(ViewChange(Op.CORRECT_TO, key, by_identity[b], names))
        out.extend(ViewChange(Op.RETRACT, key, by_identity[a], names) for a in olds[pairs:])
        out.extend(ViewChange(Op.APPEND, key, by_identity[b], names) for b in news[pairs:])
    return out


def _scalar(spec: JoinSpec, side: int, row: dict[str, Any]) -> bool:
    columns = [pair[side] for pair in spec.on]
    return all(row.get(c) is None or isinstance(row.get(c), str | int | float | bool) for c in columns)


def reference_join(spec: JoinSpec, units: Sequence[tuple[int, Sequence[SourceEvent]]]) -> JoinResult:
    """The join's output changelog over `units` in order. A unit that retracts a row its
    side does not hold (`not live`), or whose join column holds a list or an object
    (`schema mismatch`), is refused whole: nothing changes, its index is in `rejected`."""
    live: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    result = JoinResult()
    for index, (side, events) in enumerate(units):
        trial = [list(live[0]), list(live[1])]
        refused = None
        for event in events:
            if not _scalar(spec, side, event.row):
                refused = Reason.SCHEMA_MISMATCH
                break
            if event.op.adds:
                trial[side].append(dict(event.row))
                continue
            identity = _identity(event.row)
            at = next((i for i, row in enumerate(trial[side]) if _identity(row) == identity), None)
            if at is None:
                refused = Reason.NOT_LIVE
                break
            del trial[side][at]
        if refused is not None:
            result.rejected.append((index, refused))
            continue
        before = joined_table(spec, live[0], live[1])
        after = joined_table(spec, trial[0], trial[1])
        paired = len(events) == 2 and events[0].op is Op.CORRECT_FROM
        result.changes.extend(unit_changes(spec, before, after, paired))
        live = (trial[0], trial[1])
    result.rows = joined_table(spec, live[0], live[1])
    result.live = live
    return result
