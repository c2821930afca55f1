"""The engine's incremental reducers: grouped views and Top-N views.

`docs/SEMANTICS.md` is the contract; `refold.reference` is its from-scratch
model, and the tests hold the two equal. Here every unit (one event, or a
`-C`/`+C` pair) costs O(log n) per touched key: state is kept per view key as
just what its reductions need —

- every view: the live rows as fingerprint → copies (to refuse a retraction of
  a row that is not live) and the number of live rows;
- `sum`/`avg`/`count(c)`: exact running sums and non-null counts;
- `min`/`max`/`set`: a sorted multiset of the column's values;
- `first`/`last`: the live copies ordered by tag.

The batch processor calls `apply` per unit in order, `take_deltas` and
`take_state_changes` once per batch (inside its transaction), `restore` once at
start with the latest `P.state` records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import orjson
from sortedcontainers import SortedKeyList, SortedList

from refold.config import ColumnSpec, ViewSpec
from refold.model.changelog import Op, canonical_row
from refold.model.reasons import Reason

Tag = tuple[int, int, int]  # (event_time, partition, offset)
Number = int | Fraction


class SourceEvent(NamedTuple):
    """One decoded input event with the tag that orders it (a named tuple: one is
    made per input event, and a tuple is several times cheaper to make than a
    frozen dataclass)."""

    op: Op
    row: dict[str, Any]
    tag: Tag


class ViewChange(NamedTuple):
    """One record of the view changelog: an op, the output key and the view row."""

    op: Op
    key: tuple[Any, ...]
    row: dict[str, Any]
    key_names: tuple[str, ...] = ()

    def key_json(self) -> bytes:
        """The Kafka message key: a JSON object of the key columns."""
        return orjson.dumps(dict(zip(self.key_names, self.key, strict=True)))


class Rejected(Exception):
    """A unit was refused; the reducer's state is exactly as before the call."""

    def __init__(self, reason: str, index: int, detail: str | None = None) -> None:
        super().__init__(f"{reason} (event {index} of the unit)" + (f": {detail}" if detail else ""))
        self.reason = reason
        self.index = index
        self.detail = detail


class ViewReducer(Protocol):
    def apply(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        """Apply one unit; return its view records in order. Raises Rejected, changing nothing."""
        ...

    def take_deltas(self) -> list[dict[str, Any]]:
        """Delta rows of the keys touched since the last call, ordered by key; then reset."""
        ...

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        """`P.state` records (key, value or None = tombstone) for state touched since the last call."""
        ...

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Rebuild from the latest value of each `P.state` key. Called before any apply."""
        ...

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The current view rows by output key."""
        ...


def make_reducer(spec: ViewSpec) -> ViewReducer:
    if spec.top_n is not None:
        return TopNReducer(spec)
    return GroupedReducer(spec)


def fingerprint(row: dict[str, Any]) -> bytes:
    """16 bytes naming a distinct row (equal rows ⇔ equal canonical bytes)."""
    return hashlib.blake2b(canonical_row(row), digest_size=16).digest()


def key_bytes(key: tuple[Any, ...]) -> bytes:
    """The order of output keys within a unit: their canonical JSON list bytes."""
    return orjson.dumps(list(key))


def same_row(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return canonical_row(a) == canonical_row(b)


def diff_changes(
    old: dict[str, Any] | None, new: dict[str, Any] | None, key: tuple[Any, ...], names: tuple[str, ...]
) -> list[ViewChange]:
    """The view records for one output key going from `old` to `new`."""
    if old is None:
        return [] if new is None else [ViewChange(Op.APPEND, key, new, names)]
    if new is None:
        return [ViewChange(Op.RETRACT, key, old, names)]
    if same_row(old, new):
        return []
    return [ViewChange(Op.CORRECT_FROM, key, old, names), ViewChange(Op.CORRECT_TO, key, new, names)]


def compact_changes(changes: Sequence[ViewChange]) -> list[ViewChange]:
    """`emit: per_batch`: per output key, the row before the batch against the row after it."""
    first: dict[tuple[Any, ...], tuple[dict[str, Any] | None, tuple[str, ...]]] = {}
    last: dict[tuple[Any, ...], dict[str, Any] | None] = {}
    for change in changes:
        if change.key not in first:
            before = None if change.op is Op.APPEND else change.row
            first[change.key] = (before, change.key_names)
        last[change.key] = change.row if change.op.adds else None
    out: list[ViewChange] = []
    for key in sorted(first, key=key_bytes):
        before, names = first[key]
        out.extend(diff_changes(before, last[key], key, names))
    return out


def exact(value: Number, floats: int) -> int | float:
    """An exact running sum as its output number (SEMANTICS.md: numbers are exact)."""
    return float(value) if floats else int(value)


def is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


MAX_KEY_CHARS = 64 * 1024  # a longer key is refused ("key too large"): outputs repeat it
_SCALARS = (str, int, float, bool)


def value_order(value: Any) -> tuple[int, Any]:
    """The total order of column values for min, max, set and Top-N (SEMANTICS.md):
    numbers, then strings, then booleans — so mixed types never fail to compare."""
    kind = type(value)
    if kind is int or kind is float:
        return (0, value)
    if kind is str:
        return (1, value)
    return (2, orjson.dumps(value))


def key_problem(parts: tuple[Any, ...]) -> tuple[str, str] | None:
    """Why key values cannot key a view (reason, detail), or None. Nulls are checked apart."""
    chars = 0
    for part in parts:
        if type(part) is str:
            chars += len(part)
        elif type(part) not in _SCALARS:
            return Reason.SCHEMA_MISMATCH, "a key column holds a list or an object"
    if chars > MAX_KEY_CHARS:
        return Reason.KEY_TOO_LARGE, f"{chars} characters, at most {MAX_KEY_CHARS}"
    return None


def checked_key(
    row: dict[str, Any], columns: Sequence[str], what: str, scalar_columns: Sequence[str], index: int
) -> tuple[Any, ...]:
    """The key of `row` over `columns`; Rejected (at `index` of its unit) when a key column
    is missing or null, not a scalar or too large, or one of `scalar_columns` holds a list
    or an object."""
    try:
        key = tuple(row[c] for c in columns)
    except KeyError as exc:
        raise Rejected(Reason.NULL_KEY, index, f"{what} column {exc.args[0]!r} is missing") from None
    if None in key:
        raise Rejected(Reason.NULL_KEY, index)
    problem = key_problem(key)
    if problem is not None:
        raise Rejected(problem[0], index, problem[1])
    detail = scalar_problem(row, scalar_columns)
    if detail is not None:
        raise Rejected(Reason.SCHEMA_MISMATCH, index, detail)
    return key


def scalar_problem(row: dict[str, Any], columns: Sequence[str]) -> str | None:
    """The detail when one of `columns` (ordered or counted by value) is a list or an object."""
    for column in columns:
        value = row.get(column)
        if value is not None and type(value) not in _SCALARS:
            return f"{column!r} holds a list or an object"
    return None


# State records (schemas/avro/state.avsc) ------------------------------------------------

def encode_state(kind: str, key: tuple[Any, ...], count: int, values: Any, tags: Sequence[Tag]) -> bytes:
    """One `P.state` record in Avro's binary encoding of `schemas/avro/state.avsc`.

    Written by hand because the engine writes one or two of these per input event and
    fastavro's `schemaless_writer` costs ~10 µs a call here against ~3 µs for this;
    `tests/test_views.py` holds the bytes equal to fastavro's, and `decode_state`'s
    reading equal to fastavro's, for random records."""
    return _encode_state(kind, key_bytes(key), count, values, tags)


def _encode_state(kind: str, key_json: bytes, count: int, values: Any, tags: Sequence[Tag]) -> bytes:
    """`encode_state` with the key already as its JSON list (`key_bytes`): a batch's
    state records of one key share it with their record keys."""
    out = bytearray(_KIND_BYTES[kind])
    _string(out, key_json)
    _long(out, count)
    if values is None:
        out.append(0)  # union branch 0: null
    else:
        out.append(2)  # union branch 1 (zig-zag): string
        _string(out, orjson.dumps(values))
    if tags:
        _long(out, len(tags))
        for event_time, partition, offset in tags:
            _long(out, event_time)
            _long(out, partition)
            _long(out, offset)
    out.append(0)  # end of the array
    return bytes(out)


_KIND_BYTES = {"KEY_SUMMARY": b"\x00", "LIVE_ROW": b"\x02"}  # enum index, zig-zag


def _long(out: bytearray, value: int) -> None:
    """Avro int/long: zig-zag, then base-128 varint, low groups first."""
    n = (value << 1) ^ (value >> 63)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _string(out: bytearray, data: bytes) -> None:
    _long(out, len(data))
    out += data


def decode_state(data: bytes) -> dict[str, Any]:
    """A `P.state` record (Avro binary of `schemas/avro/state.avsc`) with its JSON
    fields parsed. Read by hand, as `encode_state` writes: recovery reads one or two
    per live key. Raises ValueError when the bytes are not such a record."""
    try:
        kind, pos = _read_long(data, 0)
        size, pos = _read_long(data, pos)
        key = tuple(orjson.loads(data[pos : pos + size]))
        pos += size
        count, pos = _read_long(data, pos)
        branch, pos = _read_long(data, pos)
        values = None
        if branch:
            size, pos = _read_long(data, pos)
            values = orjson.loads(data[pos : pos + size])
            pos += size
        tags: list[Tag] = []
        block, pos = _read_long(data, pos)
        while block:
            if block < 0:  # a block with its size in bytes (other writers may do this)
                block = -block
                _size, pos = _read_long(data, pos)
            for _ in range(block):
                event_time, pos = _read_long(data, pos)
                partition, pos = _read_long(data, pos)
                offset, pos = _read_long(data, pos)
                tags.append((event_time, partition, offset))
            block, pos = _read_long(data, pos)
        if pos != len(data) or kind not in (0, 1) or branch not in (0, 1):
            raise ValueError("not a state record")
    except (IndexError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"not a state record: {exc}") from exc
    return {"kind": _KINDS[kind], "key": key, "count": count, "values": values, "tags": tags}


_KINDS = ("KEY_SUMMARY", "LIVE_ROW")


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    pos += 1
    n = byte & 0x7F
    shift = 7
    while byte & 0x80:
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def _row_key(key_json: bytes, fp: bytes) -> bytes:
    """The `P.state` record key of a live row: `[key, fp hex]` as JSON (`key_json` is
    `key_bytes(key)`; orjson writes no spaces, so this is `orjson.dumps([list(key), fp.hex()])`)."""
    return b"[" + key_json + b',"' + fp.hex().encode() + b'"]'


def _summary_key(key_json: bytes) -> bytes:
    """The `P.state` record key of a key's summary: `[key]` as JSON."""
    return b"[" + key_json + b"]"


# Grouped views -----------------------------------------------------------------------


class _Row:
    """The live copies of one distinct row under one key."""

    __slots__ = ("count", "tags", "vals")

    def __init__(self, count: int, tags: list[Tag] | None, vals: tuple[Any, ...] | None) -> None:
        self.count = count
        self.tags = tags  # ascending; only when a reduction orders by tag
        self.vals = vals  # the kept columns' values; only when a reduction needs them


class _Multiset:
    """One column's live values and their copies, in `value_order` (min, max, set).

    Most keys hold one distinct value, so the sorted index of the values is made only
    when a second one arrives: a sorted container costs more to make than to use."""

    __slots__ = ("counts", "ordered")

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}
        self.ordered: SortedKeyList | None = None

    def change(self, value: Any, copies: int) -> None:
        counts = self.counts
        count = counts.get(value, 0) + copies
        if count:
            if value not in counts:
                if self.ordered is not None:
                    self.ordered.add(value)
                elif counts:
                    self.ordered = SortedKeyList(counts, key=value_order)
                    self.ordered.add(value)
            counts[value] = count
        else:
            del counts[value]
            if self.ordered is not None:
                self.ordered.remove(value)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def values(self) -> Iterable[Any]:
        """The distinct values, smallest first."""
        return self.ordered if self.ordered is not None else self.counts

    def extreme(self, last: bool) -> Any:
        """The smallest (or, when `last`, the largest) value; None when empty."""
        if not self.counts:
            return None
        if self.ordered is not None:
            return self.ordered[-1 if last else 0]
        return next(iter(self.counts))


class _Key:
    __slots__ = ("floats", "multisets", "nonnull", "order", "rows", "sums", "total", "view")

    def __init__(self, plan: _Plan) -> None:
        self.rows: dict[bytes, _Row] = {}
        self.total = 0
        self.sums: dict[str, Number] = dict.fromkeys(plan.sum_columns, 0)
        self.floats: dict[str, int] = dict.fromkeys(plan.sum_columns, 0)
        self.nonnull: dict[str, int] = dict.fromkeys(plan.nonnull_columns, 0)
        self.multisets: list[_Multiset] = [_Multiset() for _ in plan.multiset_columns]
        self.order: SortedList | None = SortedList() if plan.needs_tags else None
        self.view: dict[str, Any] | None = None


class _Delta:
    __slots__ = ("contribs", "floats", "multisets", "nonnull", "sums", "total")

    def __init__(self, plan: _Plan) -> None:
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
        self.readers = [(name, self._reader(spec)) for name, spec in columns.items()]
        self.delta_readers = [(name, self._delta_reader(spec)) for name, spec in columns.items()]

    def _reader(self, spec: ColumnSpec) -> Callable[[_Key], Any]:
        """How one view column is read off a key's running values (made once per view:
        the view row is rebuilt for every unit that touches its key)."""
        agg, column = spec.agg, spec.column
        running = _running_reader(agg, column)
        if running is not None:
            return running
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
        """How one column of a delta row is read off a key's batch contributions."""
        agg, column = spec.agg, spec.column
        running = _running_reader(agg, column)
        if running is not None:
            return running
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


def _running_reader(agg: str, column: str) -> Callable[[Any], Any] | None:
    """`sum` and `count` read alike off a key's running values (`_Key`) and off a batch's
    contributions to it (`_Delta`): both keep `sums`, `floats`, `nonnull` and `total`."""
    if agg == "sum":
        return lambda running: exact(running.sums[column], running.floats[column])
    if agg == "count":
        if column == "*":
            return lambda running: running.total
        return lambda running: running.nonnull[column]
    return None


class GroupedReducer:
    """`key` + `columns` views (SEMANTICS.md, grouped views)."""

    def __init__(self, spec: ViewSpec) -> None:
        self.key_columns = tuple(spec.key)
        self.plan = _Plan(dict(spec.columns))
        self.keys: dict[tuple[Any, ...], _Key] = {}
        self._deltas: dict[tuple[Any, ...], _Delta] = {}
        self._dirty_keys: set[tuple[Any, ...]] = set()
        self._dirty_rows: set[tuple[tuple[Any, ...], bytes]] = set()

    # apply ------------------------------------------------------------------------------

    def apply(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        if len(unit) == 1:
            return self._apply_event(unit[0])
        prepared = [(event, *self._checked(event, index)) for index, event in enumerate(unit)]
        self._check_live(prepared)
        before: dict[tuple[Any, ...], dict[str, Any] | None] = {}
        for event, key, fp in prepared:
            state = self.keys.get(key)
            if key not in before:
                before[key] = state.view if state is not None else None
            if event.op.adds:
                self._add(key, fp, event)
            else:
                self._remove(key, fp, event)
        changes: list[ViewChange] = []
        for key in sorted(before, key=key_bytes) if len(before) > 1 else before:
            changes.extend(self._settle(key, before[key]))
        return changes

    def _apply_event(self, event: SourceEvent) -> list[ViewChange]:
        """`apply` of a unit of one event (most units): one key, so no pending counts
        and no ordering of keys."""
        key, fp = self._checked(event, 0)
        state = self.keys.get(key)
        if event.op.adds:
            before = state.view if state is not None else None
            self._add(key, fp, event)
        else:
            if state is None or fp not in state.rows:  # a live row has at least one copy
                raise Rejected(Reason.NOT_LIVE, 0)
            before = state.view
            self._remove(key, fp, event)
        return self._settle(key, before)

    def _checked(self, event: SourceEvent, index: int) -> tuple[tuple[Any, ...], bytes]:
        """The event's view key and row fingerprint; Rejected (at `index` of its unit) when
        its key is unusable or a summed column holds something that is not a number."""
        row = event.row
        key = checked_key(row, self.key_columns, "key", self.plan.multiset_columns, index)
        for column in self.plan.sum_columns:
            value = row.get(column)
            if value is not None and not is_number(value):
                raise Rejected(Reason.SCHEMA_MISMATCH, index, f"{column!r} is not a number")
        return key, fingerprint(row)

    def _settle(self, key: tuple[Any, ...], before: dict[str, Any] | None) -> list[ViewChange]:
        """After a unit: the key's new view row (or its end when no live row is left) and
        its view records against `before`."""
        state = self.keys[key]
        if state.total == 0:
            del self.keys[key]
            new = None
        else:
            new = state.view = self._view_row(key, state)
        return diff_changes(before, new, key, self.key_columns)

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

    def take_deltas(self) -> list[dict[str, Any]]:
        readers = self.plan.delta_readers
        out = []
        for key in sorted(self._deltas, key=key_bytes):
            delta = self._deltas[key]
            row: dict[str, Any] = dict(zip(self.key_columns, key, strict=True))
            row["_count"] = delta.total
            for name, read in readers:
                row[name] = read(delta)
            out.append(row)
        self._deltas = {}
        return out

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        key_json: dict[tuple[Any, ...], bytes] = {}  # every dirty row's key is a dirty key
        for key in self._dirty_keys:
            kj = key_json[key] = key_bytes(key)
            state = self.keys.get(key)
            if state is None:
                records.append((_summary_key(kj), None))
                continue
            summary = {
                "s": {c: [str(state.sums[c]), state.floats[c]] for c in self.plan.sum_columns},
                "nn": state.nonnull,
            }
            records.append((_summary_key(kj), _encode_state("KEY_SUMMARY", kj, state.total, summary, ())))
        for key, fp in self._dirty_rows:
            kj = key_json[key]
            state = self.keys.get(key)
            entry = state.rows.get(fp) if state is not None else None
            if entry is None:
                records.append((_row_key(kj, fp), None))
            else:
                values = None if entry.vals is None else list(entry.vals)
                records.append((_row_key(kj, fp), _encode_state("LIVE_ROW", kj, entry.count, values, entry.tags or ())))
        self._dirty_keys = set()
        self._dirty_rows = set()
        records.sort(key=lambda r: r[0])
        return records

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        plan = self.plan
        for record_key, value in records:
            record = decode_state(value)
            key = record["key"]
            state = self.keys.get(key)
            if state is None:
                state = self.keys[key] = _Key(plan)
            if record["kind"] == "KEY_SUMMARY":
                state.total = record["count"]
                for column, (total, floats) in record["values"]["s"].items():
                    state.sums[column] = Fraction(total) if floats else int(total)
                    state.floats[column] = floats
                state.nonnull.update(record["values"]["nn"])
                continue
            fp = bytes.fromhex(orjson.loads(record_key)[1])
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
        for key, state in list(self.keys.items()):
            if state.total == 0:
                del self.keys[key]
            else:
                state.view = self._view_row(key, state)

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {key: dict(state.view) for key, state in self.keys.items() if state.view is not None}


def _value_order(item: tuple[Any, int]) -> tuple[int, Any]:
    return value_order(item[0])


def _contribution_order(contribution: tuple[Tag, Any, int]) -> tuple[Tag, bytes, int]:
    tag, value, d = contribution
    return tag, orjson.dumps(value), d


# Top-N views ---------------------------------------------------------------------------


class _Desc:
    """Reverses the order of a value inside a sort key (for `desc` columns)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __lt__(self, other: _Desc) -> bool:
        return bool(other.value < self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Desc) and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash(self.value)


class _Group:
    __slots__ = ("ranked", "rows", "top")

    def __init__(self) -> None:
        self.ranked = SortedList()  # (sort key, tag, fp)
        self.rows: dict[bytes, tuple[dict[str, Any], list[Tag]]] = {}  # fp -> (row, live tags ascending)
        self.top: list[dict[str, Any]] = []  # the output rows at places 1..


class TopNReducer:
    """`top_n` views: rows ranked per `partition_by` group, output keyed by place."""

    def __init__(self, spec: ViewSpec) -> None:
        assert spec.top_n is not None
        self.n = spec.top_n.n
        self.order_by = tuple(spec.top_n.order_by.items())
        self.order_columns = tuple(spec.top_n.order_by)
        self.partition_by = tuple(spec.top_n.partition_by)
        self.key_names = (*self.partition_by, "place")
        self.groups: dict[tuple[Any, ...], _Group] = {}
        self._dirty: set[tuple[tuple[Any, ...], bytes]] = set()

    def _sort_key(self, row: dict[str, Any]) -> tuple[Any, ...]:
        parts: list[Any] = []
        for column, direction in self.order_by:
            value = row.get(column)
            if value is None:
                parts.append((1, 0))  # nulls last in either direction
            else:
                order = value_order(value)
                parts.append((0, order if direction == "asc" else _Desc(order)))
        return tuple(parts)

    def apply(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        prepared = []
        for index, event in enumerate(unit):
            group = checked_key(event.row, self.partition_by, "partition", self.order_columns, index)
            prepared.append((event, group, fingerprint(event.row)))
        pending: dict[tuple[tuple[Any, ...], bytes], int] = {}
        for index, (event, group, fp) in enumerate(prepared):
            have = pending.get((group, fp))
            if have is None:
                found = self.groups.get(group)
                have = len(found.rows[fp][1]) if found is not None and fp in found.rows else 0
            have += 1 if event.op.adds else -1
            if have < 0:
                raise Rejected(Reason.NOT_LIVE, index)
            pending[(group, fp)] = have
        touched: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for event, group, fp in prepared:
            state = self.groups.get(group)
            if state is None:
                state = self.groups[group] = _Group()
            if group not in touched:
                touched[group] = state.top
            if event.op.adds:
                row, tags = state.rows.setdefault(fp, (event.row, []))
                tags.append(event.tag)
                tags.sort()
                state.ranked.add((self._sort_key(row), event.tag, fp))
            else:
                row, tags = state.rows[fp]
                tag = tags.pop()  # the latest copy goes
                if not tags:
                    del state.rows[fp]
                state.ranked.remove((self._sort_key(row), tag, fp))
            self._dirty.add((group, fp))
        changes: list[ViewChange] = []
        for group, old_top in touched.items():
            state = self.groups[group]
            new_top = [self._output(group, place, state.rows[fp][0])
                       for place, (_k, _t, fp) in enumerate(state.ranked[: self.n], start=1)]
            state.top = new_top
            if not state.rows:
                del self.groups[group]
            for place in range(1, max(len(old_top), len(new_top)) + 1):
                old = old_top[place - 1] if place <= len(old_top) else None
                new = new_top[place - 1] if place <= len(new_top) else None
                changes.extend(diff_changes(old, new, (*group, place), self.key_names))
        if len(touched) > 1:
            order = {id(c): i for i, c in enumerate(changes)}
            changes.sort(key=lambda c: (key_bytes(c.key), order[id(c)]))
        return changes

    def _output(self, group: tuple[Any, ...], place: int, row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = dict(zip(self.partition_by, group, strict=True))
        out["place"] = place
        for column, value in row.items():
            if column not in out:
                out[column] = value
        return out

    def take_deltas(self) -> list[dict[str, Any]]:
        return []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        for group, fp in self._dirty:
            state = self.groups.get(group)
            found = state.rows.get(fp) if state is not None else None
            kj = key_bytes(group)
            if found is None:
                records.append((_row_key(kj, fp), None))
            else:
                row, tags = found
                records.append((_row_key(kj, fp), _encode_state("LIVE_ROW", kj, len(tags), row, tags)))
        self._dirty = set()
        records.sort(key=lambda r: r[0])
        return records

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        for record_key, value in records:
            record = decode_state(value)
            group = record["key"]
            state = self.groups.get(group)
            if state is None:
                state = self.groups[group] = _Group()
            fp = bytes.fromhex(orjson.loads(record_key)[1])
            row, tags = record["values"], list(record["tags"])
            state.rows[fp] = (row, tags)
            sort_key = self._sort_key(row)
            for tag in tags:
                state.ranked.add((sort_key, tag, fp))
        for group, state in self.groups.items():
            state.top = [self._output(group, place, state.rows[fp][0])
                         for place, (_k, _t, fp) in enumerate(state.ranked[: self.n], start=1)]

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {(*group, row["place"]): dict(row) for group, state in self.groups.items() for row in state.top}
