"""The decoding contract every codec shares: one bad-record exception, one loop.

Two kinds of decoder:

- a `SourceDecoder` (what the engine calls, once per partition per batch) turns
  each record value into its events: zero, one or two for Debezium (a tombstone
  gives none, an update a `-C`/`+C` pair);
- a `Codec` (JSON lines, schemaless Avro) is a SourceDecoder of exactly one event
  per record that also encodes an event back into bytes.

An implementation writes one method for one value, `_events_of`, that raises
`BadRecord` for a bad one; `decode_records`, `decode` and `decode_many` are
defined here, once, on the one loop `decode_each`. A bad record never
stops a batch: it comes back in place as a `RecordError` that keeps the raw bytes,
the record's position (`RecordSource`) and a machine-stable `reason` (the
dead-letter header `refold.reason`):

| reason | error | when |
|---|---|---|
| `undecodable` | `DecodeError` | a null value where events are expected (a tombstone), bytes that are not JSON / not a JSON object / not exactly one Avro record of the schema, not the registry wire format, an unknown schema id |
| `schema mismatch` | `DecodeError` | a JSON event without `op` or with an `event_time` that is neither epoch ms nor ISO-8601; a Debezium envelope that does not describe a change |
| `op out of range` | `InvalidEventError` | `op` not one of `+A -R -C +C` / `0..3` |

Anything else a per-value method raises (a schema registry that does not
answer: `PrerequisiteError`) is not about the record: it leaves the batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import orjson

from refold.errors import DecodeError, RecordError, RecordSource
from refold.model.changelog import SYSTEM_COLUMNS, ChangelogEvent
from refold.model.reasons import Reason


class BadRecord(Exception):
    """A bad record, raised by a per-value decode method before the record's position
    is known; `decode_each` turns it into `kind(reason, source, detail, value)`.

    Built only on the error path. Raise it `from` the parser's exception: the
    RecordError keeps that as its `__cause__`. Never let it leave refold.codecs.
    """

    def __init__(self, reason: Reason, detail: str, kind: type[RecordError] = DecodeError) -> None:
        super().__init__(reason, detail)
        self.kind = kind
        self.reason = reason
        self.detail = detail

    @classmethod
    def tombstone(cls) -> BadRecord:
        """A null value where a codec expects an event."""
        return cls(Reason.UNDECODABLE, "null value (a tombstone)")

    def error(self, value: bytes | None, source: RecordSource) -> RecordError:
        """The RecordError of the record `value` read at `source`, chained to this one's cause."""
        error = self.kind(self.reason, source, detail=self.detail, value=value)
        error.__cause__ = self.__cause__
        return error


def json_object(value: bytes) -> dict[str, Any] | None:
    """A JSON object's fields (None for JSON `null`). Raises BadRecord (`undecodable`)
    for bytes that are not JSON, or JSON that is neither an object nor null."""
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadRecord(Reason.UNDECODABLE, f"not JSON: {exc}") from exc
    if parsed is not None and type(parsed) is not dict:
        raise BadRecord(Reason.UNDECODABLE, f"not a JSON object but a JSON {type(parsed).__name__}")
    return parsed


def decode_each(
    events_of: Callable[[bytes | None], list[ChangelogEvent]],
    values: Sequence[bytes | None],
    offsets: Sequence[int] | None,
    topic: str | None,
    partition: int | None,
) -> list[list[ChangelogEvent] | RecordError]:
    """`events_of(value)` per value, in order, or the RecordError of its BadRecord, whose
    source is `topic[partition]@offsets[i]` (the index `i` when `offsets` is None).

    The one decode loop of the codecs: it adds a `try` and an `append` per record,
    nothing else, so keep `events_of` the only call per value.
    """
    out: list[list[ChangelogEvent] | RecordError] = []
    append = out.append
    for index, value in enumerate(values):
        try:
            append(events_of(value))
        except BadRecord as bad:
            offset = offsets[index] if offsets is not None else index
            append(bad.error(value, RecordSource(topic, partition, offset)))
    return out


class SourceDecoder(ABC):
    """What the engine reads a source with: record values → their events."""

    def decode_records(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[list[ChangelogEvent] | RecordError]:
        """Per value, in order: its events, in order (`[]`: nothing to apply, e.g. a
        Debezium tombstone), or a RecordError naming `topic[partition]@offset`
        (`offsets[i]` is the offset of `values[i]`, its index when not given) and
        keeping the raw bytes. Never raises for bad bytes."""
        return decode_each(self._events_of, values, offsets, topic, partition)

    @abstractmethod
    def _events_of(self, value: bytes | None) -> list[ChangelogEvent]:
        """The events of one value, each row a fresh dict the caller may keep.
        Raises BadRecord. The hot path: one parser call and little else."""


class Codec(SourceDecoder):
    """One record value ⇄ one event, in one format. Stateless after construction
    (may be shared across threads).

    `_events_of` returns a one-element list (a bad value raises BadRecord, a
    tombstone too): the shape the engine's `decode_records` wants, built where
    the event is made so that the engine's path has no extra step per record.
    """

    format: ClassVar[str]

    def decode(self, value: bytes | None, source: RecordSource) -> ChangelogEvent:
        """One event. Raises DecodeError / InvalidEventError (a RecordError) that keeps
        `value` and `source`."""
        try:
            return self._events_of(value)[0]
        except BadRecord as bad:
            raise bad.error(value, source) from bad.__cause__

    def decode_many(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[ChangelogEvent | RecordError]:
        """One event or one RecordError per value, in order, as `decode_records`
        (which the engine uses: it is the faster of the two)."""
        decoded = self.decode_records(values, offsets, topic=topic, partition=partition)
        return [result if isinstance(result, RecordError) else result[0] for result in decoded]

    @abstractmethod
    def encode(self, event: ChangelogEvent) -> bytes:
        """The record value of an event. Raises ValueError when it does not fit."""


def check_row(event: ChangelogEvent) -> None:
    """For encoders: raise ValueError when the event's row has a system column."""
    if not SYSTEM_COLUMNS.isdisjoint(event.row):
        clash = sorted(SYSTEM_COLUMNS.intersection(event.row))
        raise ValueError(f"the event's row has system columns {clash}: rows hold non-system columns only")
