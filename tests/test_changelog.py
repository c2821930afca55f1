"""The changelog model: op codes, events, keys, pairing."""

from __future__ import annotations

import pytest

from refold.model.changelog import (
    ChangelogEvent,
    Op,
    Pairing,
    PairingValidator,
    PairStep,
    canonical_row,
    key_of,
    legacy_canonical_row,
)
from refold.model.reasons import Reason

A, R, CF, CT = Op.APPEND, Op.RETRACT, Op.CORRECT_FROM, Op.CORRECT_TO


def test_op_values_codes_and_names() -> None:
    assert [(int(op), op.code) for op in Op] == [(0, "+A"), (1, "-R"), (2, "-C"), (3, "+C")]
    assert [op.name for op in Op] == ["APPEND", "RETRACT", "CORRECT_FROM", "CORRECT_TO"]
    assert [op.diff for op in Op] == [1, -1, -1, 1]
    assert [op.adds for op in Op] == [True, False, False, True]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("+A", A), ("-R", R), ("-C", CF), ("+C", CT), (0, A), (1, R), (2, CF), (3, CT), ("0", A), ("3", CT), (CT, CT)],
)
def test_op_parse(value: object, expected: Op) -> None:
    assert Op.parse(value) is expected


@pytest.mark.parametrize("value", [4, -1, 7, "+X", "A", "+a", "4", "", None, True, False, 1.0, 0.0, [0], b"+A"])
def test_op_parse_rejects_naming_the_value(value: object) -> None:
    with pytest.raises(ValueError, match="op must be one of") as failure:
        Op.parse(value)
    assert repr(value) in str(failure.value)


def test_event_record_round_trip() -> None:
    event = ChangelogEvent(CF, {"k": "a", "v": 1.5}, 1_700_000_000_000)
    record = event.to_record()
    assert record == {"op": "-C", "event_time": 1_700_000_000_000, "k": "a", "v": 1.5}
    assert list(record)[:2] == ["op", "event_time"]
    assert ChangelogEvent.from_record(record) == event
    assert ChangelogEvent(A, {"k": "a"}).to_record() == {"op": "+A", "k": "a"}


def test_event_from_record_drops_system_columns_and_accepts_numbers() -> None:
    event = ChangelogEvent.from_record({"op": 1, "k": "a", "offset": 5, "system_time": 9})
    assert event == ChangelogEvent(R, {"k": "a"}, None)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"k": "a"}, "missing field 'op'"),
        ({"op": 9, "k": "a"}, "op must be one of"),
        ({"op": "+A", "event_time": "soon"}, "event_time must be epoch milliseconds"),
        ({"op": "+A", "event_time": 1.5}, "event_time must be epoch milliseconds"),
        ({"op": "+A", "event_time": True}, "event_time must be epoch milliseconds"),
    ],
)
def test_event_from_record_errors(record: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChangelogEvent.from_record(record)


def test_events_are_frozen_values() -> None:
    event = ChangelogEvent(A, {"k": 1}, 5)
    assert event == ChangelogEvent(A, {"k": 1}, 5)
    with pytest.raises(AttributeError):
        event.op = R  # type: ignore[misc]


def test_key_of() -> None:
    row = {"a": 1, "b": "x", "c": None}
    assert key_of(row, ["b", "a"]) == ("x", 1)
    assert key_of(row, []) == ()
    with pytest.raises(KeyError, match="'z' is missing"):
        key_of(row, ["a", "z"])
    with pytest.raises(ValueError, match="'c' is null"):
        key_of(row, ["c"])


def feed_all(ops_keys: list[tuple[Op, str]]) -> list[str | None]:
    validator = PairingValidator()
    results = [validator.feed(op, (key,)) for op, key in ops_keys]
    return [*results, validator.finish()]


def test_pairing_accepts_valid_sequences() -> None:
    assert feed_all([(A, "a"), (CF, "a"), (CT, "a"), (R, "a"), (CF, "b"), (CT, "b")]) == [None] * 7
    assert feed_all([]) == [None]


def test_pairing_rejects_each_kind_of_bad_sequence() -> None:
    assert feed_all([(CT, "a")]) == ["+C without a preceding -C", None]
    assert feed_all([(CF, "a"), (A, "a")]) == [None, "-C not immediately followed by its +C", None]
    assert feed_all([(CF, "a"), (CF, "a")])[1] == "-C not immediately followed by its +C"
    assert feed_all([(CF, "a"), (R, "a")])[1] == "-C not immediately followed by its +C"
    assert feed_all([(CF, "a"), (CT, "b")]) == [None, "+C key differs from its -C key", None]
    assert feed_all([(A, "a"), (CF, "a")]) == [None, None, "-C at the end of the input without its +C"]


def test_pairing_recovers_after_a_bad_event_and_after_finish() -> None:
    validator = PairingValidator()
    assert validator.feed(CF, ("a",)) is None
    assert validator.feed(A, ("a",)) is not None
    # The broken pair is forgotten: the next pair is judged on its own.
    assert validator.feed(CF, ("b",)) is None
    assert validator.feed(CT, ("b",)) is None
    assert validator.feed(CF, ("c",)) is None
    assert validator.finish() is not None
    assert validator.finish() is None
    assert validator.feed(CT, ("c",)) == "+C without a preceding -C"


def test_canonical_row() -> None:
    assert canonical_row({"b": 1, "a": "x"}) == canonical_row({"a": "x", "b": 1}) == b'{"a":"x","b":1}'
    assert canonical_row({"a": 1}) != canonical_row({"a": 1.0})
    # a null column equals an absent one (an optional field added to the producer's schema)
    assert canonical_row({"a": 1, "bonus": None}) == canonical_row({"a": 1}) == b'{"a":1}'
    assert canonical_row({"a": None}) == canonical_row({})
    assert legacy_canonical_row({"a": 1}) is None
    assert legacy_canonical_row({"a": 1, "bonus": None}) == b'{"a":1,"bonus":null}'


def test_pairing_steps_hand_back_the_items() -> None:
    pairing: Pairing[str] = Pairing()
    assert pairing.feed(A, "k", "a1") == PairStep(("a1",), None, None)
    assert pairing.feed(CF, "k", "cf1") == PairStep(None, None, None)  # held
    assert pairing.feed(CT, "k", "ct1") == PairStep(("cf1", "ct1"), None, None)
    # a -C whose next event is not its +C is unpaired; that event is judged on its own
    assert pairing.feed(CF, "k", "cf2") == PairStep(None, None, None)
    assert pairing.feed(R, "k", "r1") == PairStep(("r1",), "cf2", None)
    pairing.feed(CF, "k", "cf3")
    assert pairing.feed(CF, "k", "cf4") == PairStep(None, "cf3", None)
    # a +C of another key: the -C unpaired, the +C an orphan
    assert pairing.feed(CT, "other", "ct2") == PairStep(None, "cf4", "ct2")
    assert pairing.feed(CT, "k", "ct3") == PairStep(None, None, "ct3")
    # keys compare with ==: a Kafka message key may be None
    pairing.feed(CF, None, "cf5")
    assert pairing.feed(CT, None, "ct4") == PairStep(("cf5", "ct4"), None, None)
    pairing.feed(CF, "k", "cf6")
    assert pairing.release() == "cf6"  # held over, or unpaired at the end: the caller's call
    assert pairing.release() is None
    assert pairing.feed(A, "k", "a2").unit == ("a2",)


def test_a_pair_step_names_its_problem() -> None:
    assert PairStep(("x",), None, None).problem is None
    assert PairStep(None, None, None).problem is None
    assert PairStep(("x",), "cf", None).problem is Reason.UNPAIRED_CORRECT_FROM
    assert PairStep(None, None, "ct").problem is Reason.ORPHAN_CORRECT_TO
    assert PairStep(None, "cf", "ct").problem is Reason.PAIR_KEY_DIFFERS
