"""Grouped views (`key` + `columns`): the incremental reducer and the running values it
keeps per view key (see the package docstring for the contract).

Every unit costs O(log n) per touched key: state is kept per view key as just what
its reductions need —
- every view: the live rows as fingerprint → copies (to refuse a retraction of
  a row that is not live) and the number of live rows;
- `sum`/`avg`/`count(c)`: exact running sums and non-null counts;
- `min`/`max`/`set`: a sorted multiset of the column's values;
- `first`/`last`: the live copies ordered by tag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import orjson

from refold.config import ColumnSpec, ViewSpec
from refold.model.reasons import Reason
from refold.reduce.ordered import Multiset, Sorted
from refold.reduce.statecodec import (
    decode_state,
    row_fingerprint,
    row_key,
    state_value,
    summary_key,
)
from refold.reduce.types import (
    Cause,
    Changes,
    DeltaRows,
    Number,
    Rejected,
    SourceEvent,
    Tag,
    cause_of,
)
from refold.reduce.values import (
    checked_key,
    diff_changes,
    exact,
    fingerprint,
    is_number,
    key_bytes,
    live_fingerprint,
    value_order,
)


class _Row:
    """The live copies of one distinct row under one key."""

    __slots__ = ("count", "tags", "vals")

    def __init__(self, count: int, tags: list[Tag] | None, vals: tuple[Any, ...] | None) -> None:
        self.count = count
        self.tags = tags  # ascending; only when a reduction orders by tag
        self.vals = vals  # the kept columns' values; only when a reduction needs them


class _Key:
    """One view key's live rows, running values and current view row (None until set)."""

    __slots__ = ("cause", "floats", "multisets", "nonnull", "order", "rows", "sums", "total", "view")

    def __init__(self, plan: _Plan) -> None:
        self.rows: dict[bytes, _Row] = {}
        self.total = 0
        self.sums: dict[str, Number] = dict.fromkeys(plan.sum_columns, 0)
        self.floats: dict[str, int] = dict.fromkeys(plan.sum_columns, 0)
        self.nonnull: dict[str, int] = dict.fromkeys(plan.nonnull_columns, 0)
        self.multisets: list[Multiset] = [Multiset() for _ in plan.multiset_columns]
        self.order: Sorted | None = Sorted() if plan.needs_tags else None
        self.view: dict[str, Any] | None = None
        self.cause: Cause | None = None  # the cause of the view record that wrote `view` (None: unknown)


class _Delta:
    """One view key's contributions in the current batch: its delta row's source."""

    __slots__ = ("cause", "contribs", "floats", "multisets", "nonnull", "sums", "total")

    def __init__(self, plan: _Plan) -> None:
        self.cause: Cause | None = None  # the batch's last event that contributed
        self.total = 0  # copies added minus copies removed in the batch
        self.sums: dict[str, Number] = dict.fromkeys(plan.sum_columns, 0)
        self.floats: dict[str, int] = dict.fromkeys(plan.sum_columns, 0)
        self.nonnull: dict[str, int] = dict.fromkeys(plan.nonnull_columns, 0)
        self.multisets: list[dict[Any, int]] = [{} for _ in plan.multiset_columns]
        self.contribs: list[list[tuple[Tag, Any, int]]] = [[] for _ in plan.tag_columns]


class _Plan:
    """Which running values a view's columns need, compiled once from its spec."""

    def __init__(self, columns: dict[str, ColumnSpec]) -> None:
        self.columns = columns
        sums: list[str] = []
        nonnull: list[str] = []
        multisets: list[str] = []
        tagged: list[str] = []
        for spec in columns.values():
            if spec.agg in ("sum", "avg") and spec.column not in sums:
                sums.append(spec.column)
            if spec.agg in ("avg", "count") and spec.column != "*" and spec.column not in nonnull:
                nonnull.append(spec.column)
            if spec.agg in ("min", "max", "set") and spec.column not in multisets:
                multisets.append(spec.column)
            if spec.agg in ("first", "last", "last_write_wins") and spec.column not in tagged:
                tagged.append(spec.column)
        self.sum_columns = tuple(sums)
        self.nonnull_columns = tuple(nonnull)
        self.multiset_columns = tuple(multisets)
        self.tag_columns = tuple(tagged)
        self.kept = tuple(dict.fromkeys(multisets + tagged))  # the values a _Row keeps
        self.kept_index = {c: i for i, c in enumerate(self.kept)}
        self.multiset_index = [self.kept_index[c] for c in multisets]
        self.needs_tags = bool(tagged)
        self.readers = [(name, _running_reader(spec) or self._reader(spec)) for name, spec in columns.items()]
        self.delta_readers = [
            (name, _running_reader(spec) or self._delta_reader(spec)) for name, spec in columns.items()
        ]

    def _reader(self, spec: ColumnSpec) -> Callable[[_Key], Any]:
        """How one view column other than `sum` and `count` (`_running_reader`) is read
        off a key's running values (made once per view: the view row is rebuilt for every
        unit that touches its key)."""
        agg, column = spec.agg, spec.column
        if agg == "avg":
            def average(state: _Key) -> float | None:
                n = state.nonnull[column]
                return float(Fraction(state.sums[column]) / n) if n else None
            return average
        if agg in ("min", "max", "set"):
            slot = self.multiset_columns.index(column)
            if agg == "set":
                return lambda state: [[v, state.multisets[slot].counts[v]] for v in state.multisets[slot].values()]
            last = agg == "max"
            return lambda state: state.multisets[slot].extreme(last)
        # first / last / last_write_wins: the value of the earliest or latest live copy
        end = 0 if agg == "first" else -1
        index = self.kept_index[column]

        def by_tag(state: _Key) -> Any:
            assert state.order is not None
            vals = state.rows[state.order[end][1]].vals
            assert vals is not None
            return vals[index]
        return by_tag

    def _delta_reader(self, spec: ColumnSpec) -> Callable[[_Delta], Any]:
        """How one column of a delta row other than `sum` and `count` (`_running_reader`)
        is read off a key's batch contributions."""
        agg, column = spec.agg, spec.column
        if agg == "avg":
            return lambda delta: {"sum": exact(delta.sums[column], delta.floats[column]),
                                  "count": delta.nonnull[column]}
        if agg in ("min", "max", "set"):
            slot = self.multiset_columns.index(column)

            def value_changes(delta: _Delta) -> list[list[Any]]:
                changes = delta.multisets[slot]
                items = sorted(changes.items(), key=_value_order) if len(changes) > 1 else changes.items()
                return [[v, d] for v, d in items if d]
            return value_changes
        tag_slot = self.tag_columns.index(column)

        def contributions(delta: _Delta) -> list[list[Any]]:
            contribs = delta.contribs[tag_slot]
            if len(contribs) > 1:
                contribs = sorted(contribs, key=_contribution_order)
            return [[list(tag), value, d] for tag, value, d in contribs]
        return contributions


def _running_reader(spec: ColumnSpec) -> Callable[[Any], Any] | None:
    """`sum` and `count` read alike off a key's running values (`_Key`) and off a batch's
    contributions to it (`_Delta`): both keep `sums`, `floats`, `nonnull` and `total`.
    None for the other aggregations."""
    agg, column = spec.agg, spec.column
    if agg == "sum":
        return lambda running: exact(running.sums[column], running.floats[column])
    if agg == "count":
        if column == "*":
            return lambda running: running.total
        return lambda running: running.nonnull[column]
    return None


def _value_order(item: tuple[Any, int]) -> tuple[int, Any]:
    """A delta's (value, copies) in `value_order` of the value."""
    return value_order(item[0])


def _contribution_order(contribution: tuple[Tag, Any, int]) -> tuple[Tag, bytes, int]:
    """A delta's (tag, value, sign) by tag, then by the value's JSON (values may not compare)."""
    tag, value, d = contribution
    return tag, orjson.dumps(value), d


class GroupedReducer:
    """`key` + `columns` views (SEMANTICS.md, grouped views)."""

    def __init__(self, spec: ViewSpec) -> None:
        self.key_columns = tuple(spec.key)
        self.plan = _Plan(dict(spec.columns))
        self.keys: dict[tuple[Any, ...], _Key] = {}
        self._deltas: dict[tuple[Any, ...], _Delta] = {}
        self._dirty_keys: set[tuple[Any, ...]] = set()
        self._dirty_rows: set[tuple[tuple[Any, ...], bytes]] = set()
        self._cause: Cause | None = None  # the cause of the unit being applied

    # apply ------------------------------------------------------------------------------

    def apply(self, unit: Sequence[SourceEvent]) -> Changes:
        if len(unit) == 1:
            return self._apply_event(unit[0])
        prepared = [(event, *self._checked(event, index)) for index, event in enumerate(unit)]
        self._check_live(prepared)
        cause = self._cause = cause_of(unit[0].tag)
        before: dict[tuple[Any, ...], tuple[dict[str, Any] | None, Cause | None]] = {}
        for event, key, fp in prepared:
            state = self.keys.get(key)
            if key not in before:
                before[key] = (state.view, state.cause) if state is not None else (None, None)
            if event.op.adds:
                self._add(key, fp, event)
            else:
                self._remove(key, fp, event)
        changes = Changes(cause)
        for key in sorted(before, key=key_bytes) if len(before) > 1 else before:
            self._settle(key, *before[key], changes)
        return changes

    def _apply_event(self, event: SourceEvent) -> Changes:
        """`apply` of a unit of one event (most units): one key, so no pending counts
        and no ordering of keys."""
        key, fp = self._checked(event, 0)
        state = self.keys.get(key)
        cause = self._cause = cause_of(event.tag)
        if event.op.adds:
            before, before_cause = (state.view, state.cause) if state is not None else (None, None)
            self._add(key, fp, event)
        else:
            if state is None or fp not in state.rows:  # a live row has at least one copy
                raise Rejected(Reason.NOT_LIVE, 0)
            before, before_cause = state.view, state.cause
            self._remove(key, fp, event)
        changes = Changes(cause)
        self._settle(key, before, before_cause, changes)
        return changes

    def view_key(self, event: SourceEvent, index: int) -> tuple[Any, ...]:
        """The event's view key; Rejected (at `index` of its unit) when its key is
        unusable or a summed column holds something that is not a number."""
        key = checked_key(event.row, self.key_columns, "key", self.plan.multiset_columns, index)
        for column in self.plan.sum_columns:
            value = event.row.get(column)
            if value is not None and not is_number(value):
                raise Rejected(Reason.SCHEMA_MISMATCH, index, f"{column!r} is not a number")
        return key

    def _checked(self, event: SourceEvent, index: int) -> tuple[tuple[Any, ...], bytes]:
        """The event's view key (`view_key`) and row fingerprint."""
        key, fp = self.view_key(event, index), fingerprint(event.row)
        if not event.op.adds and (state := self.keys.get(key)) is not None:
            fp = live_fingerprint(event.row, fp, state.rows)  # state from before null equalled absent
        return key, fp

    def _settle(
        self, key: tuple[Any, ...], before: dict[str, Any] | None, before_cause: Cause | None, changes: Changes
    ) -> None:
        """After a unit: the key's new view row (or its end when no live row is left) and
        its view records against `before` into `changes`, with the cause of what they
        retract (`before_cause`); the key keeps the unit's cause when its row changed."""
        state = self.keys[key]
        if state.total == 0:
            del self.keys[key]
            new = None
        else:
            new = state.view = self._view_row(key, state)
        diff = diff_changes(before, new, key, self.key_columns)
        if diff:
            state.cause = changes.cause
            changes.extend(diff)
            changes.retracts.extend(None if change.op.adds else before_cause for change in diff)

    def _check_live(self, prepared: list[tuple[SourceEvent, tuple[Any, ...], bytes]]) -> None:
        pending: dict[tuple[tuple[Any, ...], bytes], int] = {}
        for index, (event, key, fp) in enumerate(prepared):
            step = 1 if event.op.adds else -1
            have = pending.get((key, fp))
            if have is None:
                state = self.keys.get(key)
                entry = state.rows.get(fp) if state is not None else None
                have = entry.count if entry is not None else 0
            if have + step < 0:
                raise Rejected(Reason.NOT_LIVE, index)
            pending[(key, fp)] = have + step

    def _add(self, key: tuple[Any, ...], fp: bytes, event: SourceEvent) -> None:
        plan = self.plan
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _Key(plan)
        row = event.row
        entry = state.rows.get(fp)
        if entry is None:
            vals = tuple(row.get(c) for c in plan.kept) if plan.kept else None
            entry = state.rows[fp] = _Row(0, [] if plan.needs_tags else None, vals)
        entry.count += 1
        if entry.tags is not None:
            entry.tags.append(event.tag)
            if len(entry.tags) > 1 and entry.tags[-2] > event.tag:
                entry.tags.sort()
        state.total += 1
        self._account(key, state, entry, fp, row, event.tag, +1)
        self._dirty_keys.add(key)
        self._dirty_rows.add((key, fp))

    def _remove(self, key: tuple[Any, ...], fp: bytes, event: SourceEvent) -> None:
        state = self.keys[key]
        entry = state.rows[fp]
        tag = entry.tags.pop() if entry.tags is not None else (0, 0, 0)  # the latest copy goes
        entry.count -= 1
        if entry.count == 0:
            del state.rows[fp]
        state.total -= 1
        self._account(key, state, entry, fp, event.row, tag, -1)
        self._dirty_keys.add(key)
        self._dirty_rows.add((key, fp))

    def _account(
        self, key: tuple[Any, ...], state: _Key, entry: _Row, fp: bytes, values: dict[str, Any], tag: Tag, sign: int
    ) -> None:
        """Fold one copy of a row in (+1) or out (-1) of the running values and of the
        batch's delta. `values` is the row itself: sums and non-null counts read it,
        as invertible reductions keep no values in `_Row`."""
        plan = self.plan
        delta = self._deltas.get(key)
        if delta is None:
            delta = self._deltas[key] = _Delta(plan)
        delta.total += sign
        delta.cause = self._cause
        row_vals = entry.vals
        for column in plan.sum_columns:
            value = values.get(column)
            if value is None:
                continue
            if type(value) is float:
                contribution: Number = Fraction(value)
                state.floats[column] += sign
                delta.floats[column] += 1
            else:
                contribution = value
            total = state.sums[column] + sign * contribution
            if state.floats[column] == 0 and type(total) is Fraction:
                total = int(total)
            state.sums[column] = total
            delta.sums[column] += sign * contribution
        for column in plan.nonnull_columns:
            if values.get(column) is not None:
                state.nonnull[column] += sign
                delta.nonnull[column] += sign
        if row_vals is None:
            return
        for slot, index in enumerate(plan.multiset_index):
            value = row_vals[index]
            if value is None:
                continue
            state.multisets[slot].change(value, sign)
            changes = delta.multisets[slot]
            changes[value] = changes.get(value, 0) + sign
        if state.order is not None:
            if sign > 0:
                state.order.add((tag, fp))
            else:
                state.order.remove((tag, fp))
            for slot, column in enumerate(plan.tag_columns):
                delta.contribs[slot].append((tag, row_vals[plan.kept_index[column]], sign))

    def _view_row(self, key: tuple[Any, ...], state: _Key) -> dict[str, Any]:
        row: dict[str, Any] = dict(zip(self.key_columns, key, strict=True))
        for name, read in self.plan.readers:
            row[name] = read(state)
        return row

    # batch boundaries ----------------------------------------------------------------------

    def take_deltas(self) -> DeltaRows:
        readers = self.plan.delta_readers
        out = DeltaRows()
        for key in sorted(self._deltas, key=key_bytes):
            delta = self._deltas[key]
            row: dict[str, Any] = dict(zip(self.key_columns, key, strict=True))
            row["_count"] = delta.total
            for name, read in readers:
                row[name] = read(delta)
            out.append(row)
            out.causes.append(delta.cause)
        self._deltas = {}
        return out

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        key_json: dict[tuple[Any, ...], bytes] = {}  # every dirty row's key is a dirty key
        for key in self._dirty_keys:
            kj = key_json[key] = key_bytes(key)
            state = self.keys.get(key)
            if state is None:
                records.append((summary_key(kj), None))
                continue
            summary: dict[str, Any] = {
                "s": {c: [str(state.sums[c]), state.floats[c]] for c in self.plan.sum_columns},
                "nn": state.nonnull,
            }
            if state.cause is not None:  # the cause of the key's current view record
                summary["c"] = state.cause
            records.append((summary_key(kj), state_value("KEY_SUMMARY", kj, state.total, summary, ())))
        for key, fp in self._dirty_rows:
            kj = key_json[key]
            state = self.keys.get(key)
            entry = state.rows.get(fp) if state is not None else None
            if entry is None:
                records.append((row_key(kj, fp), None))
            else:
                values = None if entry.vals is None else list(entry.vals)
                records.append((row_key(kj, fp), state_value("LIVE_ROW", kj, entry.count, values, entry.tags or ())))
        self._dirty_keys = set()
        self._dirty_rows = set()
        records.sort(key=lambda r: r[0])
        return records

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        """The view key whose state the event reads (None: the event is refused anyway)."""
        try:  # (not `view_key`: a unit refused for its summed column still loads its key, as the native core does)
            return checked_key(event.row, self.key_columns, "key", self.plan.multiset_columns, 0)
        except Rejected:
            return None

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Add the keys these records hold (every record of each: `[key]` and its rows);
        keys already held are left as they are unless records of theirs come again."""
        plan = self.plan
        restored: set[tuple[Any, ...]] = set()
        for record_key, value in records:
            record = decode_state(value)
            key = record["key"]
            if key not in restored:
                restored.add(key)
                state = self.keys[key] = _Key(plan)
            else:
                state = self.keys[key]
            if record["kind"] == "KEY_SUMMARY":
                state.total = record["count"]
                for column, (total, floats) in record["values"]["s"].items():
                    state.sums[column] = Fraction(total) if floats else int(total)
                    state.floats[column] = floats
                state.nonnull.update(record["values"]["nn"])
                cause = record["values"].get("c")  # (absent in state written before causes were kept)
                state.cause = (cause[0], cause[1]) if cause is not None else None
                continue
            fp = row_fingerprint(record_key)
            vals = tuple(record["values"]) if record["values"] is not None else None
            entry = _Row(record["count"], list(record["tags"]) if plan.needs_tags else None, vals)
            state.rows[fp] = entry
            if vals is not None:
                for slot, index in enumerate(plan.multiset_index):
                    if vals[index] is not None:
                        state.multisets[slot].change(vals[index], entry.count)
            if state.order is not None and entry.tags is not None:
                for tag in entry.tags:
                    state.order.add((tag, fp))
        for key in restored:
            state = self.keys[key]
            if state.total == 0:
                del self.keys[key]
            else:
                state.view = self._view_row(key, state)

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {key: dict(state.view) for key, state in self.keys.items() if state.view is not None}
