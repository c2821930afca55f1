"""Stream-form converters: changelog ⇄ retract ⇄ upsert, and Debezium envelopes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refold.model.changelog import ChangelogEvent, Op, PairingValidator, key_of, live_rows
from refold.model.forms import from_debezium, from_retract, from_upsert, to_retract, to_upsert

A, R, CF, CT = Op.APPEND, Op.RETRACT, Op.CORRECT_FROM, Op.CORRECT_TO
KEY = ["k"]


def ev(op: Op, k: Any, v: Any = 0, t: int | None = None) -> ChangelogEvent:
    return ChangelogEvent(op, {"k": k, "v": v}, t)


@st.composite
def changelogs(draw: st.DrawFn, unique_key: bool = False) -> list[ChangelogEvent]:
    """A valid changelog over a few keys: retractions only of live rows, each -C
    right before its +C for the same key. With `unique_key`, at most one live row
    per key (an upsert stream)."""
    live: list[dict[str, Any]] = []
    events: list[ChangelogEvent] = []
    for _ in range(draw(st.integers(0, 40))):
        action = draw(st.sampled_from(["append", "retract", "correct"]))
        time = draw(st.none() | st.integers(0, 100))
        if action == "append" or not live:
            key = draw(st.sampled_from("abcd"))
            if unique_key and any(row["k"] == key for row in live):
                continue
            row = {"k": key, "v": draw(st.integers(0, 2))}
            live.append(row)
            events.append(ChangelogEvent(A, row, time))
        elif action == "retract":
            row = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(ChangelogEvent(R, row, time))
        else:
            index = draw(st.integers(0, len(live) - 1))
            old = live[index]
            new = {"k": old["k"], "v": draw(st.integers(0, 2))}
            live[index] = new
            events += [ChangelogEvent(CF, old, time), ChangelogEvent(CT, new, time)]
    return events


def assert_paired(events: list[ChangelogEvent]) -> None:
    validator = PairingValidator()
    for event in events:
        assert validator.feed(event.op, key_of(event.row, KEY)) is None
    assert validator.finish() is None


@settings(max_examples=100, deadline=None)
@given(changelogs())
def test_changelog_to_retract_and_back_keeps_live_rows(events: list[ChangelogEvent]) -> None:
    retract = to_retract(events)
    assert {e.op for e in retract} <= {A, R}
    assert [(e.row, e.event_time, e.op.diff) for e in retract] == [(e.row, e.event_time, e.op.diff) for e in events]
    assert live_rows(retract) == live_rows(events)
    back = from_retract(retract, KEY)
    assert live_rows(back) == live_rows(events)
    assert_paired(back)
    # Idempotent: a changelog is its own changelog form once corrections are paired.
    assert from_retract(back, KEY) == back


@settings(max_examples=100, deadline=None)
@given(changelogs(unique_key=True))
def test_upsert_stream_to_upsert_and_back_keeps_live_rows(events: list[ChangelogEvent]) -> None:
    records = to_upsert(events, KEY)
    assert len(records) == sum(1 for e in events if e.op is not CF)
    # Compacted (last record per key, tombstones dropped), it is the set of live rows.
    compacted = {key: row for key, row in records}
    assert live_rows(ChangelogEvent(A, row) for row in compacted.values() if row is not None) == live_rows(events)
    back = from_upsert(records, KEY)
    assert live_rows(back) == live_rows(events)
    assert_paired(back)
    assert all(e.event_time is None for e in back)


@settings(max_examples=50, deadline=None)
@given(changelogs(unique_key=True), st.integers(0, 40))
def test_from_upsert_in_chunks_equals_in_one_go(events: list[ChangelogEvent], cut: int) -> None:
    records = to_upsert(events, KEY)
    last: dict[tuple[Any, ...], Any] = {}
    chunked = from_upsert(records[:cut], KEY, last=last) + from_upsert(records[cut:], KEY, last=last)
    assert chunked == from_upsert(records, KEY)


def test_to_retract_maps_corrections_only() -> None:
    events = [ev(A, "a", 1, 5), ev(CF, "a", 1, 6), ev(CT, "a", 2, 6), ev(R, "a", 2, 7)]
    assert to_retract(events) == [ev(A, "a", 1, 5), ev(R, "a", 1, 6), ev(A, "a", 2, 6), ev(R, "a", 2, 7)]


def test_from_retract_pairs_only_adjacent_same_key() -> None:
    assert from_retract([ev(R, "a", 1), ev(A, "a", 2)], KEY) == [ev(CF, "a", 1), ev(CT, "a", 2)]
    assert from_retract([ev(R, "a", 1), ev(A, "b", 2)], KEY) == [ev(R, "a", 1), ev(A, "b", 2)]
    assert from_retract([ev(R, "a", 1), ev(R, "a", 2), ev(A, "a", 3)], KEY) == [
        ev(R, "a", 1), ev(CF, "a", 2), ev(CT, "a", 3),
    ]
    assert from_retract([ev(R, "a", 1), ev(A, "a", 2), ev(A, "a", 3)], KEY) == [
        ev(CF, "a", 1), ev(CT, "a", 2), ev(A, "a", 3),
    ]
    assert from_retract([ev(A, "a"), ev(R, "a")], KEY) == [ev(A, "a"), ev(R, "a")]
    # A null or missing key is never paired.
    assert from_retract([ev(R, None), ev(A, None)], KEY) == [ev(R, None), ev(A, None)]
    assert from_retract([ChangelogEvent(R, {}), ChangelogEvent(A, {})], KEY) == [
        ChangelogEvent(R, {}), ChangelogEvent(A, {}),
    ]


def test_to_upsert() -> None:
    events = [ev(A, "a", 1), ev(CF, "a", 1), ev(CT, "a", 2), ev(A, "b", 3), ev(R, "a", 2)]
    assert to_upsert(events, KEY) == [
        (("a",), {"k": "a", "v": 1}),
        (("a",), {"k": "a", "v": 2}),
        (("b",), {"k": "b", "v": 3}),
        (("a",), None),
    ]
    with pytest.raises(ValueError, match="null"):
        to_upsert([ev(A, None)], KEY)
    with pytest.raises(KeyError):
        to_upsert([ChangelogEvent(A, {})], KEY)


def test_from_upsert_decisions() -> None:
    a1, a2, b = {"k": "a", "v": 1}, {"k": "a", "v": 2}, {"k": "b", "v": 3}
    records = [
        (("x",), None),  # tombstone of an unknown key: ignored
        (("a",), a1),  # first sight: +A
        (("a",), dict(a1)),  # same row again: nothing
        (("a",), a2),  # changed: -C old, +C new
        (("b",), b),
        (("a",), None),  # delete: -R old
        (("a",), None),  # again: ignored
        (("a",), a1),  # back: +A
    ]
    assert from_upsert(records, KEY) == [
        ChangelogEvent(A, a1),
        ChangelogEvent(CF, a1),
        ChangelogEvent(CT, a2),
        ChangelogEvent(A, b),
        ChangelogEvent(R, a2),
        ChangelogEvent(A, a1),
    ]


def test_from_upsert_rejects_a_row_of_another_key() -> None:
    with pytest.raises(ValueError, match="holds a row of key"):
        from_upsert([(("a",), {"k": "b"})], KEY)
    with pytest.raises(ValueError, match="missing"):
        from_upsert([(("a",), {"v": 1})], KEY)
    with pytest.raises(ValueError, match="null"):
        from_upsert([(("a",), {"k": None})], KEY)


# Debezium -----------------------------------------------------------------------------

BEFORE = {"id": 1, "name": "old"}
AFTER = {"id": 1, "name": "new"}


def envelope(op: str, before: Any = None, after: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "before": before,
        "after": after,
        "source": {"connector": "postgresql", "ts_ms": 111, "table": "t"},
        "op": op,
        "ts_ms": 222,
        "transaction": None,
        **extra,
    }


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (envelope("c", after=AFTER), [ChangelogEvent(A, AFTER, 222)]),
        (envelope("r", after=AFTER), [ChangelogEvent(A, AFTER, 222)]),
        (envelope("u", BEFORE, AFTER), [ChangelogEvent(CF, BEFORE, 222), ChangelogEvent(CT, AFTER, 222)]),
        (envelope("d", before=BEFORE), [ChangelogEvent(R, BEFORE, 222)]),
    ],
)
def test_debezium_ops(body: dict[str, Any], expected: list[ChangelogEvent]) -> None:
    assert from_debezium(body) == expected
    wrapped = {"schema": {"type": "struct", "name": "server.public.t.Envelope"}, "payload": body}
    assert from_debezium(wrapped) == expected


def test_debezium_event_time_falls_back_to_the_source_time() -> None:
    body = envelope("c", after=AFTER)
    del body["ts_ms"]
    assert from_debezium(body)[0].event_time == 111
    del body["source"]
    assert from_debezium(body)[0].event_time is None


def test_debezium_tombstones_carry_nothing() -> None:
    assert from_debezium(None) == []
    assert from_debezium({"schema": None, "payload": None}) == []


@pytest.mark.parametrize("op", ["t", "m", "x"])
def test_debezium_unknown_op_is_named(op: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported Debezium op '{op}'"):
        from_debezium(envelope(op))
    with pytest.raises(ValueError, match=f"unsupported Debezium op '{op}'"):
        from_debezium({"payload": envelope(op)})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"before": None, "after": AFTER}, "no 'op' field"),
        (envelope("u", None, AFTER), "without its 'before' row .*REPLICA IDENTITY FULL"),
        (envelope("d"), "without its 'before' row"),
        (envelope("c"), "without its 'after' row"),
        (envelope("c", after=AFTER, ts_ms="soon"), "ts_ms must be an integer"),
    ],
)
def test_debezium_incomplete_events(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_debezium(body)


def test_debezium_rows_are_copies() -> None:
    after = dict(AFTER)
    event = from_debezium(envelope("c", after=after))[0]
    after["name"] = "changed"
    assert event.row == AFTER
