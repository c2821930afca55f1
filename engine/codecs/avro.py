"""Format `avro` without a registry: schemaless Avro records of one event schema.

No container header, no registry prefix: producer and consumer share the schema
file. The event schema is the user's record schema with the system fields `op`
(int 0..3) and optionally `event_time` (see `refold.codecs.schemas`). With a
schema registry, the same records travel in the Confluent wire format
(`refold.codecs.registry`), read by the same `AvroEvents`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from io import BytesIO
from typing import Any, ClassVar, Final

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError

from refold.codecs.base import BadRecord, Codec, check_row
from refold.codecs.schemas import (
    EVENT_SYSTEM_FIELDS,
    check_row_types,
    check_system_fields,
    load_raw_schema,
    parse_row_schema,
)
from refold.errors import InvalidEventError
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason

_OP_BY_INT: Final = tuple(Op)


def read_one(value: bytes, writer: Any, reader: Any, what: str) -> dict[str, Any]:
    """The one record of `writer` (resolved to `reader` unless None) that `value` is.
    Raises BadRecord: `undecodable` (not such a record, or bytes left over after it),
    `schema mismatch` (a record of `writer` that Avro's resolution rules cannot read as
    `reader`: a field's type changed, a field without a default removed)."""
    stream = BytesIO(value)
    try:
        record = schemaless_reader(stream, writer, reader)
    except SchemaResolutionError as exc:  # read fine, but not as the reader schema: an incompatible change
        raise BadRecord(Reason.SCHEMA_MISMATCH, f"{what} cannot be read as the reader schema (an incompatible "
                        f"schema change): {exc}") from exc
    except Exception as exc:  # any other failure to read means: not one record of this schema
        raise BadRecord(Reason.UNDECODABLE, f"not {what}: {type(exc).__name__}: {exc}") from exc
    left = len(value) - stream.tell()
    if left:
        raise BadRecord(Reason.UNDECODABLE, f"{left} bytes left over after {what}")
    assert isinstance(record, dict)
    return record


class AvroEvents:
    """Reads events from schemaless Avro records of one `writer` schema (resolved to
    `reader` unless None), both parsed by `parse_row_schema` and with an int `op`.
    `what` names the schema in details ("an Avro Score record")."""

    def __init__(self, writer: Any, reader: Any, what: str) -> None:
        self._writer = writer
        self._reader = reader
        self._what = what

    def read(self, value: bytes | None) -> list[ChangelogEvent]:
        """The event of `value`, which must be exactly one record, as a one-element
        list (a Codec's `_events_of`). Raises BadRecord: `undecodable` for a
        tombstone or bytes that are not one record (the detail says `not {what}`, or
        how many bytes were left over after `{what}`); `op out of range`."""
        if value is None:
            raise BadRecord.tombstone()
        record = read_one(value, self._writer, self._reader, self._what)
        op = record.pop("op")
        if not 0 <= op <= 3:
            raise BadRecord(Reason.OP_OUT_OF_RANGE, f"op must be 0..3, got {op!r}", InvalidEventError)
        return [ChangelogEvent(_OP_BY_INT[op], record, record.pop("event_time", None))]


class AvroCodec(AvroEvents, Codec):
    """Schemaless Avro records of one event schema (the user's record schema with the
    system fields `op`, int 0..3, and optionally `event_time`).

    `schema` is the schema as written (a JSON object) or a path to an `.avsc` file.
    Logical types decode as their underlying primitives (timestamp-millis as epoch
    ms, date as days, uuid as a string): rows are JSON values, so row fields may not
    be `bytes`/`fixed`/`decimal`. Raises ConfigError for an unusable schema.

    `event_time` is written when the schema has it and dropped otherwise (the Kafka
    record timestamp then carries it).
    """

    format: ClassVar[str] = "avro"

    def __init__(self, schema: Mapping[str, Any] | str | os.PathLike[str]) -> None:
        raw = dict(schema) if isinstance(schema, Mapping) else load_raw_schema(schema)
        self.name = str(raw.get("name", "?"))
        check_system_fields(raw)
        for field in raw["fields"]:
            if field.get("name") not in EVENT_SYSTEM_FIELDS:
                check_row_types(field.get("type"), f"{self.name}.{field.get('name')}")
        self.schema: dict[str, Any] = raw
        super().__init__(parse_row_schema(raw, self.name), None, f"an Avro {self.name} record")
        self._has_event_time = any(f.get("name") == "event_time" for f in raw["fields"])

    _events_of = AvroEvents.read  # the codec's one call per value

    def encode(self, event: ChangelogEvent) -> bytes:
        check_row(event)
        record = dict(event.row)
        record["op"] = int(event.op)
        if self._has_event_time:
            record["event_time"] = event.event_time
        stream = BytesIO()
        try:
            schemaless_writer(stream, self._writer, record, strict_allow_default=True)
        except Exception as exc:  # fastavro raises ValueError, TypeError, struct.error, OverflowError...
            raise ValueError(f"the event does not fit Avro schema {self.name}: {exc}") from exc
        return stream.getvalue()

