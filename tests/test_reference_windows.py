"""The windowed reference (`refold.reference_windows`) on hand-computed examples: one
test per rule of the window contract (docs/SEMANTICS.md, Windows). Every expected
record is written out by hand; no server."""

from __future__ import annotations

from typing import Any

import pytest

from refold.config import ViewSpec
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.reduce import SourceEvent
from refold.reference import (
    ReferenceResult,
    fold_changelog,
    fold_deltas,
    reference_changelog,
    reference_deltas,
    reference_table,
)
from refold.reference_windows import WindowModel, event_time, iso_text, windows

SUM_COUNT = {"s": {"sum": "v"}, "n": {"count": "*"}}
LATE, BAD, PAIR = Reason.LATE, Reason.BAD_TIME, Reason.CORRECTION_PAIR_REJECTED


def view(window: dict[str, Any], columns: dict[str, Any] | None = None, **extra: Any) -> ViewSpec:
    return ViewSpec.model_validate({"key": ["k"], "columns": columns or SUM_COUNT, "window": window, **extra})


def top(window: dict[str, Any], n: int = 2) -> ViewSpec:
    return ViewSpec.model_validate(
        {"top_n": {"n": n, "order_by": {"v": "desc"}, "partition_by": ["g"]}, "window": window})


def A(tag: int, **row: Any) -> list[SourceEvent]:
    return [SourceEvent(Op.APPEND, row, (tag, 0, tag))]


def R(tag: int, **row: Any) -> list[SourceEvent]:
    return [SourceEvent(Op.RETRACT, row, (tag, 0, tag))]


def C(tag: int, old: dict[str, Any], new: dict[str, Any]) -> list[SourceEvent]:
    return [SourceEvent(Op.CORRECT_FROM, old, (tag, 0, tag)), SourceEvent(Op.CORRECT_TO, new, (tag, 0, tag))]


def records(result: ReferenceResult, start: int = 0) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    return [(c.op.code, c.key, dict(c.row)) for c in result.changes[start:]]


def run(spec: ViewSpec, units: list[list[SourceEvent]], emit: str = "per_event") -> ReferenceResult:
    result = reference_changelog(spec, units, emit)
    assert fold_changelog(result.changes) == result.view  # the view is what its changelog folds to
    return result


def row(k: str, ws: Any, we: Any, s: int, n: int) -> dict[str, Any]:
    return {"k": k, "window_start": ws, "window_end": we, "s": s, "n": n}


# -- event time and the windows of a time


def test_event_time_reads_ints_and_iso_text_and_refuses_the_rest() -> None:
    assert event_time(5) == (5, False)
    assert event_time(-5) == (-5, False)
    assert event_time("2024-01-01T00:00:00Z") == (1_704_067_200_000, True)
    assert event_time("2024-01-01T01:00:00+01:00") == (1_704_067_200_000, True)  # an offset
    assert event_time("2024-01-01T00:00:00") == (1_704_067_200_000, True)  # none: UTC
    assert event_time("2024-01-01") == (1_704_067_200_000, True)
    assert event_time("2024-01-01T00:00:00.0019Z") == (1_704_067_200_001, True)  # floored to the ms
    assert event_time("1969-12-31T23:59:59.9995Z") == (-1, True)  # floored: toward minus infinity
    assert event_time("1969-12-31T23:59:59Z") == (-1000, True)
    for bad in (None, True, False, 5.0, 1.5, "yesterday", "", "2024-13-01", [5], {"t": 5}):
        assert event_time(bad) is None, bad


def test_window_bounds_as_text() -> None:
    assert iso_text(0) == "1970-01-01T00:00:00Z"
    assert iso_text(1_500) == "1970-01-01T00:00:01.500Z"  # .mmm only when not 0
    assert iso_text(1_704_067_200_007) == "2024-01-01T00:00:00.007Z"
    assert iso_text(-1) == "1969-12-31T23:59:59.999Z"
    assert iso_text(10**18) is None  # past year 9999


def test_tumble_windows_are_aligned_to_the_epoch_negative_times_too() -> None:
    window = view({"time": "ts", "tumble": "10ms"}).window
    assert window is not None
    assert windows(window, 0) == [(0, 10)]
    assert windows(window, 9) == [(0, 10)]
    assert windows(window, 10) == [(10, 20)]  # end exclusive
    assert windows(window, -1) == [(-10, 0)]
    assert windows(window, -10) == [(-10, 0)]
    assert windows(window, -11) == [(-20, -10)]


def test_hop_windows_every_start_a_multiple_of_the_slide() -> None:
    window = view({"time": "ts", "hop": {"size": "10ms", "slide": "5ms"}}).window
    assert window is not None
    assert windows(window, 7) == [(0, 10), (5, 15)]
    assert windows(window, 5) == [(0, 10), (5, 15)]
    assert windows(window, 4) == [(-5, 5), (0, 10)]
    assert windows(window, -1) == [(-10, 0), (-5, 5)]
    uneven = view({"time": "ts", "hop": {"size": "10ms", "slide": "4ms"}}).window  # 4 does not divide 10
    assert uneven is not None
    assert windows(uneven, 9) == [(0, 10), (4, 14), (8, 18)]
    assert windows(uneven, 1) == [(-8, 2), (-4, 6), (0, 10)]
    assert windows(uneven, 2) == [(-4, 6), (0, 10)]
    assert windows(uneven, -9) == [(-16, -6), (-12, -2)]


def test_tumble_with_iso_text_and_offsets_and_ints_apart() -> None:
    spec = view({"time": "ts", "tumble": "1h"})
    result = run(spec, [
        A(1, k="a", ts="2024-01-01T00:59:59.999+00:00", v=1),
        A(2, k="a", ts="2024-01-01T01:30:00+01:00", v=2),  # 00:30 UTC: the same hour
        A(3, k="a", ts=1_704_067_200_000 + 5, v=4),  # the same hour as an int: another window
        A(4, k="a", ts=-1, v=8),  # the hour before the epoch
    ])
    h0, h1 = "2024-01-01T00:00:00Z", "2024-01-01T01:00:00Z"
    e0, e1 = 1_704_067_200_000, 1_704_070_800_000
    assert records(result) == [
        ("+A", ("a", h0, h1), row("a", h0, h1, 1, 1)),
        ("-C", ("a", h0, h1), row("a", h0, h1, 1, 1)),
        ("+C", ("a", h0, h1), row("a", h0, h1, 3, 2)),
        ("+A", ("a", e0, e1), row("a", e0, e1, 4, 1)),
        ("+A", ("a", -3_600_000, 0), row("a", -3_600_000, 0, 8, 1)),
    ]
    assert list(result.changes[0].row) == ["k", "window_start", "window_end", "s", "n"]
    assert result.changes[0].key_names == ("k", "window_start", "window_end")


def test_text_bounds_with_milliseconds() -> None:
    spec = view({"time": "ts", "tumble": "1500ms"})
    result = run(spec, [A(1, k="a", ts="1970-01-01T00:00:02Z", v=1)])  # 2000 ms: [1500, 3000)
    ws, we = "1970-01-01T00:00:01.500Z", "1970-01-01T00:00:03Z"
    assert records(result) == [("+A", ("a", ws, we), row("a", ws, we, 1, 1))]


def test_hop_one_event_in_every_window_that_holds_it() -> None:
    spec = view({"time": "ts", "hop": {"size": "10ms", "slide": "5ms"}})
    result = run(spec, [A(1, k="a", ts=7, v=1), A(2, k="a", ts=3, v=2)])
    assert records(result) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("+A", ("a", 5, 15), row("a", 5, 15, 1, 1)),
        ("+A", ("a", -5, 5), row("a", -5, 5, 2, 1)),  # ["a",-5,5] sorts first as JSON bytes
        ("-C", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("+C", ("a", 0, 10), row("a", 0, 10, 3, 2)),
    ]


# -- late data corrects


def test_a_late_append_corrects_its_emitted_window() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "10ms"})
    result = run(spec, [A(1, k="a", ts=3, v=1), A(2, k="a", ts=15, v=2), A(3, k="a", ts=4, v=5)])
    assert records(result) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("+A", ("a", 10, 20), row("a", 10, 20, 2, 1)),
        ("-C", ("a", 0, 10), row("a", 0, 10, 1, 1)),  # out of order, within the horizon: corrected
        ("+C", ("a", 0, 10), row("a", 0, 10, 6, 2)),
    ]
    assert result.rejected == [] and result.watermark == 5


def test_a_late_correction_moves_a_row_between_windows() -> None:
    spec = view({"time": "ts", "tumble": "10ms"})
    units = [A(1, k="a", ts=3, v=1), A(2, k="a", ts=4, v=5), A(3, k="a", ts=15, v=2)]
    result = run(spec, [*units, C(4, {"k": "a", "ts": 3, "v": 1}, {"k": "a", "ts": 15, "v": 1})])
    assert records(result, 4) == [
        ("-C", ("a", 0, 10), row("a", 0, 10, 6, 2)),
        ("+C", ("a", 0, 10), row("a", 0, 10, 5, 1)),
        ("-C", ("a", 10, 20), row("a", 10, 20, 2, 1)),
        ("+C", ("a", 10, 20), row("a", 10, 20, 3, 2)),
    ]
    # the old window empties: -R there, +A in a new one; records ordered by output key
    result = run(spec, [A(1, k="a", ts=13, v=1), C(2, {"k": "a", "ts": 13, "v": 1}, {"k": "a", "ts": 3, "v": 1})])
    assert records(result, 1) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("-R", ("a", 10, 20), row("a", 10, 20, 1, 1)),
    ]


def test_a_late_retraction_corrects_and_then_empties_its_window() -> None:
    spec = view({"time": "ts", "tumble": "10ms"})
    result = run(spec, [A(1, k="a", ts=3, v=1), A(2, k="a", ts=4, v=2), A(3, k="a", ts=40, v=9),
                        R(4, k="a", ts=3, v=1), R(5, k="a", ts=4, v=2)])
    assert records(result, 4) == [
        ("-C", ("a", 0, 10), row("a", 0, 10, 3, 2)),
        ("+C", ("a", 0, 10), row("a", 0, 10, 2, 1)),
        ("-R", ("a", 0, 10), row("a", 0, 10, 2, 1)),
    ]
    assert result.view == {("a", 40, 50): row("a", 40, 50, 9, 1)}


# -- sessions


def srow(k: str, ws: Any, we: Any, s: int) -> dict[str, Any]:
    return {"k": k, "window_start": ws, "window_end": we, "s": s}


SESSION = {"time": "ts", "session": {"gap": "10ms"}}


def test_session_rows_and_keys() -> None:
    result = run(view(SESSION, {"s": {"sum": "v"}}), [A(1, k="a", ts=0, v=1), A(2, k="a", ts=10, v=2)])
    # 10 apart is not less than the gap: two sessions; the key is k and window_start
    assert records(result) == [("+A", ("a", 0), srow("a", 0, 10, 1)), ("+A", ("a", 10), srow("a", 10, 20, 2))]
    assert result.changes[0].key_names == ("k", "window_start")
    assert list(result.changes[0].row) == ["k", "window_start", "window_end", "s"]


def test_session_extend_corrects_the_end() -> None:
    result = run(view(SESSION, {"s": {"sum": "v"}}), [A(1, k="a", ts=0, v=1), A(2, k="a", ts=9, v=2)])
    assert records(result, 1) == [("-C", ("a", 0), srow("a", 0, 10, 1)), ("+C", ("a", 0), srow("a", 0, 19, 3))]


def test_session_merge_retracts_the_later_and_corrects_the_earlier() -> None:
    spec = view(SESSION, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=0, v=1), A(2, k="a", ts=15, v=2), A(3, k="a", ts=8, v=4)])
    assert records(result) == [
        ("+A", ("a", 0), srow("a", 0, 10, 1)),
        ("+A", ("a", 15), srow("a", 15, 25, 2)),
        ("-C", ("a", 0), srow("a", 0, 10, 1)),  # the event at 8 bridges the two
        ("+C", ("a", 0), srow("a", 0, 25, 7)),
        ("-R", ("a", 15), srow("a", 15, 25, 2)),
    ]


def test_session_split_corrects_the_session_and_appends_the_split_off_part() -> None:
    spec = view(SESSION, {"s": {"sum": "v"}})
    units = [A(1, k="a", ts=0, v=1), A(2, k="a", ts=15, v=2), A(3, k="a", ts=8, v=4)]
    result = run(spec, [*units, R(4, k="a", ts=8, v=4)])
    assert records(result, 5) == [
        ("-C", ("a", 0), srow("a", 0, 25, 7)),
        ("+C", ("a", 0), srow("a", 0, 10, 1)),
        ("+A", ("a", 15), srow("a", 15, 25, 2)),
    ]


def test_session_shrink_at_the_start_moves_its_key() -> None:
    spec = view(SESSION, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=0, v=1), A(2, k="a", ts=5, v=2), R(3, k="a", ts=0, v=1)])
    assert records(result, 3) == [
        ("-R", ("a", 0), srow("a", 0, 15, 3)),  # its start changed: the key changed
        ("+A", ("a", 5), srow("a", 5, 15, 2)),
    ]


def test_session_extended_backward_moves_its_key_too() -> None:
    spec = view(SESSION, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=20, v=1), A(2, k="a", ts=12, v=2)])
    assert records(result, 1) == [("+A", ("a", 12), srow("a", 12, 30, 3)), ("-R", ("a", 20), srow("a", 20, 30, 1))]


def test_session_takes_the_representation_of_its_earliest_row() -> None:
    spec = view({"time": "ts", "session": {"gap": "1s"}}, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=500, v=1), A(2, k="a", ts="1970-01-01T00:00:00.900Z", v=2)])
    assert records(result, 1) == [
        ("-C", ("a", 500), srow("a", 500, 1500, 1)),
        ("+C", ("a", 500), srow("a", 500, 1900, 3)),  # the earliest row is an int: ints
    ]
    result = run(spec, [A(1, k="a", ts=500, v=1), A(2, k="a", ts="1970-01-01T00:00:00.500Z", v=2)])
    text0, text1 = "1970-01-01T00:00:00.500Z", "1970-01-01T00:00:01.500Z"
    assert records(result, 1) == [  # a tie in time: text, so the key changes
        ("+A", ("a", text0), srow("a", text0, text1, 3)),
        ("-R", ("a", 500), srow("a", 500, 1500, 1)),
    ]


def test_sessions_are_per_key() -> None:
    spec = view(SESSION, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=0, v=1), A(2, k="b", ts=5, v=2)])
    assert records(result) == [("+A", ("a", 0), srow("a", 0, 10, 1)), ("+A", ("b", 5), srow("b", 5, 15, 2))]


# -- lateness: the watermark, closing, late dead letters


def test_lateness_closes_windows_and_late_events_are_dead_letters() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "5ms"})
    units = [A(1, k="a", ts=3, v=1), A(2, k="a", ts=12, v=2), A(3, k="a", ts=16, v=3),
             A(4, k="a", ts=9, v=4), R(5, k="a", ts=3, v=1), A(6, k="a", ts=10, v=5)]
    result = run(spec, units)
    assert records(result) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("+A", ("a", 10, 20), row("a", 10, 20, 2, 1)),
        ("-C", ("a", 10, 20), row("a", 10, 20, 2, 1)),
        ("+C", ("a", 10, 20), row("a", 10, 20, 5, 2)),  # then wm = 11: [0, 10) closes, nothing written
        ("-C", ("a", 10, 20), row("a", 10, 20, 5, 2)),
        ("+C", ("a", 10, 20), row("a", 10, 20, 10, 3)),
    ]
    # [0, 10) ended at 10 <= 11: an append to it and a retraction of its row are late
    assert result.rejected == [(3, LATE), (4, LATE)]
    assert result.dead_letters == [(3, 0, LATE), (4, 0, LATE)]
    assert result.watermark == 11  # 16 - 5; dead letters do not move it
    assert result.view == {("a", 0, 10): row("a", 0, 10, 1, 1), ("a", 10, 20): row("a", 10, 20, 10, 3)}


def test_the_watermark_closes_at_end_equal_and_lateness_zero() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    result = run(spec, [A(1, k="a", ts=9, v=1), A(2, k="a", ts=10, v=2), A(3, k="a", ts=9, v=3)])
    assert [code for code, _, _ in records(result)] == ["+A", "+A"]
    assert result.rejected == [(2, LATE)] and result.watermark == 10


def test_a_closed_windows_rows_are_forgotten() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    model = WindowModel(spec)
    result = ReferenceResult()
    for index, unit in enumerate([A(1, k="a", ts=3, v=1), A(2, k="b", ts=5, v=1), A(3, k="a", ts=25, v=2)]):
        assert model.step(unit, index, result, [0])
    assert set(model.live) == {(("a",), 20, 30, False)}  # [0, 10) of a and of b closed: dropped
    assert model.view() == {("a", 0, 10): row("a", 0, 10, 1, 1), ("b", 0, 10): row("b", 0, 10, 1, 1),
                            ("a", 20, 30): row("a", 20, 30, 2, 1)}


def test_a_closed_session_is_forgotten_and_never_merged_again() -> None:
    spec = view({**SESSION, "lateness": "0ms"}, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=0, v=1), A(2, k="a", ts=10, v=2), A(3, k="a", ts=5, v=4)])
    # after ts=10, wm = 10: [0, 10) closed; the event at 5 (5 + 10 > 10: not late) joins only
    # the open session at 10, not the forgotten row at 0
    assert records(result, 2) == [
        ("-R", ("a", 10), srow("a", 10, 20, 2)),  # JSON bytes: ["a",10] before ["a",5]
        ("+A", ("a", 5), srow("a", 5, 20, 6)),
    ]
    assert result.view == {("a", 0): srow("a", 0, 10, 1), ("a", 5): srow("a", 5, 20, 6)}


def test_hop_late_when_its_earliest_window_closed_even_if_a_later_one_is_open() -> None:
    spec = view({"time": "ts", "hop": {"size": "10ms", "slide": "5ms"}, "lateness": "0ms"})
    result = run(spec, [A(1, k="a", ts=12, v=1), A(2, k="a", ts=9, v=2), A(3, k="a", ts=10, v=4)])
    assert result.rejected == [(1, LATE)]  # [0, 10) ended at 10 <= 12, though [5, 15) is open
    assert records(result, 2) == [  # the row at 12 is in both windows of 10
        ("-C", ("a", 10, 20), row("a", 10, 20, 1, 1)),  # JSON bytes: ["a",10,…] before ["a",5,…]
        ("+C", ("a", 10, 20), row("a", 10, 20, 5, 2)),
        ("-C", ("a", 5, 15), row("a", 5, 15, 1, 1)),
        ("+C", ("a", 5, 15), row("a", 5, 15, 5, 2)),
    ]


def test_session_lateness_counts_from_the_gap_unless_inside_an_open_session() -> None:
    spec = view({**SESSION, "lateness": "0ms"}, {"s": {"sum": "v"}})
    units = [A(1, k="a", ts=0, v=1), A(2, k="a", ts=9, v=1), A(3, k="a", ts=18, v=1), A(4, k="a", ts=27, v=1),
             A(5, k="a", ts=2, v=1),  # 2 + 10 <= 27 but inside the open session [0, 37): applied
             A(6, k="b", ts=2, v=1),  # b has no session there: late
             A(7, k="b", ts=17, v=1),  # 17 + 10 = 27 <= 27: late
             A(8, k="b", ts=18, v=1)]  # 28 > 27: applied
    result = run(spec, units)
    assert result.rejected == [(5, LATE), (6, LATE)]
    assert result.view == {("a", 0): srow("a", 0, 37, 5), ("b", 18): srow("b", 18, 28, 1)}


def test_the_pair_rule_for_late_halves() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    result = run(spec, [
        A(1, k="a", ts=25, v=1),
        C(2, {"k": "a", "ts": 25, "v": 1}, {"k": "a", "ts": 5, "v": 1}),  # the new half is late
        A(3, k="a", ts=3, v=2),
        C(4, {"k": "a", "ts": 5, "v": 9}, {"k": "a", "ts": 25, "v": 9}),  # the old half is late
    ])
    assert result.rejected == [(1, LATE), (2, LATE), (3, LATE)]
    assert result.dead_letters == [(1, 0, PAIR), (1, 1, LATE), (2, 0, LATE), (3, 0, LATE), (3, 1, PAIR)]
    assert result.view == {("a", 20, 30): row("a", 20, 30, 1, 1)}


def test_late_comes_before_not_live() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    result = run(spec, [A(1, k="a", ts=25, v=1), R(2, k="a", ts=3, v=7), R(3, k="a", ts=26, v=7)])
    assert result.rejected == [(1, LATE), (2, Reason.NOT_LIVE)]


def test_bad_event_times_are_dead_letters() -> None:
    spec = view({"time": "ts", "tumble": "10ms"})
    units = [A(1, k="a", ts=5.0, v=1), A(2, k="a", ts=None, v=1), A(3, k="a", v=1), A(4, k="a", ts=True, v=1),
             A(5, k="a", ts="yesterday", v=1), A(6, k="a", ts=[5], v=1), A(7, k="a", ts=5, v=1),
             C(8, {"k": "a", "ts": 5, "v": 1}, {"k": "a", "ts": "5", "v": 2}),  # the new half's time is bad
             C(9, {"k": "a", "ts": 5.5, "v": 1}, {"k": "a", "ts": 6, "v": 2}),  # the old half's
             A(10, k=None, ts="bad", v=1),  # the existing checks come first: null key
             R(11, k="a", ts="bad", v=1)]  # a bad time before liveness
    result = run(spec, units)
    assert result.rejected == [(i, BAD) for i in range(6)] + [(7, BAD), (8, BAD), (9, Reason.NULL_KEY), (10, BAD)]
    assert result.dead_letters == [(i, 0, BAD) for i in range(6)] + [
        (7, 0, PAIR), (7, 1, BAD), (8, 0, BAD), (8, 1, PAIR), (9, 0, Reason.NULL_KEY), (10, 0, BAD)]
    assert result.view == {("a", 0, 10): row("a", 0, 10, 1, 1)}


def test_bad_times_do_not_matter_for_rows_the_view_does_not_hold() -> None:
    spec = view({"time": "ts", "tumble": "10ms"}, where="v > 0")
    result = run(spec, [A(1, k="a", ts="bad", v=-1),
                        C(2, {"k": "a", "ts": "bad", "v": -1}, {"k": "a", "ts": 3, "v": 2}),  # an append of the new
                        C(3, {"k": "a", "ts": 3, "v": 2}, {"k": "a", "ts": 3.5, "v": 3})])  # both pass: bad
    assert records(result) == [("+A", ("a", 0, 10), row("a", 0, 10, 2, 1))]
    assert result.dead_letters == [(2, 0, PAIR), (2, 1, BAD)]


def test_a_text_time_whose_window_cannot_be_written_is_a_bad_time() -> None:
    spec = view({"time": "ts", "tumble": "1d"})
    result = run(spec, [A(1, k="a", ts="9999-12-31T12:00:00Z", v=1), A(2, k="a", ts="9999-12-30T12:00:00Z", v=1)])
    assert result.rejected == [(0, BAD)]  # its window ends on 10000-01-01
    assert list(result.view) == [("a", "9999-12-30T00:00:00Z", "9999-12-31T00:00:00Z")]


# -- emit: final


def test_emit_final_writes_one_append_per_window_when_it_closes() -> None:
    spec = view({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    units = [A(1, k="b", ts=3, v=1), A(2, k="a", ts=5, v=2), A(3, k="b", ts=4, v=4),
             R(4, k="b", ts=4, v=4),
             A(5, k="c", ts=15, v=1),  # wm 15: [0, 10) of a and b close
             R(6, k="c", ts=15, v=1), A(7, k="a", ts=21, v=8),  # wm 21: c's [10, 20), empty, closes
             A(8, k="a", ts=2, v=1)]  # late
    result = run(spec, units, emit="final")
    assert records(result) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 2, 1)),
        ("+A", ("b", 0, 10), row("b", 0, 10, 1, 1)),  # its last row only; c's emptied window: nothing
    ]
    assert result.rejected == [(7, LATE)]
    assert result.view == {("a", 0, 10): row("a", 0, 10, 2, 1), ("b", 0, 10): row("b", 0, 10, 1, 1)}
    per_event = run(spec, units)  # the same dead letters, and the same rows for the closed windows
    assert per_event.rejected == result.rejected
    assert {k: v for k, v in per_event.view.items() if k in result.view} == result.view


def test_emit_final_of_sessions_and_of_a_top_n() -> None:
    spec = view({**SESSION, "lateness": "5ms"}, {"s": {"sum": "v"}})
    result = run(spec, [A(1, k="a", ts=0, v=1), A(2, k="a", ts=5, v=2), A(3, k="a", ts=30, v=4)], emit="final")
    assert records(result) == [("+A", ("a", 0), srow("a", 0, 15, 3))]  # wm 25 >= 15
    spec = top({"time": "ts", "tumble": "10ms", "lateness": "0ms"})
    result = run(spec, [A(1, g="x", ts=1, v=5), A(2, g="x", ts=2, v=7), A(3, g="x", ts=3, v=6),
                        A(4, g="x", ts=10, v=1)], emit="final")
    assert records(result) == [
        ("+A", ("x", 0, 10, 1), {"g": "x", "window_start": 0, "window_end": 10, "place": 1, "ts": 2, "v": 7}),
        ("+A", ("x", 0, 10, 2), {"g": "x", "window_start": 0, "window_end": 10, "place": 2, "ts": 3, "v": 6}),
    ]


def test_emit_final_needs_lateness_and_sessions_have_no_top_n() -> None:
    with pytest.raises(ValueError, match="lateness"):
        reference_changelog(view({"time": "ts", "tumble": "10ms"}), [], emit="final")
    with pytest.raises(ValueError, match="per_event or final"):
        reference_changelog(view({"time": "ts", "tumble": "10ms"}), [], emit="per_batch")
    with pytest.raises(ValueError, match="Top-N"):
        reference_changelog(top(SESSION), [])
    with pytest.raises(ValueError, match="per event only"):
        reference_changelog(ViewSpec.model_validate({"key": ["k"], "columns": SUM_COUNT}), [], emit="final")


# -- Top-N per window


def test_top_n_per_tumble_window() -> None:
    spec = top({"time": "ts", "tumble": "10ms"})
    result = run(spec, [A(1, g="x", ts=1, v=5), A(2, g="x", ts=2, v=7), A(3, g="x", ts=3, v=6),
                        A(4, g="x", ts=11, v=1), R(5, g="x", ts=2, v=7)])

    def place(ws: int, we: int, n: int, ts: int, v: int) -> dict[str, Any]:
        return {"g": "x", "window_start": ws, "window_end": we, "place": n, "ts": ts, "v": v}

    assert records(result) == [
        ("+A", ("x", 0, 10, 1), place(0, 10, 1, 1, 5)),
        ("-C", ("x", 0, 10, 1), place(0, 10, 1, 1, 5)),
        ("+C", ("x", 0, 10, 1), place(0, 10, 1, 2, 7)),
        ("+A", ("x", 0, 10, 2), place(0, 10, 2, 1, 5)),
        ("-C", ("x", 0, 10, 2), place(0, 10, 2, 1, 5)),
        ("+C", ("x", 0, 10, 2), place(0, 10, 2, 3, 6)),
        ("+A", ("x", 10, 20, 1), place(10, 20, 1, 11, 1)),  # another window: its own ranking
        ("-C", ("x", 0, 10, 1), place(0, 10, 1, 2, 7)),
        ("+C", ("x", 0, 10, 1), place(0, 10, 1, 3, 6)),
        ("-C", ("x", 0, 10, 2), place(0, 10, 2, 3, 6)),
        ("+C", ("x", 0, 10, 2), place(0, 10, 2, 1, 5)),
    ]
    assert result.changes[0].key_names == ("g", "window_start", "window_end", "place")
    assert list(result.changes[0].row) == ["g", "window_start", "window_end", "place", "ts", "v"]


def test_top_n_per_hop_window() -> None:
    spec = top({"time": "ts", "hop": {"size": "10ms", "slide": "5ms"}}, n=1)
    result = run(spec, [A(1, g="x", ts=7, v=5), A(2, g="x", ts=12, v=9)])
    assert [(code, key) for code, key, _ in records(result)] == [
        ("+A", ("x", 0, 10, 1)), ("+A", ("x", 5, 15, 1)),
        ("+A", ("x", 10, 20, 1)), ("-C", ("x", 5, 15, 1)), ("+C", ("x", 5, 15, 1)),
    ]


# -- deltas and table sources


def test_deltas_are_per_window() -> None:
    spec = view({"time": "ts", "tumble": "10ms"})
    batches = [[A(1, k="a", ts=3, v=1), A(2, k="a", ts=12, v=2)], [R(3, k="a", ts=3, v=1), A(4, k="a", ts=4.5, v=1)]]
    deltas = reference_deltas(spec, batches)
    assert deltas == [
        {"k": "a", "window_start": 0, "window_end": 10, "_count": 1, "s": 1, "n": 1},
        {"k": "a", "window_start": 10, "window_end": 20, "_count": 1, "s": 2, "n": 1},
        {"k": "a", "window_start": 0, "window_end": 10, "_count": -1, "s": -1, "n": -1},
    ]
    assert fold_deltas(spec, deltas) == {("a", 10, 20): row("a", 10, 20, 2, 1)}
    with pytest.raises(ValueError, match="tumble and hop"):
        reference_deltas(view(SESSION), batches)


def test_an_upsert_table_source_windowed() -> None:
    spec = view({"time": "ts", "tumble": "10ms"})
    result = reference_table(spec, {0: [
        (("r1",), "upsert", {"k": "a", "ts": 3, "v": 1}, None, (1, 0, 1)),
        (("r1",), "upsert", {"k": "a", "ts": 13, "v": 1}, None, (2, 0, 2)),  # the row moves windows
    ]})
    assert records(result) == [
        ("+A", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("-R", ("a", 0, 10), row("a", 0, 10, 1, 1)),
        ("+A", ("a", 10, 20), row("a", 10, 20, 1, 1)),
    ]


def test_unwindowed_dead_letters_name_the_refused_half() -> None:
    spec = ViewSpec.model_validate({"key": ["k"], "columns": SUM_COUNT})
    result = run(spec, [C(1, {"k": "a", "v": 1}, {"k": "a", "v": 2}), C(2, {"k": "a", "v": 1}, {"k": None, "v": 2})])
    assert result.rejected == [(0, Reason.NOT_LIVE), (1, Reason.NULL_KEY)]
    assert result.dead_letters == [(0, 0, Reason.NOT_LIVE), (0, 1, PAIR), (1, 0, PAIR), (1, 1, Reason.NULL_KEY)]
