"""Changelog events ⇄ Arrow tables."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refold.arrowconv import arrow_to_events, events_to_arrow
from refold.changelog import ChangelogEvent, Op

EVENTS = [
    ChangelogEvent(Op.APPEND, {"player": "Al", "score": 100, "bonus": 1.5, "tags": ["a"]}, 1_700_000_000_123),
    ChangelogEvent(Op.CORRECT_FROM, {"player": "Al", "score": 100, "bonus": None, "tags": []}, None),
    ChangelogEvent(Op.CORRECT_TO, {"player": "Al", "score": -7, "bonus": 0.0, "tags": ["b", "c"]}, -1),
    ChangelogEvent(Op.RETRACT, {"player": None, "score": None, "bonus": None, "tags": None}, 0),
]


def test_table_types_and_layout() -> None:
    table = events_to_arrow(EVENTS)
    assert table.column_names == ["op", "event_time", "player", "score", "bonus", "tags"]
    assert table.schema.field("op").type == pa.uint8()
    assert not table.schema.field("op").nullable
    assert table.schema.field("event_time").type == pa.timestamp("ms")
    assert table.schema.field("score").type == pa.int64()
    assert table.schema.field("tags").type == pa.list_(pa.string())
    assert table.column("op").to_pylist() == [0, 2, 3, 1]
    assert table.column("event_time").cast(pa.int64()).to_pylist() == [1_700_000_000_123, None, -1, 0]


def test_round_trip() -> None:
    assert arrow_to_events(events_to_arrow(EVENTS)) == EVENTS


def test_empty() -> None:
    table = events_to_arrow([])
    assert table.num_rows == 0 and table.column_names == ["op", "event_time"]
    assert arrow_to_events(table) == []
    assert arrow_to_events(events_to_arrow([ChangelogEvent(Op.APPEND, {})])) == [ChangelogEvent(Op.APPEND, {})]


def test_absent_columns_come_back_null() -> None:
    events = [ChangelogEvent(Op.APPEND, {"a": 1}), ChangelogEvent(Op.APPEND, {"b": "x"})]
    table = events_to_arrow(events)
    assert table.column_names == ["op", "event_time", "a", "b"]
    assert [e.row for e in arrow_to_events(table)] == [{"a": 1, "b": None}, {"a": None, "b": "x"}]


def test_row_schema_fixes_columns_and_types() -> None:
    schema = pa.schema([pa.field("score", pa.int32()), pa.field("player", pa.string())])
    events = [ChangelogEvent(Op.APPEND, {"player": "Al", "score": 1})]
    table = events_to_arrow(events, schema)
    assert table.column_names == ["op", "event_time", "score", "player"]
    assert table.schema.field("score").type == pa.int32()
    assert arrow_to_events(table) == events
    with pytest.raises(ValueError, match=r"\['extra'\] are not in the row schema"):
        events_to_arrow([ChangelogEvent(Op.APPEND, {"player": "Al", "extra": 1})], schema)


def test_untypeable_and_system_columns_are_rejected() -> None:
    with pytest.raises(ValueError, match="column 'v'"):
        events_to_arrow([ChangelogEvent(Op.APPEND, {"v": 1}), ChangelogEvent(Op.APPEND, {"v": "x"})])
    with pytest.raises(ValueError, match="non-system columns only"):
        events_to_arrow([ChangelogEvent(Op.APPEND, {"offset": 1})])


def test_arrow_to_events_accepts_other_encodings() -> None:
    table = pa.table(
        {
            "op": pa.array(["+A", "-R"]),
            "event_time": pa.array([1_500_999, None], type=pa.timestamp("us", tz="UTC")),
            "offset": pa.array([10, 11]),
            "system_time": pa.array([1, 2]),
            "v": pa.array([1, 2]),
        }
    )
    assert arrow_to_events(table) == [ChangelogEvent(Op.APPEND, {"v": 1}, 1_500), ChangelogEvent(Op.RETRACT, {"v": 2})]
    for unit, value in (("s", -2), ("ms", -2_000), ("us", -1_999_001), ("ns", -1_999_000_001)):
        times = pa.table({"op": pa.array([0]), "event_time": pa.array([value], type=pa.timestamp(unit))})
        assert arrow_to_events(times)[0].event_time == -2_000, unit
    ints = pa.table({"op": pa.array([3], type=pa.int32()), "event_time": pa.array([42])})
    assert arrow_to_events(ints) == [ChangelogEvent(Op.CORRECT_TO, {}, 42)]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"v": pa.array([1])}, "no 'op' column"),
        ({"op": pa.array([4], type=pa.uint8())}, "got 4"),
        ({"op": pa.array([None], type=pa.uint8())}, "got None"),
        ({"op": pa.array(["+X"])}, "got '\\+X'"),
        ({"op": pa.array([0.0])}, "must hold integers 0..3 or op codes"),
        ({"op": pa.array([0], type=pa.uint8()), "event_time": pa.array(["x"])}, "must be a timestamp"),
    ],
)
def test_arrow_to_events_rejects(columns: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arrow_to_events(pa.table(columns))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Op)),
            st.none() | st.integers(-(2**62), 2**62),
            st.none() | st.integers(-(2**63), 2**63 - 1),
            st.none() | st.text(max_size=5),
            st.none() | st.floats(allow_nan=False),
        ),
        max_size=20,
    )
)
def test_round_trip_property(rows: list[tuple[Op, int | None, int | None, str | None, float | None]]) -> None:
    events = [ChangelogEvent(op, {"i": i, "s": s, "f": f}, t) for op, t, i, s, f in rows]
    schema = pa.schema([("i", pa.int64()), ("s", pa.string()), ("f", pa.float64())])
    assert arrow_to_events(events_to_arrow(events, schema)) == events
