"""Stream forms: the retract map, and Debezium envelopes."""

from __future__ import annotations

from typing import Any

import pytest

from refold.model.changelog import ChangelogEvent, Op
from refold.model.forms import RETRACT_FORM, from_debezium

A, R, CF, CT = Op.APPEND, Op.RETRACT, Op.CORRECT_FROM, Op.CORRECT_TO


def test_retract_form_maps_corrections_only() -> None:
    assert [RETRACT_FORM[op] for op in (A, CF, CT, R)] == [A, R, A, R]
    # the retract form keeps each op's diff: the multiset of live rows stays the same
    assert all(RETRACT_FORM[op].diff == op.diff for op in Op)


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
