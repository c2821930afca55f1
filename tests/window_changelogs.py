"""Random windowed changelogs for differential tests of windowed views (the engine
against `refold.reference`, the reference against SQL).

Rows are `{"k": key, "ts": event time, "v": value}` over a few keys. Event times come
from a clock that moves forward unevenly; most events are near it, some are late by up
to four windows (10 ms windows here, so 40 ms), so with a lateness some are dead
letters and without one they correct windows long written. Units append fresh rows and
copies of live rows, retract live rows (late ones too), correct them (a new value, a
new time: the row may move to another window or session), and now and then retract a
row that is not live. Times are epoch-ms ints or the same instants as ISO text in the
forms `datetime.fromisoformat` reads (`Z`, an offset, none, a fraction below the
millisecond). `invalid=True` adds bad times (null, missing, float, not a time), null
keys and pairs cut in two.

    from window_changelogs import batched, window_changelogs, windowed_views

    @given(data=st.data())
    def test_x(data):
        spec, emit = data.draw(windowed_views())
        units = data.draw(window_changelogs())
        batches = data.draw(batched(units))   # random batch cuts
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

from hypothesis import strategies as st

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.reduce import SourceEvent

Unit = list[SourceEvent]

KEYS = ("a", "b", "c")
SIZE_MS = 10  # every window kind below: 10 ms long (a session: a 10 ms gap)
WINDOWS: dict[str, dict[str, Any]] = {
    "tumble": {"tumble": "10ms"},
    "hop": {"hop": {"size": "10ms", "slide": "5ms"}},
    "hop-uneven": {"hop": {"size": "10ms", "slide": "4ms"}},  # 2 or 3 windows per time
    "session": {"session": {"gap": "10ms"}},
}
LATENESS = (None, "0ms", "5ms", "20ms")
# every aggregation, as in tests/test_views.py's GROUPED
GROUPED_COLUMNS: dict[str, Any] = {
    "total": {"sum": "v"}, "n": {"count": "*"}, "nv": {"count": "v"}, "mean": {"avg": "v"},
    "low": {"min": "v"}, "high": {"max": "v"}, "first_v": {"first": "v"}, "last_v": {"last": "v"},
    "lww": {"last_write_wins": "v"}, "values": {"set": "v"},
}
SQL_COLUMNS: dict[str, Any] = {"total": {"sum": "v"}, "n": {"count": "*"}, "nv": {"count": "v"},
                               "low": {"min": "v"}, "high": {"max": "v"}}

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
INTS = st.one_of(st.none(), st.integers(-5, 5))
NUMBERS = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([0.1, 0.2, 2.5, -1.25]))


def window_view(kind: str, lateness: str | None = None, top_n: int | None = None,
                columns: dict[str, Any] | None = None) -> ViewSpec:
    """A windowed view over `ts` of `k`: grouped (`columns`, default every aggregation)
    or, with `top_n`, the top rows by `v` (desc) per `k` and window."""
    window: dict[str, Any] = {"time": "ts", **WINDOWS[kind]}
    if lateness is not None:
        window["lateness"] = lateness
    if top_n is not None:
        return ViewSpec.model_validate(
            {"top_n": {"n": top_n, "order_by": {"v": "desc"}, "partition_by": ["k"]}, "window": window})
    return ViewSpec.model_validate({"key": ["k"], "columns": columns or GROUPED_COLUMNS, "window": window})


@st.composite
def windowed_views(draw: st.DrawFn, kinds: Sequence[str] = tuple(WINDOWS), top_n: bool = True,
                   final: bool = True) -> tuple[ViewSpec, str]:
    """A windowed view and its emit mode: every kind, grouped or (not sessions) Top-N,
    with or without a lateness; `final` only with a lateness."""
    kind = draw(st.sampled_from(list(kinds)))
    lateness = draw(st.sampled_from(LATENESS))
    n = draw(st.sampled_from([None, 1, 2])) if top_n and kind != "session" else None
    emit = "final" if final and lateness is not None and draw(st.booleans()) else "per_event"
    return window_view(kind, lateness, n), emit


def as_text(draw: st.DrawFn, millis: int) -> str:
    """The instant `millis` as ISO-8601 text, in one of the forms Python 3.11 reads."""
    moment = EPOCH + timedelta(milliseconds=millis)
    form = draw(st.integers(0, 4))
    if form == 0:
        return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{moment.microsecond // 1000:03d}Z"
    if form == 1:
        return moment.isoformat(timespec="milliseconds")  # +00:00
    if form == 2:
        return moment.replace(tzinfo=None).isoformat(timespec="milliseconds")  # no offset: UTC
    if form == 3:
        zone = timezone(timedelta(hours=draw(st.integers(-12, 14)), minutes=draw(st.sampled_from([0, 30]))))
        return moment.astimezone(zone).isoformat(timespec="milliseconds")
    extra = draw(st.integers(0, 999))  # below the millisecond: floored away
    return (moment + timedelta(microseconds=extra)).isoformat(timespec="microseconds")


@st.composite
def window_changelogs(draw: st.DrawFn, keys: Sequence[str] = KEYS, values: st.SearchStrategy[Any] = NUMBERS,
                      text: bool = True, invalid: bool = False, max_units: int = 60) -> list[Unit]:
    """Random units over `keys` (see the module docstring). `text`: some times as ISO
    text; `invalid`: bad times, null keys and cut pairs too."""
    live: list[dict[str, Any]] = []
    gone: list[dict[str, Any]] = []  # rows retracted once: retracting again is not live
    units: list[Unit] = []
    clock = draw(st.integers(-30, 30))  # negative times too
    text_odds = draw(st.sampled_from([0, 0, 3, 10])) if text else 0  # of 10: how many times are text

    def when() -> Any:
        if draw(st.integers(0, 9)) < 7:
            millis = clock - draw(st.integers(0, 3))  # about now
        else:
            millis = clock - draw(st.integers(0, 4 * SIZE_MS))  # late, maybe beyond the horizon
        if invalid and draw(st.integers(0, 24)) == 0:
            return draw(st.sampled_from([None, 5.0, "yesterday", True, "", [1]]))
        if draw(st.integers(0, 9)) < text_odds:
            return as_text(draw, millis)
        return millis

    def fresh() -> dict[str, Any]:
        key = draw(st.sampled_from(list(keys)))
        if invalid and draw(st.integers(0, 29)) == 0:
            key = None
        row = {"k": key, "ts": when(), "v": draw(values)}
        if invalid and draw(st.integers(0, 29)) == 0:
            del row["ts"]
        return row

    def tag() -> tuple[int, int, int]:
        return (clock - draw(st.integers(0, 1)), draw(st.integers(0, 2)), len(units))

    def take_live() -> dict[str, Any]:
        return live.pop(draw(st.integers(0, len(live) - 1)))

    for _ in range(draw(st.integers(1, max_units))):
        clock += draw(st.integers(0, 4))
        choice = draw(st.integers(0, 19))
        if choice < 9 or not live:
            row = fresh()
            if live and draw(st.integers(0, 7)) == 0:
                row = dict(live[draw(st.integers(0, len(live) - 1))])  # another copy of a live row
            live.append(row)
            units.append([SourceEvent(Op.APPEND, row, tag())])
        elif choice < 13:
            row = take_live()
            gone.append(row)
            units.append([SourceEvent(Op.RETRACT, row, tag())])
        elif choice < 18:
            old = take_live()
            new = dict(old)
            change = draw(st.integers(0, 2))
            if change != 1:
                new["v"] = draw(values)
            if change != 0:  # a new time: maybe another window or session
                new["ts"] = when() if draw(st.booleans()) else _shifted(old.get("ts"), draw(st.integers(-12, 12)))
            if draw(st.integers(0, 5)) == 0:
                new["k"] = draw(st.sampled_from(list(keys)))  # another key
            live.append(new)
            gone.append(old)
            at = tag()
            pair = [SourceEvent(Op.CORRECT_FROM, old, at), SourceEvent(Op.CORRECT_TO, new, at)]
            if invalid and draw(st.integers(0, 9)) == 0:
                units.extend([[pair[0]], [pair[1]]])  # cut in two: an unpaired -C, an orphan +C
            else:
                units.append(pair)
        else:  # most likely not live: a fresh row, or one retracted before
            row = gone[draw(st.integers(0, len(gone) - 1))] if gone and draw(st.booleans()) else fresh()
            units.append([SourceEvent(Op.RETRACT, row, tag())])
    return units


def _shifted(value: Any, by: int) -> Any:
    """An int time moved by `by` ms (other times as they are)."""
    return value + by if type(value) is int else value


@st.composite
def batched(draw: st.DrawFn, units: Sequence[Unit]) -> list[list[Unit]]:
    """The units cut at random into consecutive batches (none empty but a lone one)."""
    if not units:
        return [[]]
    cuts = sorted(draw(st.sets(st.integers(1, len(units) - 1), max_size=len(units))) if len(units) > 1 else [])
    bounds = [0, *cuts, len(units)]
    return [list(units[a:b]) for a, b in pairwise(bounds)]
