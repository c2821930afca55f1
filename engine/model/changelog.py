"""The changelog model (Open Data Fabric RFC-015): op codes and events as values.

A changelog stream describes a multiset of rows. `+A` and `+C` add one copy of a
row; `-R` and `-C` remove one copy of an equal row (all non-system columns
equal). A `-C` is immediately followed, in the same partition, by its `+C` for
the same key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import orjson

from refold.model.reasons import Reason

SYSTEM_COLUMNS = frozenset({"op", "event_time", "offset", "system_time"})


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


@dataclass(slots=True)
class PairingValidator:
    """Checks, event by event, that every `-C` is immediately followed by its `+C`
    for the same key, and that no `+C` comes without its `-C`.

    Feed events of one partition in offset order. `feed` returns None when the
    event is fine so far, or a reason string when it breaks the rule. `finish`
    returns a reason when the stream ends on an unpaired `-C`.
    """

    pending_key: tuple[Any, ...] | None = field(default=None)
    pending: bool = False

    def feed(self, op: Op, key: tuple[Any, ...]) -> str | None:
        if self.pending:
            self.pending = False
            pending_key, self.pending_key = self.pending_key, None
            if op is not Op.CORRECT_TO:
                return Reason.UNPAIRED_CORRECT_FROM
            if key != pending_key:
                return Reason.PAIR_KEY_DIFFERS
            return None
        if op is Op.CORRECT_TO:
            return Reason.ORPHAN_CORRECT_TO
        if op is Op.CORRECT_FROM:
            self.pending = True
            self.pending_key = key
        return None

    def finish(self) -> str | None:
        if self.pending:
            self.pending = False
            self.pending_key = None
            return Reason.UNPAIRED_AT_END
        return None


def live_rows(events: Iterable[ChangelogEvent]) -> dict[bytes, int]:
    """The multiset of live rows a changelog describes: canonical row → count.

    Raises ValueError if an event removes a row that is not live.
    """
    live: dict[bytes, int] = {}
    for event in events:
        canon = canonical_row(event.row)
        if event.op.adds:
            live[canon] = live.get(canon, 0) + 1
        else:
            count = live.get(canon, 0)
            if count == 0:
                raise ValueError(f"{event.op.code} of a row that is not live")
            if count == 1:
                del live[canon]
            else:
                live[canon] = count - 1
    return live


def canonical_row(row: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a row: JSON with sorted keys. Two rows are *equal*
    (a retraction matches a live copy) exactly when their canonical bytes are equal;
    so `1` and `1.0` are different values, as they are on the wire.
    """
    return orjson.dumps(row, option=orjson.OPT_SORT_KEYS)


def iter_pairs(events: Sequence[ChangelogEvent]) -> Iterator[tuple[ChangelogEvent, ...]]:
    """Group a valid changelog into units: each `-C`/`+C` pair is one unit, others alone."""
    i = 0
    while i < len(events):
        if events[i].op is Op.CORRECT_FROM and i + 1 < len(events):
            yield (events[i], events[i + 1])
            i += 2
        else:
            yield (events[i],)
            i += 1
