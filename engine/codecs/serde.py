"""Event codecs: the bytes of a Kafka record value ⇄ a `ChangelogEvent`.

A codec has `decode(value, source)`, `decode_many(values, offsets, ...)` and
`encode(event)`. Decoding is on the engine's hot path: the codecs do one
orjson/fastavro call per record and little else, and `decode_many` returns bad
records as error values in place instead of raising, so a batch goes on.

Failures keep the raw bytes and the record's position (`RecordSource`) and have a
machine-stable `reason` (it becomes the dead-letter header `refold.reason`):

| reason | error | when |
|---|---|---|
| `undecodable` | `DecodeError` | null value (tombstone), not JSON, not a JSON object, bytes that are not one Avro record of the schema |
| `schema mismatch` | `DecodeError` | a JSON event without `op`, or with an `event_time` that is neither epoch ms nor ISO-8601 |
| `op out of range` | `InvalidEventError` | `op` not one of `+A -R -C +C` / `0..3` |

Encoding raises `ValueError` for an event that does not fit (a row with a system
column, a row that is not JSON, a row that does not match the Avro schema).

Avro event schemas are the user's record schemas with the system fields of
`schemas/avro/event_system.avsc` (`op`, `event_time`); see `with_system_fields` and
`check_system_fields`. Records are encoded schemaless (no container header, no
registry prefix): producer and consumer share the schema file.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from io import BytesIO
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

import orjson
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.repository.base import SchemaRepositoryError
from fastavro.schema import SchemaParseException
from fastavro.schema import load_schema as _fastavro_load_schema

from refold.errors import ConfigError, DecodeError, InvalidEventError, RecordError, RecordSource
from refold.model.changelog import SYSTEM_COLUMNS, ChangelogEvent, Op
from refold.model.reasons import Reason

# Names of the system fields an Avro event schema may carry, and the ones it must not.
_EVENT_SYSTEM_FIELDS: Final = ("op", "event_time")
_RESERVED_FIELDS: Final = frozenset(SYSTEM_COLUMNS) - set(_EVENT_SYSTEM_FIELDS)


# Schemas ---------------------------------------------------------------------------


def schema_dir() -> Path:
    """Refold's Avro schemas: the package `refold.schemas`, which is the repository's
    `schemas/avro` in a checkout and ships inside an installed wheel."""
    return Path(str(importlib.resources.files("refold.schemas")))


def schema_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A path as given, or a schema of `schema_dir()` by name (`"checkpoint"` or
    `"checkpoint.avsc"`) when the name has no directory part and no such file exists."""
    path = Path(name_or_path)
    if path.parent == Path(".") and not path.exists():
        return schema_dir() / (path.name if path.suffix == ".avsc" else f"{path.name}.avsc")
    return path


def load_schema(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed (fastavro) record schema of a file or of a named Refold schema.

    Cached per resolved path: treat the result as read-only. Named types defined
    in sibling `.avsc` files resolve as fastavro's `load_schema` does. Raises
    ConfigError for a missing or invalid schema.
    """
    return _load_parsed(str(schema_path(name_or_path).resolve()))


@functools.cache
def _load_parsed(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError("cannot read Avro schema: no such file", where=path)
    try:
        parsed = _fastavro_load_schema(path)
    except (OSError, SchemaRepositoryError) as exc:  # the file or a named type's sibling file
        raise ConfigError(f"cannot read Avro schema: {exc}", where=path) from exc
    except (ValueError, SchemaParseException) as exc:  # bad JSON, unknown type, bad schema
        raise ConfigError(f"not a valid Avro schema: {exc}", where=path) from exc
    if not isinstance(parsed, dict):
        raise ConfigError("the schema must be an Avro record", where=path)
    return parsed


def load_raw_schema(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of a schema file as written (not parsed by fastavro). Raises ConfigError."""
    path = schema_path(name_or_path)
    try:
        raw = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read Avro schema: {exc.strerror}", where=str(path)) from exc
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"not JSON: {exc}", where=str(path)) from exc
    if not isinstance(raw, dict):
        raise ConfigError("the schema must be an Avro record (a JSON object)", where=str(path))
    return raw


@functools.cache
def _system_fields() -> tuple[dict[str, Any], ...]:
    return tuple(load_raw_schema("event_system")["fields"])


def with_system_fields(row_schema: Mapping[str, Any]) -> dict[str, Any]:
    """A full event schema from a record schema of row fields: the same record with
    the system fields `op` and `event_time` (nullable timestamp-millis) in front.

    Raises ConfigError when the row schema is not a record or already uses a
    system column name.
    """
    name = str(row_schema.get("name", "?"))
    fields = _record_fields(row_schema, name)
    for field in fields:
        if field.get("name") in SYSTEM_COLUMNS:
            raise ConfigError(f"row field {field.get('name')!r} is a system column name", where=name)
    out = dict(row_schema)
    out["fields"] = [dict(f) for f in _system_fields()] + [dict(f) for f in fields]
    return out


def check_system_fields(schema: Mapping[str, Any]) -> None:
    """Check that an Avro event schema (as written, not parsed) has compatible system
    fields: `op` an `int`; `event_time`, if present, a `long` or a nullable `long`,
    plain or `timestamp-millis`; no field named `offset` or `system_time`.

    Raises ConfigError naming the schema and the problem.
    """
    name = str(schema.get("name", "?"))
    fields = {f.get("name"): f for f in _record_fields(schema, name)}
    if "op" not in fields:
        raise ConfigError(
            "no field 'op': an event schema needs the system fields of "
            "schemas/avro/event_system.avsc (see refold.codecs.serde.with_system_fields)",
            where=name,
        )
    if not _is_plain(fields["op"].get("type"), "int"):
        raise ConfigError(f"field 'op' must be an Avro int, got {fields['op'].get('type')!r}", where=name)
    if "event_time" in fields:
        kind = fields["event_time"].get("type")
        branches = kind if isinstance(kind, list) else [kind]
        non_null = [b for b in branches if b != "null"]
        if len(non_null) != 1 or len(branches) - len(non_null) > 1 or not _is_millis(non_null[0]):
            raise ConfigError(
                "field 'event_time' must be a long (optionally nullable, optionally "
                f"logicalType timestamp-millis), got {kind!r}",
                where=name,
            )
    reserved = sorted(_RESERVED_FIELDS & fields.keys())
    if reserved:
        raise ConfigError(f"field {reserved[0]!r} is a system column that outputs add; rename it", where=name)


def _record_fields(schema: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    if schema.get("type") != "record" or not isinstance(schema.get("fields"), list):
        raise ConfigError("an event schema must be an Avro record with fields", where=name)
    fields = schema["fields"]
    if not all(isinstance(f, Mapping) for f in fields):
        raise ConfigError("every field must be a JSON object", where=name)
    return fields


def _is_plain(kind: object, primitive: str) -> bool:
    if kind == primitive:
        return True
    return isinstance(kind, Mapping) and kind.get("type") == primitive and "logicalType" not in kind


def _is_millis(kind: object) -> bool:
    if _is_plain(kind, "long"):
        return True
    return isinstance(kind, Mapping) and kind.get("type") == "long" and kind.get("logicalType") == "timestamp-millis"


def _strip_logical_types(schema: Any) -> Any:
    """The same schema without `logicalType`s: same bytes on the wire, but fastavro
    then returns (and accepts) the underlying primitives: epoch ms for
    timestamp-millis, days for date, a str for uuid."""
    if isinstance(schema, list):
        return [_strip_logical_types(s) for s in schema]
    if isinstance(schema, Mapping):
        return {k: _strip_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    return schema


def _check_row_types(schema: Any, where: str) -> None:
    """Rows are JSON values (they are compared by their canonical JSON bytes): reject
    Avro `bytes` and `fixed` (and so `decimal`) anywhere in the row fields."""
    if isinstance(schema, list):
        for branch in schema:
            _check_row_types(branch, where)
    elif isinstance(schema, Mapping):
        kind = schema.get("type")
        if kind in ("bytes", "fixed"):
            raise ConfigError(
                f"row field type {kind!r} is not supported: rows are JSON values "
                "(use a string, e.g. base64)",
                where=where,
            )
        if kind == "record":
            for field in schema.get("fields", []):
                _check_row_types(field.get("type"), f"{where}.{field.get('name')}")
        elif kind == "array":
            _check_row_types(schema.get("items"), where)
        elif kind == "map":
            _check_row_types(schema.get("values"), where)
        elif isinstance(kind, (list, Mapping)):
            _check_row_types(kind, where)
    elif schema in ("bytes", "fixed"):
        _check_row_types({"type": schema}, where)


# Codecs ----------------------------------------------------------------------------


class Codec(Protocol):
    """Turns record values into events and back. Implementations are stateless
    after construction and may be shared."""

    format: ClassVar[str]

    def decode(self, value: bytes | None, source: RecordSource) -> ChangelogEvent:
        """One event. Raises DecodeError / InvalidEventError (a RecordError) that keeps
        `value` and `source`."""
        ...

    def decode_many(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[ChangelogEvent | RecordError]:
        """One event or one RecordError per value, in order. `offsets[i]` is the
        offset of `values[i]` (its index when not given); errors name
        `topic[partition]@offset`."""
        ...

    def encode(self, event: ChangelogEvent) -> bytes:
        """The record value of an event. Raises ValueError when it does not fit."""
        ...


class _Reject(Exception):
    """A bad record, before its source is known (built only on the error path)."""

    def __init__(self, kind: type[RecordError], reason: str, detail: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.detail = detail

    def error(self, value: bytes | None, source: RecordSource) -> RecordError:
        error = self.kind(self.reason, source, detail=self.detail, value=value)
        error.__cause__ = self.__cause__
        return error


def _tombstone() -> _Reject:
    return _Reject(DecodeError, Reason.UNDECODABLE, "null value (a tombstone)")


_MISSING: Final = object()
_OPS: Final[dict[object, Op]] = {
    **{op.code: op for op in Op},
    **{int(op): op for op in Op},
    **{str(int(op)): op for op in Op},
}
_OP_BY_INT: Final = tuple(Op)
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS: Final = timedelta(milliseconds=1)


def _decode_many(
    decode_one: Any,
    values: Sequence[bytes | None],
    offsets: Sequence[int] | None,
    topic: str | None,
    partition: int | None,
) -> list[ChangelogEvent | RecordError]:
    out: list[ChangelogEvent | RecordError] = []
    append = out.append
    for index, value in enumerate(values):
        try:
            if value is None:
                raise _tombstone()
            append(decode_one(value))
        except _Reject as bad:
            offset = offsets[index] if offsets is not None else index
            append(bad.error(value, RecordSource(topic, partition, offset)))
    return out


def event_time_from_iso(text: str) -> int:
    """Epoch milliseconds of an ISO-8601 date-time (UTC when it has no offset),
    truncated to the millisecond. Raises ValueError."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // _ONE_MS


class JsonlCodec:
    """One JSON object per record value: `op` (code or number), optional
    `event_time` (epoch ms, or an ISO-8601 string, converted to ms), row columns.

    Fields `offset` and `system_time` are output system columns: dropped on input.
    `encode` writes `op` as its code, then `event_time` (when set), then the row.
    """

    format: ClassVar[str] = "jsonl"

    def decode(self, value: bytes | None, source: RecordSource) -> ChangelogEvent:
        try:
            if value is None:
                raise _tombstone()
            return self._decode(value)
        except _Reject as bad:
            raise bad.error(value, source) from bad.__cause__

    def decode_many(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[ChangelogEvent | RecordError]:
        return _decode_many(self._decode, values, offsets, topic, partition)

    @staticmethod
    def _decode(value: bytes) -> ChangelogEvent:
        try:
            record = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise _Reject(DecodeError, Reason.UNDECODABLE, f"not JSON: {exc}") from exc
        if type(record) is not dict:
            raise _Reject(DecodeError, Reason.UNDECODABLE, f"not a JSON object but a JSON {type(record).__name__}")
        raw_op = record.pop("op", _MISSING)
        kind = type(raw_op)
        op = _OPS.get(raw_op) if kind is str or kind is int else None
        if op is None:
            if raw_op is _MISSING:
                raise _Reject(DecodeError, Reason.SCHEMA_MISMATCH, "missing field 'op'")
            raise _Reject(
                InvalidEventError, Reason.OP_OUT_OF_RANGE, f"op must be one of +A, -R, -C, +C or 0..3, got {raw_op!r}"
            )
        event_time = record.pop("event_time", None)
        if event_time is not None and type(event_time) is not int:
            event_time = _json_event_time(event_time)
        if "offset" in record or "system_time" in record:
            record.pop("offset", None)
            record.pop("system_time", None)
        return ChangelogEvent(op, record, event_time)

    def encode(self, event: ChangelogEvent) -> bytes:
        _check_row(event)
        record: dict[str, Any] = {"op": event.op.code}
        if event.event_time is not None:
            record["event_time"] = event.event_time
        record.update(event.row)
        try:
            return orjson.dumps(record)
        except orjson.JSONEncodeError as exc:
            raise ValueError(f"the event's row is not JSON: {exc}") from exc


def _json_event_time(value: object) -> int:
    if isinstance(value, str):
        try:
            return event_time_from_iso(value)
        except ValueError as exc:
            raise _Reject(DecodeError, Reason.SCHEMA_MISMATCH, f"event_time is not ISO-8601: {value!r}") from exc
    raise _Reject(
        DecodeError,
        Reason.SCHEMA_MISMATCH,
        f"event_time must be epoch milliseconds (an integer) or an ISO-8601 string, got {value!r}",
    )


def _check_row(event: ChangelogEvent) -> None:
    if not SYSTEM_COLUMNS.isdisjoint(event.row):
        clash = sorted(SYSTEM_COLUMNS.intersection(event.row))
        raise ValueError(f"the event's row has system columns {clash}: rows hold non-system columns only")


class AvroCodec:
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
            if field.get("name") not in _EVENT_SYSTEM_FIELDS:
                _check_row_types(field.get("type"), f"{self.name}.{field.get('name')}")
        self.schema: dict[str, Any] = raw
        try:
            self._parsed = parse_schema(_strip_logical_types(raw))
        except (ValueError, SchemaParseException) as exc:
            raise ConfigError(f"not a valid Avro schema: {exc}", where=self.name) from exc
        self._has_event_time = any(f.get("name") == "event_time" for f in raw["fields"])

    def decode(self, value: bytes | None, source: RecordSource) -> ChangelogEvent:
        try:
            if value is None:
                raise _tombstone()
            return self._decode(value)
        except _Reject as bad:
            raise bad.error(value, source) from bad.__cause__

    def decode_many(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[ChangelogEvent | RecordError]:
        return _decode_many(self._decode, values, offsets, topic, partition)

    def _decode(self, value: bytes) -> ChangelogEvent:
        stream = BytesIO(value)
        try:
            record = schemaless_reader(stream, self._parsed, None)
        except Exception as exc:  # any failure to read means: not one record of this schema
            raise _Reject(
                DecodeError, Reason.UNDECODABLE, f"not an Avro {self.name} record: {type(exc).__name__}: {exc}"
            ) from exc
        left = len(value) - stream.tell()
        if left:
            raise _Reject(DecodeError, Reason.UNDECODABLE, f"{left} bytes left over after an Avro {self.name} record")
        assert isinstance(record, dict)
        op = record.pop("op")
        if not 0 <= op <= 3:
            raise _Reject(InvalidEventError, Reason.OP_OUT_OF_RANGE, f"op must be 0..3, got {op!r}")
        event_time = record.pop("event_time") if self._has_event_time else None
        return ChangelogEvent(_OP_BY_INT[op], record, event_time)

    def encode(self, event: ChangelogEvent) -> bytes:
        _check_row(event)
        record = dict(event.row)
        record["op"] = int(event.op)
        if self._has_event_time:
            record["event_time"] = event.event_time
        stream = BytesIO()
        try:
            schemaless_writer(stream, self._parsed, record, strict_allow_default=True)
        except Exception as exc:  # fastavro raises ValueError, TypeError, struct.error, OverflowError...
            raise ValueError(f"the event does not fit Avro schema {self.name}: {exc}") from exc
        return stream.getvalue()


def codec_for(format: str, schema_path: str | os.PathLike[str] | None = None) -> Codec:
    """The codec of a source or output `format`: `jsonl` (no schema), or `avro` with the
    path of its event schema. Raises ConfigError."""
    if format == "jsonl":
        return JsonlCodec()
    if format == "avro":
        if schema_path is None:
            raise ConfigError("format avro needs schema: path/to/schema.avsc", where="format")
        return AvroCodec(schema_path)
    raise ConfigError(f"unknown format {format!r}; expected jsonl or avro", where="format")
