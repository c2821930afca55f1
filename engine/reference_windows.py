"""Windowed views in the reference (`view.window`): plain, slow, obvious Python.

The model keeps the live copies of each open window (a tumble's or hop's window of
a group; a session view: every live copy of a key, its sessions recomputed from
them after each unit) and recomputes every affected output from scratch, as
`refold.reference` does for an unwindowed view. It is written from the contract in
docs/SEMANTICS.md (Windows) alone; nothing here reuses the engine's reducers.

The rules, in the order a unit meets them:

- `view.where` first (a row it drops is not checked at all), then the unit's
  pairing and the shape of each event as for any view, then each event's time (the
  `time` column: an int of epoch milliseconds, or ISO-8601 text read by
  `datetime.fromisoformat`, UTC when it has no offset, floored to the millisecond;
  anything else is `bad event time`), then lateness against the watermark as it
  stands before the unit, then liveness (a retraction must find its row in the open
  windows). The first refused event gives the reason; the other half of a pair is
  `correction pair rejected`.
- An applied unit changes its windows' rows (records ordered by output key), then
  the watermark becomes max(watermark, the unit's largest time - lateness), then
  every open window that ends at or before it closes: its copies are forgotten; its
  last row stays the view's row (`emit: final`: it is written then, one `+A` per
  row, and never before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from refold.config import ViewSpec, WindowSpec
from refold.model.changelog import Op
from refold.model.predicate import compile_condition, parse_condition
from refold.model.reasons import Reason
from refold.reduce import SourceEvent, ViewChange
from refold.reference import (
    Copy,
    ReferenceResult,
    _kept,
    _Model,
    apply_copy,
    changes_between,
    group_outputs,
    refuse,
    take_copy,
)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MILLISECOND = timedelta(milliseconds=1)

Slot = tuple[Any, ...]  # tumble/hop: (group, start ms, end ms, written as text); session: (group,)
Rows = dict[tuple[Any, ...], dict[str, Any]]


def event_time(value: Any) -> tuple[int, bool] | None:
    """A time column's value as (epoch milliseconds, whether written as text), or None
    when it is no time: missing or null, a float, a bool, text `fromisoformat` refuses."""
    if type(value) is int:
        return value, False
    if type(value) is not str:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - EPOCH) // MILLISECOND, True  # floors: below a millisecond, and before 1970


def iso_text(millis: int) -> str | None:
    """Epoch milliseconds as `YYYY-MM-DDTHH:MM:SS[.mmm]Z` (None: outside years 1 to 9999)."""
    try:
        moment = EPOCH + millis * MILLISECOND
    except OverflowError:
        return None
    text = (f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"
            f"T{moment.hour:02d}:{moment.minute:02d}:{moment.second:02d}")
    fraction = moment.microsecond // 1000
    return text + (f".{fraction:03d}" if fraction else "") + "Z"


def bound(millis: int, text: bool) -> Any:
    """A window bound as the view writes it: epoch ms, or ISO text for rows timed in text."""
    if not text:
        return millis
    written = iso_text(millis)
    assert written is not None  # checked with the event's time
    return written


def windows(window: WindowSpec, t: int) -> list[tuple[int, int]]:
    """The (start, end) of every tumble or hop window that holds time t, earliest first:
    aligned to the epoch, start inclusive, end exclusive."""
    size, slide = window.size_ms, window.slide_ms
    start = (t // slide) * slide  # floor, negative times too
    found = []
    while start > t - size:
        found.append((start, start + size))
        start -= slide
    return sorted(found)


class Session:
    """One session of a key: a maximal run of its live copies' times less than the gap
    apart; its window is [first time, last time + gap)."""

    def __init__(self, start: int, end: int, text: bool, copies: list[Copy]) -> None:
        self.start, self.end, self.text, self.copies = start, end, text, copies


class WindowModel:
    """The live copies per open window, the rows of the closed ones, the watermark."""

    def __init__(self, spec: ViewSpec, emit: str = "per_event") -> None:
        assert spec.window is not None
        window = spec.window
        if emit not in ("per_event", "final"):
            raise ValueError(f"emit {emit!r}: a windowed view is written per_event or final")
        if emit == "final" and window.lateness_ms is None:
            raise ValueError("emit final writes a window when it closes: it needs a lateness")
        if window.kind == "session" and spec.top_n is not None:
            raise ValueError("view.window.session: a Top-N per session is not defined")
        self.spec = spec
        self.window = window
        self.emit = emit
        self.base = _Model(spec)  # the group of a row, the shape checks
        self.live: dict[Slot, list[Copy]] = {}
        self.closed: Rows = {}  # the last rows of the closed windows
        self.wm: int | None = None  # None: minus infinity (no applied event yet, or no lateness)

    # -- times and windows

    def time_of(self, row: Mapping[str, Any]) -> tuple[int, bool]:
        found = event_time(row.get(self.window.time))
        assert found is not None  # checked
        return found

    def time_problem(self, row: Mapping[str, Any]) -> bool:
        """Whether the row's time is no time (or its windows cannot be written as text)."""
        found = event_time(row.get(self.window.time))
        if found is None:
            return True
        t, text = found
        if not text:
            return False
        if self.window.kind == "session":
            gap = self.window.gap_ms
            assert gap is not None
            return iso_text(t) is None or iso_text(t + gap) is None
        return any(iso_text(s) is None or iso_text(e) is None for s, e in windows(self.window, t))

    def slots_of(self, event: SourceEvent) -> list[Slot]:
        group = self.base.group_of(event.row)
        assert group is not None
        if self.window.kind == "session":
            return [(group,)]
        t, text = self.time_of(event.row)
        return [(group, start, end, text) for start, end in windows(self.window, t)]

    def sessions(self, copies: list[Copy]) -> list[Session]:
        """A key's sessions over its live copies, each session's copies in their live order."""
        gap = self.window.gap_ms
        assert gap is not None
        times = [self.time_of(row) for row, _tag in copies]
        runs: list[list[int]] = []
        for i in sorted(range(len(copies)), key=lambda i: times[i][0]):
            if runs and times[i][0] - times[runs[-1][-1]][0] < gap:
                runs[-1].append(i)
            else:
                runs.append([i])
        found = []
        for run in runs:
            start, last = times[run[0]][0], times[run[-1]][0]
            text = any(times[i][1] for i in run if times[i][0] == start)  # a tie in time: text
            found.append(Session(start, last + gap, text, [copies[i] for i in sorted(run)]))
        return found

    # -- outputs

    def key_names(self) -> tuple[str, ...]:
        if self.spec.top_n is not None:
            return (*self.spec.top_n.partition_by, "window_start", "window_end", "place")
        if self.window.kind == "session":
            return (*self.spec.key, "window_start")
        return (*self.spec.key, "window_start", "window_end")

    def outputs(self, slot: Slot) -> Rows:
        copies = self.live.get(slot, [])
        if self.window.kind != "session":
            group, start, end, text = slot
            ws, we = bound(start, text), bound(end, text)
            return group_outputs(self.spec, group, copies, {"window_start": ws, "window_end": we}, (ws, we))
        return self.session_outputs(slot[0], self.sessions(copies))

    def session_outputs(self, group: tuple[Any, ...], sessions: Iterable[Session]) -> Rows:
        out: Rows = {}
        for session in sessions:
            ws, we = bound(session.start, session.text), bound(session.end, session.text)
            out.update(group_outputs(self.spec, group, session.copies, {"window_start": ws, "window_end": we}, (ws,)))
        return out

    def outputs_of(self, slots: Iterable[Slot]) -> Rows:
        out: Rows = {}
        for slot in slots:
            out.update(self.outputs(slot))
        return out

    def view(self) -> Rows:
        """The view the changelog folds to: the closed windows' rows, and (per_event) the open ones'."""
        if self.emit == "final":
            return dict(self.closed)
        return {**self.closed, **self.outputs_of(self.live)}

    def watermark(self) -> int | None:
        return self.wm

    # -- checking and applying

    def is_late(self, event: SourceEvent) -> bool:
        if self.wm is None:
            return False
        t, _text = self.time_of(event.row)
        if self.window.kind != "session":
            return min(end for _start, end in windows(self.window, t)) <= self.wm
        gap = self.window.gap_ms
        assert gap is not None
        if t + gap > self.wm:
            return False
        group = self.base.group_of(event.row)
        sessions = self.sessions(self.live.get((group,), []))  # the live copies are of open sessions only
        return not any(session.start <= t < session.end for session in sessions)

    def refusal(self, unit: Sequence[SourceEvent]) -> tuple[int, str] | None:
        """The refused event's index and why, or None: pairing and shape, the event
        times, lateness, then liveness in the open windows. Nothing changes."""
        problem = self.base.shape_problem(unit)
        if problem is not None:
            return problem
        for index, event in enumerate(unit):
            if self.time_problem(event.row):
                return index, Reason.BAD_TIME
        for index, event in enumerate(unit):
            if self.is_late(event):
                return index, Reason.LATE
        trial: dict[Slot, list[Copy]] = {}
        for index, event in enumerate(unit):
            for slot in self.slots_of(event):
                if slot not in trial:
                    trial[slot] = list(self.live.get(slot, []))
                if not take_copy(trial[slot], event):
                    return index, Reason.NOT_LIVE
        return None

    def slots_of_unit(self, unit: Sequence[SourceEvent]) -> list[Slot]:
        slots: list[Slot] = []
        for event in unit:
            for slot in self.slots_of(event):
                if slot not in slots:
                    slots.append(slot)
        return slots

    def apply(self, unit: Sequence[SourceEvent]) -> list[tuple[Slot, SourceEvent]]:
        """Apply a checked unit's events to their windows; return each window's
        contribution (a removal carries the removed copy's tag)."""
        applied = []
        for event in unit:
            for slot in self.slots_of(event):
                copies = self.live.setdefault(slot, [])
                applied.append((slot, apply_copy(copies, event)))
                if not copies:
                    del self.live[slot]
        return applied

    def advance(self, unit: Sequence[SourceEvent]) -> Rows:
        """Move the watermark past an applied unit and close the windows it passes:
        their copies are forgotten; return their last rows by output key."""
        lateness = self.window.lateness_ms
        if lateness is None:
            return {}
        latest = max(self.time_of(event.row)[0] for event in unit) - lateness
        self.wm = latest if self.wm is None else max(self.wm, latest)
        closing: Rows = {}
        if self.window.kind == "session":
            for (group,), copies in list(self.live.items()):
                done = [s for s in self.sessions(copies) if s.end <= self.wm]
                if not done:
                    continue
                closing.update(self.session_outputs(group, done))
                gone = {id(copy) for session in done for copy in session.copies}
                kept = [copy for copy in copies if id(copy) not in gone]
                if kept:
                    self.live[(group,)] = kept
                else:
                    del self.live[(group,)]
        else:
            for slot in [s for s in self.live if s[2] <= self.wm]:
                closing.update(self.outputs(slot))
                del self.live[slot]
        self.closed.update(closing)
        return closing

    def step(self, unit: Sequence[SourceEvent], index: int, result: ReferenceResult, positions: Sequence[int]) -> bool:
        """Apply one unit and write its records, or record why it is refused (False)."""
        refused = self.refusal(unit)
        if refused is not None:
            refuse(result, index, positions, positions[refused[0]], refused[1])
            return False
        names = self.key_names()
        slots = self.slots_of_unit(unit)
        before = self.outputs_of(slots)
        self.apply(unit)
        after = self.outputs_of(slots)
        if self.emit == "per_event":
            result.changes.extend(changes_between(before, after, names))
        closing = self.advance(unit)
        if self.emit == "final":
            for key in sorted(closing, key=lambda k: orjson.dumps(list(k))):
                result.changes.append(ViewChange(Op.APPEND, key, closing[key], names))
        return True


def delta_key_names(spec: ViewSpec) -> tuple[str, ...]:
    """The columns that key a delta row: the view key, and a window's bounds."""
    if spec.window is None:
        return tuple(spec.key)
    return (*spec.key, "window_start", "window_end")


def window_deltas(spec: ViewSpec, batches: Sequence[Sequence[Sequence[SourceEvent]]]) -> list[dict[str, Any]]:
    """Delta rows per batch of units of a tumble or hop grouped view: each batch's
    accepted contributions per output key (view key and window bounds)."""
    from refold.reference import _delta_row

    assert spec.window is not None
    if spec.window.kind == "session" or spec.top_n is not None:
        raise ValueError("delta rows are defined for tumble and hop grouped views")
    model = WindowModel(spec)
    names = delta_key_names(spec)
    condition = compile_condition(parse_condition(spec.where)) if spec.where is not None else None
    scratch = ReferenceResult()
    out: list[dict[str, Any]] = []
    for batch in batches:
        contributions: dict[tuple[Any, ...], list[tuple[int, SourceEvent]]] = {}
        for unit in batch:
            if condition is not None:
                kept = _kept(condition, unit, 0, scratch)
                if not kept:
                    continue
                unit = [event for _, event in kept]
            if model.refusal(unit) is not None:
                continue
            for (group, start, end, text), applied in model.apply(unit):
                key = (*group, bound(start, text), bound(end, text))
                contributions.setdefault(key, []).append((1 if applied.op.adds else -1, applied))
            model.advance(unit)
        for key in sorted(contributions, key=lambda k: orjson.dumps(list(k))):
            out.append(_delta_row(spec, key, contributions[key], names))
    return out
