"""Top-N views (`top_n`): rows ranked per `partition_by` group, output keyed by place
(see the package docstring for the contract)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from refold.config import ViewSpec
from refold.model.reasons import Reason
from refold.reduce.ordered import Sorted
from refold.reduce.statecodec import (
    decode_state,
    row_fingerprint,
    row_key,
    state_value,
    summary_key,
)
from refold.reduce.types import Cause, Changes, Rejected, SourceEvent, Tag, cause_of
from refold.reduce.values import (
    checked_key,
    diff_changes,
    fingerprint,
    key_bytes,
    live_fingerprint,
    value_order,
)


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
    """One `partition_by` group: its live rows, ranked, and its current output."""

    __slots__ = ("causes", "fps", "ranked", "rows", "top")

    def __init__(self) -> None:
        self.ranked = Sorted()  # (sort key, tag, fp)
        self.rows: dict[bytes, tuple[dict[str, Any], list[Tag]]] = {}  # fp -> (row, live tags ascending)
        self.top: list[dict[str, Any]] = []  # the output rows at places 1..
        self.fps: list[bytes] = []  # the fingerprints of their rows
        self.causes: list[Cause | None] = []  # the causes of the view records that wrote them (None: unknown)


class TopNReducer:
    """`top_n` views: rows ranked per `partition_by` group, output keyed by place."""

    def __init__(self, spec: ViewSpec) -> None:
        assert spec.top_n is not None
        self.n = spec.top_n.n
        self.order_by = tuple(spec.top_n.order_by.items())
        self.order_columns = tuple(spec.top_n.order_by)
        self.partition_by = tuple(spec.top_n.partition_by)
        self.key_names = (*self.partition_by, "place")
        self.columns = None if spec.top_n.columns is None else tuple(spec.top_n.columns)
        self.groups: dict[tuple[Any, ...], _Group] = {}
        self._dirty: set[tuple[tuple[Any, ...], bytes]] = set()
        self._dirty_causes: set[tuple[Any, ...]] = set()  # groups whose places' causes changed

    def _sort_key(self, row: dict[str, Any]) -> tuple[Any, ...]:
        """The rank of a row by `order_by`, in `value_order`, nulls last either way; rows
        that tie rank by tag (`ranked` holds (sort key, tag, fp)), the earlier first."""
        parts: list[Any] = []
        for column, direction in self.order_by:
            value = row.get(column)
            if value is None:
                parts.append((1, 0))  # nulls last in either direction
            elif direction == "asc":
                parts.append((0, value_order(value)))
            else:  # `value_order` reversed: its kinds from last to first, a number by its negation
                kind, order = value_order(value)
                parts.append((0, (-kind, -order if kind == 0 else _Desc(order))))
        return tuple(parts)

    def apply(self, unit: Sequence[SourceEvent], cause: Cause | None = None) -> Changes:
        """`cause`: the unit's cause when its first event's tag is not it (a global
        Top-N's stage 3, whose events are the entries a unit moved)."""
        prepared = []
        for index, event in enumerate(unit):
            group = self.view_key(event, index)
            fp = fingerprint(event.row)
            if not event.op.adds and group in self.groups:
                fp = live_fingerprint(event.row, fp, self.groups[group].rows)
            prepared.append((event, group, fp))
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
        n = self.n
        touched: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        moved: dict[tuple[Any, ...], int] = {}  # group -> the first rank a change of the unit moved (0-based)
        for event, group, fp in prepared:
            state = self.groups.get(group)
            if state is None:
                state = self.groups[group] = _Group()
            if group not in touched:
                touched[group] = state.top
                moved[group] = n
            if event.op.adds:
                row, tags = state.rows.setdefault(fp, (event.row, []))
                tags.append(event.tag)
                tags.sort()
                at = state.ranked.add((self._sort_key(row), event.tag, fp))
            else:
                row, tags = state.rows[fp]
                tag = tags.pop()  # the latest copy goes
                if not tags:
                    del state.rows[fp]
                at = state.ranked.remove((self._sort_key(row), tag, fp))
            if at < moved[group]:
                moved[group] = at
            self._dirty.add((group, fp))
        if cause is None:
            cause = cause_of(unit[0].tag)
        changes = Changes(cause)
        retracts = changes.retracts
        for group, old_top in touched.items():
            # the ranks before the first one a change moved hold what they held: their places stand
            start = moved[group]
            if start >= n:
                continue
            state = self.groups[group]
            old_fps, old_causes = state.fps, state.causes
            self._retop(group, state, start)
            new_top, new_fps = state.top, state.fps
            causes = state.causes = [old_causes[at] if at < len(old_causes) else None for at in range(len(new_top))]
            if not state.rows:
                del self.groups[group]
            for place in range(start + 1, max(len(old_top), len(new_top)) + 1):
                at = place - 1
                if at < len(old_fps) and at < len(new_fps) and old_fps[at] == new_fps[at]:
                    continue  # the same row at the same place: the same output row
                old = old_top[at] if at < len(old_top) else None
                new = new_top[at] if at < len(new_top) else None
                diff = diff_changes(old, new, (*group, place), self.key_names)
                if diff:
                    retracted = old_causes[at] if at < len(old_causes) else None
                    changes.extend(diff)
                    retracts.extend(None if change.op.adds else retracted for change in diff)
                    if new is not None:
                        causes[at] = cause
                    self._dirty_causes.add(group)
        if len(touched) > 1 and len(changes) > 1:
            paired = sorted(zip(changes, retracts, strict=True), key=lambda p: key_bytes(p[0].key))  # (stable)
            changes[:] = [change for change, _ in paired]
            retracts[:] = [retracted for _, retracted in paired]
        return changes

    def view_key(self, event: SourceEvent, index: int) -> tuple[Any, ...]:
        """The event's `partition_by` group; Rejected (at `index` of its unit) when it is unusable."""
        return checked_key(event.row, self.partition_by, "partition", self.order_columns, index)

    def _retop(self, group: tuple[Any, ...], state: _Group, start: int) -> None:
        """The group's output rows at places start+1..n again, from its ranking; a place
        that holds the same row as before keeps its output row."""
        old_top, old_fps = state.top, state.fps
        top, fps = old_top[:start], old_fps[:start]
        for at, (_k, _t, fp) in enumerate(state.ranked[start : self.n], start=start):
            same = at < len(old_fps) and old_fps[at] == fp
            top.append(old_top[at] if same else self._output(group, at + 1, state.rows[fp][0]))
            fps.append(fp)
        state.top, state.fps = top, fps

    def _output(self, group: tuple[Any, ...], place: int, row: dict[str, Any]) -> dict[str, Any]:
        """The output row at `place`: the group's columns, `place`, then the row's other
        columns — those of `top_n.columns` the row has, when it names them (a row column
        named `place` is not output)."""
        out: dict[str, Any] = dict(zip(self.partition_by, group, strict=True))
        out["place"] = place
        if self.columns is not None:
            for column in self.columns:
                if column not in out and column in row:
                    out[column] = row[column]
            return out
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
                records.append((row_key(kj, fp), None))
            else:
                row, tags = found
                records.append((row_key(kj, fp), state_value("LIVE_ROW", kj, len(tags), row, tags)))
        for group in self._dirty_causes:  # `[group]`: the causes of its places' view records
            state = self.groups.get(group)
            kj = key_bytes(group)
            if state is None:
                records.append((summary_key(kj), None))
            else:
                causes = [list(c) if c is not None else None for c in state.causes]
                records.append((summary_key(kj), state_value("KEY_SUMMARY", kj, len(causes), {"c": causes}, ())))
        self._dirty = set()
        self._dirty_causes = set()
        records.sort(key=lambda r: r[0])
        return records

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        """The group whose state the event reads (None: the event is refused anyway)."""
        try:
            return self.view_key(event, 0)
        except Rejected:
            return None

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """Add the groups these records hold (every row of each); groups already held
        are left as they are unless records of theirs come again."""
        restored: set[tuple[Any, ...]] = set()
        causes: dict[tuple[Any, ...], list[Cause | None]] = {}
        for record_key, value in records:
            record = decode_state(value)
            group = record["key"]
            if group not in restored:
                restored.add(group)
                state = self.groups[group] = _Group()
            else:
                state = self.groups[group]
            if record["kind"] == "KEY_SUMMARY":  # the causes of its places (absent in older state)
                causes[group] = [(c[0], c[1]) if c is not None else None for c in record["values"]["c"]]
                continue
            fp = row_fingerprint(record_key)
            row, tags = record["values"], list(record["tags"])
            state.rows[fp] = (row, tags)
            sort_key = self._sort_key(row)
            for tag in tags:
                state.ranked.add((sort_key, tag, fp))
        for group in restored:
            state = self.groups[group]
            if not state.rows:  # (only its causes came: the group is gone)
                del self.groups[group]
                continue
            state.top, state.fps = [], []
            self._retop(group, state, 0)
            known = causes.get(group, [])
            state.causes = [known[at] if at < len(known) else None for at in range(len(state.top))]

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {(*group, row["place"]): dict(row) for group, state in self.groups.items() for row in state.top}
