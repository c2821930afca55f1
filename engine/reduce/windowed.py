"""Windowed views (`view.window`): grouped views and Top-Ns per event-time window,
the shard's watermark, closing windows, `late` and `bad event time` refusals
(docs/windows.md; the contract both this and `refold.reference` implement).

- **Event time** (`event_time_of`): the `time` column holds epoch milliseconds (an
  int, not a bool) or ISO-8601 text (`datetime.fromisoformat`; no offset = UTC),
  floored to the millisecond; anything else refuses the event (`bad event time`).
- **Tumble and hop** windows wrap the view's own reducer (`GroupedReducer`,
  `TopNReducer`) over rows with `window_start`/`window_end` added, keyed (a Top-N:
  grouped) by the view key and the window: an event becomes one event per window it
  falls in, and the wrapped reducer gives the records, deltas and `P.state` records
  as it does for any view. Closing a window deletes its key from the wrapped reducer
  and marks it changed: its `P.state` records become tombstones.
- **Session** windows keep each view key's live rows of its open sessions (one
  `LIVE_ROW` record per distinct row, keyed by the view key); sessions are computed
  from the rows' times, and a session's row by the unwindowed reducer over its rows.
  The key's `[key]` record keeps its sessions' records' causes (`{"c": [...]}`, by time).
- `emit: final`: a closed window's `+A` names the unit whose watermark advance closed it.
- **The watermark**: the largest event time the shard applied (a `P.state` record of
  its own, `["wm"]`), minus `lateness`; it advances after each applied unit, and every
  open window ending at or before it closes then.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.reduce.grouped import GroupedReducer
from refold.reduce.statecodec import (
    decode_state,
    row_fingerprint,
    row_key,
    state_value,
    summary_key,
)
from refold.reduce.topn import TopNReducer
from refold.reduce.types import Cause, Changes, DeltaRows, Rejected, SourceEvent, Tag, ViewChange
from refold.reduce.values import diff_changes, fingerprint, key_bytes
from refold.state.store import VIEW_RECORD_FIRST

WATERMARK_KEY = b'["wm"]'  # the `P.state` record of a windowed view's shard's largest applied event time
START, END = "window_start", "window_end"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def event_time_of(row: dict[str, Any], column: str) -> tuple[int, bool] | str:
    """The row's event time in epoch ms and whether it is written as text; or, when it
    is not a time, why (the `bad event time` detail)."""
    if column not in row:
        return f"{column!r} is missing"
    value = row[column]
    if value is None:
        return f"{column!r} is null"
    if type(value) is int:
        return value, False
    if type(value) is str:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return f"{column!r} is not ISO-8601 text"
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        since = parsed - _EPOCH
        micros = (since.days * 86_400 + since.seconds) * 1_000_000 + since.microseconds
        return micros // 1000, True
    return f"{column!r} holds a {type(value).__name__}, not epoch milliseconds or ISO-8601 text"


def time_text(ms: int) -> str:
    """Epoch ms as `YYYY-MM-DDTHH:MM:SS[.mmm]Z` (UTC; `.mmm` only when not 0). Raises
    OverflowError outside years 1-9999."""
    moment = _EPOCH + timedelta(milliseconds=ms)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if len(text) < 19:  # years before 1000: strftime may not pad them
        text = f"{moment.year:04d}" + text[text.index("-"):]
    millis = moment.microsecond // 1000
    return f"{text}.{millis:03d}Z" if millis else f"{text}Z"


def time_value(ms: int, text: bool) -> int | str:
    """A window bound in the representation of the row's time."""
    return time_text(ms) if text else ms


def whole_state(store: Any) -> Iterator[tuple[bytes, bytes]]:
    """Every view record of a shard's store (`refold.state.ShardStore`), after a windowed
    view's watermark record: what a reducer restores to hold the whole view."""
    return itertools.chain(store.items(WATERMARK_KEY), store.items(VIEW_RECORD_FIRST))


def _bound_ms(value: int | str) -> int:
    """A window bound, as `time_value` wrote it, back in epoch ms."""
    if type(value) is int:
        return value
    parsed = event_time_of({"t": value}, "t")
    assert not isinstance(parsed, str)
    return parsed[0]


class WindowedReducer:
    """A windowed view's reducer (see the module's docstring); `emit` is the view
    output's (`final`: records only as windows close)."""

    def __init__(self, spec: ViewSpec, emit: str = "per_event") -> None:
        window = spec.window
        assert window is not None
        self.kind = window.kind
        self.time = window.time
        self.size = window.size_ms
        self.slide = window.slide_ms
        self.gap = window.gap_ms or 0
        self.lateness = window.lateness_ms
        self.final = emit == "final"
        self.top_n = spec.top_n is not None
        self.max_time: int | None = None  # the largest event time applied (the watermark + lateness)
        self._max_changed = False
        self._closing: list[tuple[int, bytes, tuple[Any, ...]]] = []  # (end, key bytes, key): windows that may close
        plain = self.plain = spec.model_copy(update={"window": None, "where": None})
        # its `view_key` only: the view's own key and column checks
        self.checks: Any = TopNReducer(plain) if spec.top_n is not None else GroupedReducer(plain)
        self._open: set[tuple[Any, ...]] = set()  # the window keys `_closing` holds
        if self.kind == "session":
            self.key_columns = tuple(spec.key)
            self.sessions: dict[tuple[Any, ...], _KeySessions] = {}
            self._dirty: set[tuple[tuple[Any, ...], bytes]] = set()
            self._dirty_causes: set[tuple[Any, ...]] = set()  # keys whose sessions' causes to write
            self.inner: Any = None
        elif spec.top_n is not None:
            top_n = spec.top_n.model_copy(update={"partition_by": [*spec.top_n.partition_by, START, END]})
            self.inner = TopNReducer(plain.model_copy(update={"top_n": top_n}))
        else:
            self.inner = GroupedReducer(plain.model_copy(update={"key": [*spec.key, START, END]}))

    # the watermark ---------------------------------------------------------------------

    @property
    def watermark(self) -> int | None:
        """The shard's watermark in epoch ms (None: -infinity, or no lateness)."""
        if self.lateness is None or self.max_time is None:
            return None
        return self.max_time - self.lateness

    def _times(self, unit: Sequence[SourceEvent]) -> list[tuple[int, bool]]:
        times = []
        for index, event in enumerate(unit):
            found = event_time_of(event.row, self.time)
            if isinstance(found, str):
                raise Rejected(Reason.BAD_TIME, index, found)
            times.append(found)
        return times

    def _late(self, index: int, start: int, end: int, text: bool) -> Rejected:
        wm = self.watermark
        assert wm is not None
        shown = [str(time_value(v, text)) for v in (start, end, wm)]
        return Rejected(Reason.LATE, index, f"window [{shown[0]}, {shown[1]}) closed: watermark {shown[2]}",
                        headers=(("refold.window_start", shown[0]), ("refold.window_end", shown[1]),
                                 ("refold.watermark", shown[2])))

    def _advance(self, times: Sequence[tuple[int, bool]]) -> list[ViewChange]:
        """After an applied unit: the watermark moves on, windows ending at or before it
        close (their records, with `emit: final`)."""
        latest = max(t for t, _ in times)
        if self.max_time is None or latest > self.max_time:
            self.max_time = latest
            self._max_changed = True
        wm = self.watermark
        if wm is None:
            return []
        closed: list[ViewChange] = []
        closing = self._closing
        while closing and closing[0][0] <= wm:
            _end, _kb, key = heapq.heappop(closing)
            self._open.discard(key)
            closed.extend(self._close(key, wm))
        if len(closed) > 1:
            order = {id(c): i for i, c in enumerate(closed)}
            closed.sort(key=lambda c: (key_bytes(c.key), order[id(c)]))
        return closed if self.final else []

    def _close(self, key: tuple[Any, ...], wm: int) -> list[ViewChange]:
        """Close what of `key` ends at or before `wm` (a window key; a session view's view
        key): forget it, tombstone its state; its rows as they stand (`emit: final`)."""
        if self.kind == "session":
            return self._close_sessions(key, wm)
        if self.top_n:
            group = self.inner.groups.pop(key, None)
            if group is None:
                return []
            self.inner._dirty.update((key, fp) for fp in group.rows)
            self.inner._dirty_causes.add(key)  # its `[group]` record goes too
            names = self.inner.key_names
            return [ViewChange(Op.APPEND, (*key, row["place"]), row, names) for row in group.top]
        state = self.inner.keys.pop(key, None)
        if state is None:
            return []
        self.inner._dirty_keys.add(key)
        self.inner._dirty_rows.update((key, fp) for fp in state.rows)
        return [ViewChange(Op.APPEND, key, state.view, self.inner.key_columns)] if state.view is not None else []

    # apply -------------------------------------------------------------------------------

    def apply(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        if self.kind == "session":
            return self._apply_sessions(unit)
        for index, event in enumerate(unit):
            self.checks.view_key(event, index)  # the view's own checks come first
        times = self._times(unit)
        wm = self.watermark
        expanded: list[SourceEvent] = []
        origin: list[int] = []
        for index, (event, (t, text)) in enumerate(zip(unit, times, strict=True)):
            first = (t - self.size) // self.slide * self.slide + self.slide  # the earliest window holding t
            if wm is not None and first + self.size <= wm:
                raise self._late(index, first, first + self.size, text)
            try:
                for start in range(first, t + 1, self.slide):
                    row = {**event.row, START: time_value(start, text), END: time_value(start + self.size, text)}
                    expanded.append(event._replace(row=row))
                    origin.append(index)
            except OverflowError:
                raise Rejected(Reason.BAD_TIME, index, "its window falls outside years 1-9999") from None
        known = self.inner.groups if self.top_n else self.inner.keys
        try:
            changes = self.inner.apply(expanded)
        except Rejected as rejected:
            raise Rejected(rejected.reason, origin[rejected.index], rejected.detail) from None
        if self.lateness is not None:
            for event in expanded:
                key = self.inner.view_key(event, 0)
                if key in known and key not in self._open:
                    self._open.add(key)
                    heapq.heappush(self._closing, (_bound_ms(key[-1]), key_bytes(key), key))
        closed = self._advance(times)
        return _final(unit, closed) if self.final else changes

    # sessions -----------------------------------------------------------------------------

    def _apply_sessions(self, unit: Sequence[SourceEvent]) -> list[ViewChange]:
        keys = [self.checks.view_key(event, index) for index, event in enumerate(unit)]
        times = self._times(unit)
        wm = self.watermark
        fps = [fingerprint(event.row) for event in unit]
        for index, (key, (t, text)) in enumerate(zip(keys, times, strict=True)):
            if wm is not None and t + self.gap <= wm:
                sessions = self.sessions.get(key)
                if sessions is None or not sessions.holds(t):
                    raise self._late(index, t, t + self.gap, text)
        pending: dict[tuple[tuple[Any, ...], bytes], int] = {}
        for index, (event, key, fp) in enumerate(zip(unit, keys, fps, strict=True)):
            have = pending.get((key, fp))
            if have is None:
                sessions = self.sessions.get(key)
                have = len(sessions.rows[fp][1]) if sessions is not None and fp in sessions.rows else 0
            have += 1 if event.op.adds else -1
            if have < 0:
                raise Rejected(Reason.NOT_LIVE, index)
            pending[(key, fp)] = have
        before: dict[tuple[Any, ...], tuple[dict[tuple[Any, ...], dict[str, Any]], dict[tuple[Any, ...], Cause | None]]] = {}
        for event, key, fp, (t, text) in zip(unit, keys, fps, times, strict=True):
            sessions = self.sessions.get(key)
            if sessions is None:
                sessions = self.sessions[key] = _KeySessions()
            if key not in before:
                before[key] = (dict(sessions.out), sessions.causes)
            if event.op.adds:
                entry = sessions.rows.setdefault(fp, (event.row, [], t, text))
                entry[1].append(event.tag)
                entry[1].sort()
            else:
                tags = sessions.rows[fp][1]
                tags.pop()  # the latest copy goes
                if not tags:
                    del sessions.rows[fp]
            self._dirty.add((key, fp))
        cause = unit[0].tag[1], unit[0].tag[2]  # the unit's cause
        changes = Changes(cause)
        for key, (old, old_causes) in before.items():
            new = self._resession(key)
            diff = self._diff(old, new)
            written = {change.key for change in diff if change.op.adds}
            sessions = self.sessions.get(key)
            if sessions is not None:  # a session whose record changed now names this unit
                sessions.causes = {out_key: cause if out_key in written else old_causes.get(out_key) for out_key in new}
            self._dirty_causes.add(key)
            changes.extend(diff)
            changes.retracts.extend(None if change.op.adds else old_causes.get(change.key) for change in diff)
        if len(before) > 1:  # (one record per key and op kind; -C before +C kept: the sort is stable)
            paired = sorted(zip(changes, changes.retracts, strict=True), key=lambda p: key_bytes(p[0].key))
            changes[:] = [change for change, _ in paired]
            changes.retracts[:] = [retracted for _, retracted in paired]
        closed = self._advance(times)
        return _final(unit, closed) if self.final else changes

    def _diff(self, old: dict[tuple[Any, ...], dict[str, Any]], new: dict[tuple[Any, ...], dict[str, Any]]
              ) -> list[ViewChange]:
        names = (*self.key_columns, START)
        changes: list[ViewChange] = []
        for out_key in sorted(old.keys() | new.keys(), key=key_bytes):
            changes.extend(diff_changes(old.get(out_key), new.get(out_key), out_key, names))
        return changes

    def _resession(self, key: tuple[Any, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The key's sessions and their rows again, from its live rows; returns them by output key."""
        sessions = self.sessions[key]
        if not sessions.rows:
            del self.sessions[key]
            return {}
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        known, sessions.values = sessions.values, {}
        for members in sessions.split(self.gap):
            start, numeric = min((member[2], not member[3]) for _fp, member in members)
            text = not numeric  # (a tie in time: text)
            end = max(member[2] for _fp, member in members) + self.gap
            try:
                bounds = (time_value(start, text), time_value(end, text))
            except OverflowError:  # (an ISO time within a gap of year 9999's end: shown in ms)
                bounds = (start, end)
            out_key = (*key, bounds[0])
            row: dict[str, Any] = dict(zip(self.key_columns, key, strict=True))
            row[START], row[END] = bounds
            # a session whose rows did not change keeps its values (only those that did are reduced again)
            signature = tuple((fp, tuple(member[1])) for fp, member in members)
            values = known.get(signature)
            if values is None:
                values = self._values(key, members)
            row.update(sessions.values.setdefault(signature, values))
            out[out_key] = row
            if self.lateness is not None:
                heapq.heappush(self._closing, (end, key_bytes(key), key))
        sessions.out = out
        return out

    def _values(self, key: tuple[Any, ...], members: Sequence[tuple[bytes, _Member]]) -> dict[str, Any]:
        """A session's value columns: the unwindowed view over its live rows."""
        reducer = GroupedReducer(self.plain)
        for _fp, (row, tags, _t, _text) in members:
            for tag in tags:
                reducer.apply([SourceEvent(Op.APPEND, row, tag)])
        view = reducer.keys[key].view
        assert view is not None
        return {name: view[name] for name in self.plain.columns}

    def _close_sessions(self, key: tuple[Any, ...], wm: int) -> list[ViewChange]:
        sessions = self.sessions.get(key)
        if sessions is None:
            return []
        ended = False
        for members in sessions.split(self.gap):
            if max(member[2] for _fp, member in members) + self.gap > wm:
                continue
            ended = True
            for fp, _member in members:
                del sessions.rows[fp]
                self._dirty.add((key, fp))
        if not ended:
            return []
        old = sessions.out
        new = self._resession(key)
        self._dirty_causes.add(key)
        if key in self.sessions:
            sessions.causes = {out_key: sessions.causes.get(out_key) for out_key in new}
        names = (*self.key_columns, START)
        return [ViewChange(Op.APPEND, out_key, row, names) for out_key, row in old.items() if out_key not in new]

    # batch boundaries --------------------------------------------------------------------

    def take_deltas(self) -> DeltaRows:
        """The inner grouped view's delta rows, with their causes (a session view has none)."""
        return DeltaRows() if self.inner is None else self.inner.take_deltas()

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        if self.inner is not None:
            records = list(self.inner.take_state_changes())
        else:
            for key, fp in self._dirty:
                kj = key_bytes(key)
                sessions = self.sessions.get(key)
                entry = sessions.rows.get(fp) if sessions is not None else None
                if entry is None:
                    records.append((row_key(kj, fp), None))
                else:
                    row, tags, _t, _text = entry
                    records.append((row_key(kj, fp), state_value("LIVE_ROW", kj, len(tags), row, tags)))
            for key in self._dirty_causes:  # `[key]`: the causes of its sessions' records, in time order
                kj = key_bytes(key)
                sessions = self.sessions.get(key)
                if sessions is None:
                    records.append((summary_key(kj), None))
                    continue
                causes = [list(c) if c is not None else None for c in map(sessions.causes.get, sessions.out)]
                records.append((summary_key(kj), state_value("KEY_SUMMARY", kj, len(causes), {"c": causes}, ())))
            self._dirty = set()
            self._dirty_causes = set()
        if self._max_changed and self.max_time is not None:
            records.append((WATERMARK_KEY, state_value("KEY_SUMMARY", WATERMARK_KEY, self.max_time, None, ())))
            self._max_changed = False
        records.sort(key=lambda r: r[0])
        return records

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        """The shard holds a windowed view's whole state (`refold.runtime.shard`): any event's
        state is held; its view key, or None when the view's checks refuse it."""
        try:
            return self.checks.view_key(event, 0)
        except Rejected:
            return None

    def restore(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        """The shard's whole windowed state: the watermark's record and every view record."""
        rest: list[tuple[bytes, bytes]] = []
        for record_key, value in records:
            if record_key == WATERMARK_KEY:
                self.max_time = decode_state(value)["count"]
            else:
                rest.append((record_key, value))
        if self.inner is not None:
            self.inner.restore(rest)
            if self.lateness is not None:
                for key in (self.inner.groups if self.top_n else self.inner.keys):
                    self._open.add(key)
                    heapq.heappush(self._closing, (_bound_ms(key[-1]), key_bytes(key), key))
            return
        touched: set[tuple[Any, ...]] = set()
        known: dict[tuple[Any, ...], list[Any]] = {}  # the causes of each key's sessions (absent in older state)
        for record_key, value in rest:
            record = decode_state(value)
            if record["kind"] == "KEY_SUMMARY":
                known[record["key"]] = record["values"]["c"]
            if record["kind"] != "LIVE_ROW":
                continue
            key, row, tags = record["key"], record["values"], list(record["tags"])
            found = event_time_of(row, self.time)
            assert not isinstance(found, str), "a session row's time was checked when it was applied"
            sessions = self.sessions.setdefault(key, _KeySessions())
            sessions.rows[row_fingerprint(record_key)] = (row, tags, *found)
            touched.add(key)
        for key in touched:
            out = self._resession(key)
            causes = known.get(key, [])
            self.sessions[key].causes = {out_key: (c[0], c[1]) if c is not None else None
                                         for out_key, c in zip(out, causes, strict=False)}

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        if self.inner is not None:
            return self.inner.view()
        return {out_key: dict(row) for sessions in self.sessions.values() for out_key, row in sessions.out.items()}


def _final(unit: Sequence[SourceEvent], closed: list[ViewChange]) -> Changes:
    """`emit: final`: the windows a unit's watermark advance closed, named by its cause."""
    changes = Changes((unit[0].tag[1], unit[0].tag[2]))
    changes.extend(closed)
    changes.retracts.extend([None] * len(closed))
    return changes


_Member = tuple[dict[str, Any], list[Tag], int, bool]  # a distinct live row, its copies' tags, its time, text or not


class _KeySessions:
    """One view key's live rows in open sessions, and its sessions' current rows."""

    __slots__ = ("causes", "out", "rows", "values")

    def __init__(self) -> None:
        self.rows: dict[bytes, _Member] = {}
        self.out: dict[tuple[Any, ...], dict[str, Any]] = {}  # output key -> row
        self.causes: dict[tuple[Any, ...], Cause | None] = {}  # output key -> the cause of its record (None: unknown)
        self.values: dict[tuple[Any, ...], dict[str, Any]] = {}  # each session's rows and copies -> its values

    def split(self, gap: int) -> list[list[tuple[bytes, _Member]]]:
        """The live rows (fingerprint, member) in sessions: maximal runs of times less
        than `gap` apart, earliest first."""
        members = sorted(self.rows.items(), key=lambda item: item[1][2])
        runs: list[list[tuple[bytes, _Member]]] = []
        last: int | None = None
        for item in members:
            if last is None or item[1][2] - last >= gap:
                runs.append([])
            runs[-1].append(item)
            last = item[1][2]
        return runs

    def holds(self, t: int) -> bool:
        """Whether `t` is inside [start, end) of one of the key's open sessions."""
        return any(_bound_ms(row[START]) <= t < _bound_ms(row[END]) for row in self.out.values())


__all__ = ["END", "START", "WATERMARK_KEY", "WindowedReducer", "event_time_of", "summary_key", "time_text"]
