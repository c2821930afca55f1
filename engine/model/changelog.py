"""The changelog model (Open Data Fabric RFC-015): op codes and events as values.

A changelog stream describes a multiset of rows. `+A` and `+C` add one copy of a
row; `-R` and `-C` remove one copy of an equal row (all non-system columns
equal). A `-C` is immediately followed, in the same partition, by its `+C` for
the same key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, NamedTuple, TypeVar

import orjson

from refold.model.reasons import Reason

SYSTEM_COLUMNS = frozenset({"op", "event_time", "offset", "system_time"})

T = TypeVar("T")


class Op(IntEnum):
    """The `op` system column. Arrow `uint8`, Parquet `INT32`, Avro `int`."""

    APPEND = 0
    RETRACT = 1
    CORRECT_FROM = 2
    CORRECT_TO = 3

    @property
    def code(self) -> str:
        return _CODES[self]

    @property
    def diff(self) -> int:
        """+1 for the ops that add a copy of a row, -1 for the ops that remove one."""
        return 1 if self in (Op.APPEND, Op.CORRECT_TO) else -1

    @property
    def adds(self) -> bool:
        return self in (Op.APPEND, Op.CORRECT_TO)

    @classmethod
    def parse(cls, value: object) -> Op:
        """Accept the code (`"+A"`), the number (`0`) or its string (`"0"`).

        Raises ValueError naming the bad value otherwise.
        """
        if isinstance(value, Op):
            return value
        if isinstance(value, bool):
            raise ValueError(f"op must be one of +A, -R, -C, +C or 0..3, got {value!r}")
        if isinstance(value, int):
            if 0 <= value <= 3:
                return cls(value)
        elif isinstance(value, str):
            found = _BY_CODE.get(value)
            if found is not None:
                return found
        raise ValueError(f"op must be one of +A, -R, -C, +C or 0..3, got {value!r}")


_CODES = {Op.APPEND: "+A", Op.RETRACT: "-R", Op.CORRECT_FROM: "-C", Op.CORRECT_TO: "+C"}
_BY_CODE: dict[str, Op] = {code: op for op, code in _CODES.items()}
_BY_CODE.update({str(int(op)): op for op in Op})


@dataclass(frozen=True, slots=True)
class ChangelogEvent:
    """One changelog event: an op, the row it adds or removes, and its event time.

    `row` holds the non-system columns only. `event_time` is epoch milliseconds.
    """

    op: Op
    row: Mapping[str, Any]
    event_time: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The flat JSON-lines form: `op` as its code, system columns beside the row."""
        out: dict[str, Any] = {"op": self.op.code}
        if self.event_time is not None:
            out["event_time"] = self.event_time
        out.update(self.row)
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ChangelogEvent:
        """Build an event from a flat mapping with an `op` field.

        Raises ValueError (op missing or out of range, event_time not an integer).
        """
        if "op" not in record:
            raise ValueError("missing field 'op'")
        op = Op.parse(record["op"])
        event_time = record.get("event_time")
        if event_time is not None and (
            not isinstance(event_time, int) or isinstance(event_time, bool)
        ):
            raise ValueError(f"event_time must be epoch milliseconds (an integer), got {event_time!r}")
        row = {k: v for k, v in record.items() if k not in SYSTEM_COLUMNS}
        return cls(op, row, event_time)


def key_of(row: Mapping[str, Any], key_columns: Sequence[str]) -> tuple[Any, ...]:
    """The key tuple of a row. Raises KeyError/ValueError for a missing or null key column."""
    values = []
    for column in key_columns:
        if column not in row:
            raise KeyError(f"key column {column!r} is missing")
        value = row[column]
        if value is None:
            raise ValueError(f"key column {column!r} is null")
        values.append(value)
    return tuple(values)


def message_key_bytes(key_columns: Sequence[str], key: Sequence[Any]) -> bytes:
    """The Kafka message key Refold writes and expects: the JSON object of the key
    columns, in their order (`refold produce --key`; a co-partitioned view's check)."""
    return orjson.dumps(dict(zip(key_columns, key, strict=True)))


class PairStep(NamedTuple, Generic[T]):
    """What one event fed to a `Pairing` completes.

    - `unit`: ready to apply: the event alone, or a `-C` and its `+C`.
    - `unpaired`: the held `-C`, when this event is not its `+C`
      (`Reason.UNPAIRED_CORRECT_FROM`).
    - `orphan`: this event, a `+C` with no `-C` of its key right before it
      (`Reason.ORPHAN_CORRECT_TO`). With `unpaired` too, the `+C` followed a `-C` of
      another key.
    """

    unit: tuple[T] | tuple[T, T] | None
    unpaired: T | None
    orphan: T | None

    @property
    def problem(self) -> Reason | None:
        """The step's problem as one reason, for a writer that stops at the first."""
        if self.orphan is not None:
            return Reason.PAIR_KEY_DIFFERS if self.unpaired is not None else Reason.ORPHAN_CORRECT_TO
        if self.unpaired is not None:
            return Reason.UNPAIRED_CORRECT_FROM
        return None


class Pairing(Generic[T]):
    """The `-C`/`+C` rule over one partition's events, in offset order: every `-C` is
    immediately followed by its `+C` for the same key (keys compare with `==`: a Kafka
    message key, a tuple of key columns).

    `feed(op, key, item)` takes the next event; `item` is what the caller gets back
    (never None). A `-C` is held until the next event decides on it. After a broken
    pair the next event is judged on its own, so one bad event refuses nothing more.
    `release()` returns the held `-C` and forgets it: at the end of the input, or when
    the next event cannot be read (so cannot be its `+C`).
    """

    __slots__ = ("_held", "_held_key")

    def __init__(self) -> None:
        self._held: T | None = None
        self._held_key: object = None

    def feed(self, op: Op, key: object, item: T) -> PairStep[T]:
        held = self._held
        if held is not None:
            self._held = None
            if op is Op.CORRECT_TO:
                if key == self._held_key:
                    return PairStep((held, item), None, None)
                return PairStep(None, held, item)
        if op is Op.CORRECT_TO:
            return PairStep(None, None, item)
        if op is Op.CORRECT_FROM:
            self._held, self._held_key = item, key
            return PairStep(None, held, None)
        return PairStep((item,), held, None)

    @property
    def idle(self) -> bool:
        """Nothing held: a `+A` or `-R` fed now is a unit of its own and settles nothing
        (what `feed` would return as `PairStep((item,), None, None)`)."""
        return self._held is None

    def release(self) -> T | None:
        held, self._held = self._held, None
        return held


class PairingValidator:
    """`Pairing` for a writer that refuses the input at its first bad event (`refold
    produce`): `feed` returns None while the events are fine, else the reason;
    `finish` returns a reason when the input ends on an unpaired `-C`."""

    __slots__ = ("_pairing",)

    def __init__(self) -> None:
        self._pairing: Pairing[tuple[Any, ...]] = Pairing()

    def feed(self, op: Op, key: tuple[Any, ...]) -> Reason | None:
        return self._pairing.feed(op, key, key).problem

    def finish(self) -> Reason | None:
        return Reason.UNPAIRED_AT_END if self._pairing.release() is not None else None


def canonical_row(row: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a row: JSON with sorted keys, its null columns left out.
    Two rows are *equal* (a retraction matches a live copy) exactly when their
    canonical bytes are equal: so `1` and `1.0` are different values, as they are on
    the wire, and a column that is null equals a column the row does not have (a row
    written before a producer's schema gained an optional field equals the same row
    written after it, with that field null).
    """
    if None in row.values():
        row = {column: value for column, value in row.items() if value is not None}
    return orjson.dumps(row, option=orjson.OPT_SORT_KEYS)


def legacy_canonical_row(row: Mapping[str, Any]) -> bytes | None:
    """The canonical bytes Refold gave a row with null columns before a null column
    equalled an absent one (state records written then are named by them); None when
    the row has no null column (its bytes never changed)."""
    if None not in row.values():
        return None
    return orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
