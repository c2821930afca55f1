"""The windowed reference against DuckDB, on random windowed changelogs
(tests/window_changelogs.py).

The test replays the units on its own (a flat multiset of live rows, the watermark, the
contract's order of refusals) and has DuckDB run the GROUP BY over the rows left live:
the windows as a table of epoch-aligned starts joined on containment (tumble, hop), or
gaps-and-islands over LAG (sessions). The reference's folded changelog must be that
view exactly; with a lateness, its `emit: final` changelog the rows of the windows that
ended at or before the watermark. No server."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import duckdb
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from window_changelogs import INTS, LATENESS, SQL_COLUMNS, batched, window_changelogs, window_view

from refold.config import ViewSpec
from refold.model.changelog import Op, canonical_row
from refold.model.reasons import Reason
from refold.reduce import SourceEvent
from refold.reference import fold_changelog, fold_deltas, reference_changelog, reference_deltas
from refold.reference_windows import event_time

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
AGGREGATES = "COALESCE(SUM(v), 0) AS total, COUNT(*) AS n, COUNT(v) AS nv, MIN(v) AS low, MAX(v) AS high"


def written(millis: int, text: bool) -> Any:
    """A window bound as the contract writes it, formatted here apart from the model's."""
    if not text:
        return millis
    iso = (EPOCH + timedelta(milliseconds=millis)).isoformat(timespec="milliseconds")
    return iso.replace("+00:00", "Z").replace(".000Z", "Z")


def earliest_end(t: int, size: int, slide: int) -> int:
    """The end of the earliest-ending window of `size` every `slide` holding t."""
    return ((t - size) // slide + 1) * slide + size


def replay(spec: ViewSpec, units: list[list[SourceEvent]]) -> tuple[list[tuple[int, str]], Counter[bytes], int | None]:
    """The refusals, the live multiset and the watermark the contract gives, kept flat
    (rows of closed windows stay: nothing may touch them after they close)."""
    window = spec.window
    assert window is not None
    lateness = window.lateness_ms
    live: Counter[bytes] = Counter()
    refused: list[tuple[int, str]] = []
    wm: int | None = None
    for index, unit in enumerate(units):
        reason = None
        if len(unit) == 1 and unit[0].op is Op.CORRECT_TO:
            reason = Reason.ORPHAN_CORRECT_TO
        elif len(unit) == 1 and unit[0].op is Op.CORRECT_FROM:
            reason = Reason.UNPAIRED_CORRECT_FROM
        elif any(event.row.get("k") is None for event in unit):
            reason = Reason.NULL_KEY
        else:
            times = [event_time(event.row.get("ts")) for event in unit]
            if any(found is None for found in times):
                reason = Reason.BAD_TIME
            elif wm is not None and any(late(window, found[0], wm, live, event)  # type: ignore[index]
                                        for found, event in zip(times, unit, strict=True)):
                reason = Reason.LATE
            else:
                trial = Counter(live)
                for event in unit:
                    row = canonical_row(event.row)
                    if event.op.adds:
                        trial[row] += 1
                    elif trial[row] > 0:
                        trial[row] -= 1
                    else:
                        reason = Reason.NOT_LIVE
                        break
                if reason is None:
                    live = +trial
                    if lateness is not None:
                        latest = max(found[0] for found in times if found is not None) - lateness
                        wm = latest if wm is None else max(wm, latest)
        if reason is not None:
            refused.append((index, reason))
    return refused, live, wm


def late(window: Any, t: int, wm: int, live: Counter[bytes], event: SourceEvent) -> bool:
    if window.kind != "session":
        return earliest_end(t, window.size_ms, window.slide_ms) <= wm
    raise AssertionError("sessions with a lateness are not replayed flat")


def table(live: Counter[bytes]) -> duckdb.DuckDBPyConnection:
    """The live rows as a DuckDB table r(k, ts_ms, text, v), one row per live copy."""
    db = duckdb.connect()
    db.execute("CREATE TABLE r (k VARCHAR, ts_ms BIGINT, text BOOLEAN, v BIGINT)")
    rows = []
    for raw, copies in live.items():
        row = orjson.loads(raw)
        found = event_time(row["ts"])
        assert found is not None
        rows.extend([(row["k"], found[0], found[1], row.get("v"))] * copies)
    if rows:
        db.executemany("INSERT INTO r VALUES (?, ?, ?, ?)", rows)
    return db


def sql_windows(spec: ViewSpec, live: Counter[bytes]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The tumble or hop view over the live rows, by DuckDB."""
    window = spec.window
    assert window is not None
    size, slide = window.size_ms, window.slide_ms
    db = table(live)
    low, high = db.execute("SELECT MIN(ts_ms), MAX(ts_ms) FROM r").fetchone() or (None, None)
    if low is None:
        return {}
    first = (low - size) // slide * slide  # a multiple of the slide at or before every window start
    found = db.execute(f"""
        WITH w AS (SELECT range AS s FROM range({first}, {high + 1}, {slide}))
        SELECT r.k, w.s, w.s + {size} AS e, r.text, {AGGREGATES}
        FROM r JOIN w ON w.s <= r.ts_ms AND r.ts_ms < w.s + {size}
        GROUP BY r.k, w.s, r.text""").fetchall()
    view = {}
    for k, start, end, text, total, n, nv, low_v, high_v in found:
        ws, we = written(start, text), written(end, text)
        view[(k, ws, we)] = {"k": k, "window_start": ws, "window_end": we,
                             "total": total, "n": n, "nv": nv, "low": low_v, "high": high_v}
    return view


def sql_sessions(spec: ViewSpec, live: Counter[bytes]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The session view over the live rows, by DuckDB: a row starts a session when the
    key's previous time is at least the gap before it."""
    gap = spec.window.gap_ms if spec.window is not None else None
    assert gap is not None
    found = table(live).execute(f"""
        WITH o AS (
            SELECT *, CASE WHEN ts_ms - LAG(ts_ms) OVER (PARTITION BY k ORDER BY ts_ms) < {gap}
                           THEN 0 ELSE 1 END AS fresh
            FROM r),
        s AS (
            SELECT *, SUM(fresh) OVER (PARTITION BY k ORDER BY ts_ms, fresh DESC
                                       ROWS UNBOUNDED PRECEDING) AS sid
            FROM o)
        SELECT k, MIN(ts_ms), MAX(ts_ms) + {gap}, ARG_MIN(text, ts_ms * 2 + CASE WHEN text THEN 0 ELSE 1 END),
               {AGGREGATES}
        FROM s GROUP BY k, sid""").fetchall()
    view = {}
    for k, start, end, text, total, n, nv, low_v, high_v in found:
        ws, we = written(start, text), written(end, text)
        view[(k, ws)] = {"k": k, "window_start": ws, "window_end": we,
                         "total": total, "n": n, "nv": nv, "low": low_v, "high": high_v}
    return view


@pytest.mark.parametrize("lateness", LATENESS)
@pytest.mark.parametrize("kind", ["tumble", "hop", "hop-uneven"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tumble_and_hop_views_equal_duckdb(kind: str, lateness: str | None, data: st.DataObject) -> None:
    spec = window_view(kind, lateness, columns=SQL_COLUMNS)
    units = data.draw(window_changelogs(values=INTS, invalid=data.draw(st.booleans())))
    result = reference_changelog(spec, units)
    refused, live, wm = replay(spec, units)
    assert result.rejected == refused
    assert result.watermark == wm
    expected = sql_windows(spec, live)
    assert fold_changelog(result.changes) == result.view == expected
    # the same view from the delta rows, cut into random batches
    assert fold_deltas(spec, reference_deltas(spec, data.draw(batched(units)))) == expected
    if lateness is not None:  # emit final: the rows of the windows the watermark passed, once each
        final = reference_changelog(spec, units, emit="final")
        assert {change.op for change in final.changes} <= {Op.APPEND}
        closed = {key: row for key, row in expected.items() if wm is not None and _end_ms(key[2]) <= wm}
        assert fold_changelog(final.changes) == final.view == closed
        assert final.rejected == refused


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_session_views_without_lateness_equal_duckdb(data: st.DataObject) -> None:
    spec = window_view("session", columns=SQL_COLUMNS)
    units = data.draw(window_changelogs(values=INTS, invalid=data.draw(st.booleans())))
    result = reference_changelog(spec, units)
    refused, live, _wm = replay(spec, units)
    assert result.rejected == refused
    assert fold_changelog(result.changes) == result.view == sql_sessions(spec, live)


def _end_ms(bound: Any) -> int:
    if type(bound) is int:
        return bound
    found = event_time(bound)
    assert found is not None
    return found[0]
