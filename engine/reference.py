"""The reference reducer: `docs/SEMANTICS.md` as plain, slow, obvious Python.

It keeps, per view key (or Top-N group), the list of live row copies with their
tags and recomputes every output from scratch after every unit. The engine's
incremental reducers (`refold.reduce`) are checked against it; nothing here reuses
the incremental logic. It ships with Refold so users can check their own views.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import orjson

from refold.config import ViewSpec
from refold.model.changelog import Op, canonical_row
from refold.model.predicate import Condition, FilterTypeError, compile_condition, parse_condition
from refold.model.reasons import Reason
from refold.reduce import (
    SourceEvent,
    Tag,
    ViewChange,
    key_problem,
    scalar_problem,
    value_order,
)

Copy = tuple[dict[str, Any], Tag]  # a live copy of a row and the tag it was added with


@dataclass
class ReferenceResult:
    changes: list[ViewChange] = field(default_factory=list)
    view: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (unit index, reason)
    # one per event of a refused unit: (unit index, the event's index in the unit, reason)
    dead_letters: list[tuple[int, int, str]] = field(default_factory=list)
    unchanged: int = 0  # table-source records that meant no change (`reference_table`)
    watermark: int | None = None  # a windowed view with lateness: the watermark at the end


def merge_partitions(partitions: Mapping[int, Sequence[SourceEvent]]) -> list[list[SourceEvent]]:
    """Pair each `-C` with the `+C` right after it into units, then merge the
    partitions: always take the head unit with the smallest first tag."""
    streams = []
    for partition in sorted(partitions):
        events = partitions[partition]
        units: list[list[SourceEvent]] = []
        i = 0
        while i < len(events):
            if events[i].op is Op.CORRECT_FROM and i + 1 < len(events) and events[i + 1].op is Op.CORRECT_TO:
                units.append([events[i], events[i + 1]])
                i += 2
            else:
                units.append([events[i]])
                i += 1
        streams.append(units)
    return list(heapq.merge(*streams, key=lambda unit: unit[0].tag))


def _number_sum(values: list[Any]) -> int | float:
    if any(type(v) is float for v in values):
        return math.fsum(values)
    return sum(values)


def _reduce(agg: str, column: str, copies: list[Copy]) -> Any:
    if agg == "count":
        if column == "*":
            return len(copies)
        return sum(1 for row, _ in copies if row.get(column) is not None)
    values = [row.get(column) for row, _ in copies]
    present = [v for v in values if v is not None]
    if agg == "sum":
        return _number_sum(present)
    if agg == "avg":
        if not present:
            return None
        return float(sum((Fraction(v) for v in present), Fraction(0)) / len(present))
    if agg == "min":
        return min(present, key=value_order) if present else None
    if agg == "max":
        return max(present, key=value_order) if present else None
    if agg == "set":
        return [[v, n] for v, n in sorted(Counter(present).items(), key=lambda item: value_order(item[0]))]
    ordered = sorted(copies, key=lambda copy: copy[1])
    chosen = ordered[0] if agg == "first" else ordered[-1]  # last, last_write_wins
    return chosen[0].get(column)


def _column_value(column: str) -> Any:
    return lambda copy: value_order(copy[0][column])


def group_outputs(spec: ViewSpec, group: tuple[Any, ...], copies: list[Copy],
                  bounds: Mapping[str, Any] | None = None, key_bounds: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The output rows of one group's live copies by output key. A window's group gives
    its `bounds` (the window columns each row carries right after the group's columns)
    and `key_bounds` (those of them in the output key, right after the group's)."""
    if not copies:
        return {}
    top_n = spec.top_n
    if top_n is None:
        row: dict[str, Any] = dict(zip(spec.key, group, strict=True))
        row.update(bounds or {})
        for name, column in spec.columns.items():
            row[name] = _reduce(column.agg, column.column, copies)
        return {(*group, *key_bounds): row}
    ranked = sorted(copies, key=lambda copy: copy[1])  # ties: the earlier tag first
    for order_column, direction in reversed(list(top_n.order_by.items())):
        present = [c for c in ranked if c[0].get(order_column) is not None]
        absent = [c for c in ranked if c[0].get(order_column) is None]
        present.sort(key=_column_value(order_column), reverse=direction == "desc")  # stable either way
        ranked = present + absent  # stable sorts, nulls last
    out = {}
    for place, (copy_row, _tag) in enumerate(ranked[: top_n.n], start=1):
        row = dict(zip(top_n.partition_by, group, strict=True))
        row.update(bounds or {})
        row["place"] = place
        kept = copy_row if top_n.columns is None else {c: copy_row[c] for c in top_n.columns if c in copy_row}
        row.update({k: v for k, v in kept.items() if k not in row})
        out[(*group, *key_bounds, place)] = row
    return out


class _Model:
    """Live copies per group and a from-scratch output per group."""

    def __init__(self, spec: ViewSpec) -> None:
        self.spec = spec
        self.live: dict[tuple[Any, ...], list[Copy]] = {}
        # the columns whose values are ordered or counted by value: scalars only
        self.scalar_columns = (
            list(spec.top_n.order_by) if spec.top_n is not None
            else [c.column for c in spec.columns.values() if c.agg in ("min", "max", "set")]
        )

    def group_of(self, row: dict[str, Any]) -> tuple[Any, ...] | None:
        columns = self.spec.top_n.partition_by if self.spec.top_n is not None else self.spec.key
        if any(row.get(c) is None for c in columns):
            return None
        return tuple(row[c] for c in columns)

    def outputs(self, group: tuple[Any, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The output rows of one group by output key, recomputed from its live copies."""
        return group_outputs(self.spec, group, self.live.get(group, []))

    def outputs_of(self, groups: Iterable[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The output rows of several groups by output key."""
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for group in groups:
            out.update(self.outputs(group))
        return out

    def key_names(self) -> tuple[str, ...]:
        if self.spec.top_n is not None:
            return (*self.spec.top_n.partition_by, "place")
        return tuple(self.spec.key)

    def check(self, unit: Sequence[SourceEvent]) -> str | None:
        """Why the unit is refused, or None. Nothing changes."""
        refused = self.refusal(unit)
        return None if refused is None else refused[1]

    def refusal(self, unit: Sequence[SourceEvent]) -> tuple[int, str] | None:
        """The refused event's index in the unit and why, or None. Nothing changes."""
        problem = self.shape_problem(unit)
        if problem is not None:
            return problem
        trial: dict[tuple[Any, ...], list[Copy]] = {}
        for index, event in enumerate(unit):
            group = self.group_of(event.row)
            assert group is not None
            if group not in trial:
                trial[group] = list(self.live.get(group, []))
            if not take_copy(trial[group], event):
                return index, Reason.NOT_LIVE
        return None

    def shape_problem(self, unit: Sequence[SourceEvent]) -> tuple[int, str] | None:
        """The unit's pairing, then the shape of every event (its key, its values)."""
        if len(unit) == 1 and unit[0].op is Op.CORRECT_TO:
            return 0, Reason.ORPHAN_CORRECT_TO
        if len(unit) == 1 and unit[0].op is Op.CORRECT_FROM:
            return 0, Reason.UNPAIRED_CORRECT_FROM
        for index, event in enumerate(unit):
            group = self.group_of(event.row)
            if group is None:
                return index, Reason.NULL_KEY
            problem = key_problem(group)
            if problem is not None:
                return index, problem[0]
            if scalar_problem(event.row, self.scalar_columns) is not None:
                return index, Reason.SCHEMA_MISMATCH
            if self.spec.top_n is None:
                for column in {c.column for c in self.spec.columns.values() if c.agg in ("sum", "avg")}:
                    value = event.row.get(column)
                    if value is not None and type(value) not in (int, float):
                        return index, Reason.SCHEMA_MISMATCH
        return None

    def apply(self, event: SourceEvent) -> SourceEvent:
        """Apply one event; return the event as a contribution (a removal carries the removed copy's tag)."""
        group = self.group_of(event.row)
        assert group is not None
        copies = self.live.setdefault(group, [])
        applied = apply_copy(copies, event)
        if not copies:
            del self.live[group]
        return applied


def take_copy(copies: list[Copy], event: SourceEvent) -> bool:
    """Add the event's copy, or remove the latest live copy of an equal row (False: none)."""
    if event.op.adds:
        copies.append((event.row, event.tag))
        return True
    match = [i for i, (row, _) in enumerate(copies) if canonical_row(row) == canonical_row(event.row)]
    if not match:
        return False
    copies.pop(max(match, key=lambda i: copies[i][1]))
    return True


def apply_copy(copies: list[Copy], event: SourceEvent) -> SourceEvent:
    """Apply a checked event to a group's copies; return it as a contribution (a removal
    carries the removed copy's tag: the latest copy of an equal row goes)."""
    if event.op.adds:
        copies.append((event.row, event.tag))
        return event
    match = [i for i, (row, _) in enumerate(copies) if canonical_row(row) == canonical_row(event.row)]
    index = max(match, key=lambda i: copies[i][1])
    _row, tag = copies.pop(index)
    return SourceEvent(event.op, event.row, tag)


def reference_changelog(spec: ViewSpec, units: Sequence[Sequence[SourceEvent]], emit: str = "per_event") -> ReferenceResult:
    """The changelog, dead letters and final view of one shard's units in input order.
    A windowed view (`view.window`) keeps one watermark over all the units given (the
    engine keeps one per shard: give the units of one shard). `emit`: the view output's
    `emit` (`final` needs a window with lateness)."""
    model = _model_of(spec, emit)
    result = ReferenceResult()
    condition = compile_condition(parse_condition(spec.where)) if spec.where is not None else None
    for index, unit in enumerate(units):
        positions = list(range(len(unit)))
        if condition is not None:
            kept = _kept(condition, unit, index, result)
            if not kept:  # refused, or nothing of it passes
                continue
            positions = [position for position, _ in kept]
            unit = [event for _, event in kept]
        _step(model, unit, index, result, positions)
    _finish(model, result)
    return result


def _model_of(spec: ViewSpec, emit: str) -> Any:
    """The model of the view: `_Model`, or a windowed one (refold.reference_windows)."""
    if spec.window is not None:
        from refold.reference_windows import WindowModel

        return WindowModel(spec, emit)
    if emit != "per_event":
        raise ValueError(f"emit {emit!r}: the reference writes an unwindowed view per event only")
    return _Model(spec)


def _finish(model: Any, result: ReferenceResult) -> None:
    if isinstance(model, _Model):
        result.view = model.outputs_of(model.live)
    else:
        result.view = model.view()
        result.watermark = model.watermark()


def _kept(condition: Condition, unit: Sequence[SourceEvent], index: int,
          result: ReferenceResult) -> list[tuple[int, SourceEvent]] | None:
    """What of the unit passes `view.where`, each kept event with its index in the unit:
    the events whose rows pass, where a correction pair that loses its old side is an
    append of the new row and one that loses its new side a retraction of the old (the
    filtered changelog). None, and the refusal recorded, when the condition cannot
    compare one of its rows."""
    passes = []
    for position, event in enumerate(unit):
        try:
            passes.append(condition(event.row) is True)
        except FilterTypeError:
            refuse(result, index, range(len(unit)), position, Reason.SCHEMA_MISMATCH)
            return None
    kept = [(position, event) for position, (event, passed) in enumerate(zip(unit, passes, strict=True)) if passed]
    if len(unit) == 2 and unit[0].op is Op.CORRECT_FROM and len(kept) == 1:
        position, only = kept[0]
        return [(position, SourceEvent(Op.RETRACT if position == 0 else Op.APPEND, only.row, only.tag))]
    return kept


def refuse(result: ReferenceResult, index: int, positions: Sequence[int], refused: int, reason: str) -> None:
    """Record a refused unit: its reason, and a dead letter per event (`positions`: the
    events' indexes in the unit as read; `refused`: the refused one's): the refused
    event's with `reason`, any other's as the other half of a refused pair."""
    result.rejected.append((index, reason))
    for position in positions:
        result.dead_letters.append((index, position, reason if position == refused else Reason.CORRECTION_PAIR_REJECTED))


def _step(model: Any, unit: Sequence[SourceEvent], index: int, result: ReferenceResult,
          positions: Sequence[int] | None = None) -> bool:
    """Apply one unit, or record why it is refused (False)."""
    positions = list(range(len(unit))) if positions is None else positions
    if not isinstance(model, _Model):
        return bool(model.step(unit, index, result, positions))
    refused = model.refusal(unit)
    if refused is not None:
        refuse(result, index, positions, positions[refused[0]], refused[1])
        return False
    names = model.key_names()
    groups: list[tuple[Any, ...]] = []
    for event in unit:
        group = model.group_of(event.row)
        assert group is not None  # checked
        if group not in groups:
            groups.append(group)
    before = model.outputs_of(groups)
    for event in unit:
        model.apply(event)
    after = model.outputs_of(groups)
    result.changes.extend(changes_between(before, after, names))
    return True


def changes_between(before: Mapping[tuple[Any, ...], dict[str, Any]], after: Mapping[tuple[Any, ...], dict[str, Any]],
                    names: tuple[str, ...]) -> list[ViewChange]:
    """The records that take the output rows `before` to `after`, ordered by output key."""
    changes = []
    for key in sorted(set(before) | set(after), key=lambda k: orjson.dumps(list(k))):
        old, new = before.get(key), after.get(key)
        if old is None and new is not None:
            changes.append(ViewChange(Op.APPEND, key, new, names))
        elif old is not None and new is None:
            changes.append(ViewChange(Op.RETRACT, key, old, names))
        elif old is not None and new is not None and canonical_row(old) != canonical_row(new):
            changes.append(ViewChange(Op.CORRECT_FROM, key, old, names))
            changes.append(ViewChange(Op.CORRECT_TO, key, new, names))
    return changes


# One record of a table source (docs/SEMANTICS.md, "Table sources"): its key (None: a
# Debezium record without one), its kind ("upsert", or Debezium's "c", "u", "d"), its
# new row (None: an upsert tombstone, a Debezium delete), its Debezium `before` image
# as given (or None), its tag.
TableRecord = tuple[tuple[Any, ...] | None, str, dict[str, Any] | None, dict[str, Any] | None, Tag]


def reference_table(spec: ViewSpec, partitions: Mapping[int, Sequence[TableRecord]],
                    emit: str = "per_event") -> ReferenceResult:
    """The view of a table source (`source.form: upsert`, `format: debezium-json`): the
    records of each partition in order, the partitions merged by tag. Per key, the row
    the key last put into the view; each record is the unit it means against that row:

    - upsert: a new key `+A`; a changed row `-C` old `+C` new; a tombstone `-R` old;
      an identical row, or a tombstone of an absent key, nothing (`unchanged`);
    - Debezium `c`: `+A` after; `u`: `-C` old `+C` after; `d`: `-R` old, where old is
      the key's row, which every column of `before` must equal (`before differs`),
      or `before` itself for a key without a row (none: `not live`).

    A refused unit leaves the key's row as it was."""
    model = _model_of(spec, emit)
    result = ReferenceResult()
    condition = compile_condition(parse_condition(spec.where)) if spec.where is not None else None
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    records = heapq.merge(*(partitions[p] for p in sorted(partitions)), key=lambda record: record[4])
    for index, (key, kind, row, before, tag) in enumerate(records):
        old = last.get(key) if key is not None else None
        unit: list[SourceEvent] = []
        if kind == "upsert":
            if row is None:
                unit = [] if old is None else [SourceEvent(Op.RETRACT, old, tag)]
            elif old is None:
                unit = [SourceEvent(Op.APPEND, row, tag)]
            elif canonical_row(old) != canonical_row(row):
                unit = [SourceEvent(Op.CORRECT_FROM, old, tag), SourceEvent(Op.CORRECT_TO, row, tag)]
            if not unit:
                result.unchanged += 1
                continue
        elif kind == "c":
            assert row is not None
            unit = [SourceEvent(Op.APPEND, row, tag)]
        else:
            if old is None and before is None:
                result.rejected.append((index, Reason.NOT_LIVE))
                continue
            if old is not None and before is not None and any(
                column not in old or orjson.dumps(old[column]) != orjson.dumps(value) for column, value in before.items()
            ):
                result.rejected.append((index, Reason.BEFORE_DIFFERS))
                continue
            taken = old if old is not None else before
            assert taken is not None
            if kind == "u":
                assert row is not None
                unit = [SourceEvent(Op.CORRECT_FROM, taken, tag), SourceEvent(Op.CORRECT_TO, row, tag)]
            else:
                unit = [SourceEvent(Op.RETRACT, taken, tag)]
        if condition is not None:  # the table's row changes whether or not the view sees it
            kept = _kept(condition, unit, index, result)
            if kept is None:
                continue
            positions = [position for position, _ in kept]
            applied = _step(model, [event for _, event in kept], index, result, positions) if kept else True
        else:
            applied = _step(model, unit, index, result)
        if applied and key is not None:
            if row is None or kind == "d":
                last.pop(key, None)
            else:
                last[key] = row
    _finish(model, result)
    return result


def fold_changelog(changes: Iterable[ViewChange]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The final view a changelog describes. Raises ValueError on any inconsistency."""
    view: dict[tuple[Any, ...], dict[str, Any]] = {}
    expect_plus_c: tuple[Any, ...] | None = None
    for change in changes:
        key, row = change.key, dict(change.row)
        if expect_plus_c is not None and (change.op is not Op.CORRECT_TO or key != expect_plus_c):
            raise ValueError(f"-C at key {expect_plus_c!r} not followed by its +C")
        if change.op is Op.APPEND:
            if key in view:
                raise ValueError(f"+A at key {key!r}, which already has a row")
            view[key] = row
        elif change.op is Op.CORRECT_TO:
            if expect_plus_c is None:
                raise ValueError(f"+C at key {key!r} without a -C")
            view[key] = row
            expect_plus_c = None
        else:
            if key not in view or canonical_row(view[key]) != canonical_row(row):
                raise ValueError(f"{change.op.code} at key {key!r} of a row that is not the current one")
            del view[key]
            if change.op is Op.CORRECT_FROM:
                expect_plus_c = key
    if expect_plus_c is not None:
        raise ValueError(f"-C at key {expect_plus_c!r} at the end without its +C")
    return view


def reference_deltas(spec: ViewSpec, batches: Sequence[Sequence[Sequence[SourceEvent]]]) -> list[dict[str, Any]]:
    """Delta rows per batch of units: each batch's accepted contributions per key (a
    tumble or hop view: per view key and window, `refold.reference_windows`)."""
    if spec.window is not None:
        from refold.reference_windows import window_deltas

        return window_deltas(spec, batches)
    model = _Model(spec)
    out: list[dict[str, Any]] = []
    for batch in batches:
        contributions: dict[tuple[Any, ...], list[tuple[int, SourceEvent]]] = {}
        for unit in batch:
            if model.check(unit) is not None:
                continue
            for event in unit:
                group = model.group_of(event.row)
                assert group is not None
                applied = model.apply(event)
                contributions.setdefault(group, []).append((1 if event.op.adds else -1, applied))
        for key in sorted(contributions, key=lambda k: orjson.dumps(list(k))):
            out.append(_delta_row(spec, key, contributions[key]))
    return out


def _delta_row(spec: ViewSpec, key: tuple[Any, ...], signed: list[tuple[int, SourceEvent]],
               names: Sequence[str] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(spec.key if names is None else names, key, strict=True))
    row["_count"] = sum(sign for sign, _ in signed)
    for name, column in spec.columns.items():
        agg, col = column.agg, column.column
        values = [(sign, e.row.get(col), e.tag) for sign, e in signed]
        present = [(sign, v) for sign, v, _ in values if v is not None]
        if agg == "count":
            row[name] = row["_count"] if col == "*" else sum(sign for sign, _ in present)
        elif agg in ("sum", "avg"):
            total: Any = sum((sign * Fraction(v) for sign, v in present), Fraction(0))
            total = float(total) if any(type(v) is float for _, v in present) else int(total)
            row[name] = total if agg == "sum" else {"sum": total, "count": sum(sign for sign, _ in present)}
        elif agg in ("min", "max", "set"):
            diffs: Counter[Any] = Counter()
            for sign, v in present:
                diffs[v] += sign
            row[name] = [[v, d] for v, d in sorted(diffs.items(), key=lambda item: value_order(item[0])) if d]
        else:
            row[name] = [
                [list(tag), v, sign]
                for sign, v, tag in sorted(values, key=lambda c: (c[2], orjson.dumps(c[1]), c[0]))
            ]
    return row


def fold_deltas(spec: ViewSpec, delta_rows: Iterable[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Combine delta rows per key, then apply each aggregation: the view they add up to
    (a windowed view's rows are keyed by the view key and the window bounds)."""
    names = (*spec.key, "window_start", "window_end") if spec.window is not None else tuple(spec.key)
    acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    for delta in delta_rows:
        key = tuple(delta[c] for c in names)
        state = acc.setdefault(key, {"_count": 0})
        state["_count"] += delta["_count"]
        for name, column in spec.columns.items():
            value = delta[name]
            if column.agg in ("sum", "count"):
                state[name] = state.get(name, 0) + value
            elif column.agg == "avg":
                total = state.setdefault(name, {"sum": 0, "count": 0})
                total["sum"] += value["sum"]
                total["count"] += value["count"]
            elif column.agg in ("min", "max", "set"):
                counts = state.setdefault(name, Counter())
                for v, d in value:
                    counts[v] += d
            else:
                counts = state.setdefault(name, Counter())
                for tag, v, d in value:
                    counts[(tuple(tag), orjson.dumps(v))] += d
    view: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, state in acc.items():
        if state["_count"] <= 0:
            continue
        row: dict[str, Any] = dict(zip(names, key, strict=True))
        for name, column in spec.columns.items():
            value = state.get(name)
            if column.agg in ("sum", "count"):
                row[name] = value if value is not None else 0
            elif column.agg == "avg":
                row[name] = value["sum"] / value["count"] if value and value["count"] else None
            elif column.agg in ("min", "max", "set"):
                live = sorted(((v, n) for v, n in (value or {}).items() if n > 0), key=lambda item: value_order(item[0]))
                if column.agg == "set":
                    row[name] = [[v, n] for v, n in live]
                elif not live:
                    row[name] = None
                else:
                    row[name] = (min if column.agg == "min" else max)((v for v, _ in live), key=value_order)
            else:
                tagged = sorted(k for k, n in (value or {}).items() if n > 0)
                pick = tagged[0] if column.agg == "first" else tagged[-1]
                row[name] = orjson.loads(pick[1])
        view[key] = row
    return view
