"""The bytes of an upsert source (`source.form: upsert`): message key → latest row.

A record's key is the JSON object of the message-key columns (as Refold's own
upsert outputs and `refold produce --key` write it; another spacing or field order
is the same key); its value is the whole row, without `op`, as a JSON object
(`jsonl`) or a schemaless Avro record of the row's schema (`avro`); a null value
(a tombstone) deletes the key. What the records mean as a changelog is the
engine's (`refold.runtime.upsert`) and the reference's business, not the codec's.

`UpsertDecoder.decode(key, value)` gives the record's `UpsertRecord` (the key's
values, the row or None, the event time) or raises BadRecord:

| reason | when |
|---|---|
| `null key` | the record has no key |
| `key mismatch` | the key is not a JSON object with every message-key column, or the row's own key columns say otherwise |
| `undecodable`, `schema mismatch` | the value is not a row of the format; a JSON row with `op` (a changelog event, not a row) |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import orjson

from refold.codecs.avro import read_one
from refold.codecs.base import BadRecord, json_object
from refold.codecs.jsonl import _json_event_time
from refold.codecs.schemas import check_row_types, load_raw_schema, parse_row_schema
from refold.errors import ConfigError
from refold.model.changelog import SYSTEM_COLUMNS
from refold.model.reasons import Reason

_DROPPED = ("offset", "system_time")  # output system columns: dropped on input, as in `jsonl`


class UpsertRecord(NamedTuple):
    key: tuple[Any, ...]  # the message-key columns' values
    row: dict[str, Any] | None  # None: a tombstone
    event_time: int | None  # the row's `event_time`, if it has one


class UpsertDecoder:
    """Key and value of one upsert record (see the module's docstring)."""

    def __init__(self, columns: Sequence[str], read_row: Callable[[bytes], dict[str, Any]]) -> None:
        self.columns = tuple(columns)
        self._read_row = read_row

    def decode(self, key: bytes | None, value: bytes | None) -> UpsertRecord:
        values = self.key_of(key)
        if value is None:
            return UpsertRecord(values, None, None)
        row = self._read_row(value)
        event_time = row.pop("event_time", None)
        if event_time is not None and type(event_time) is not int:
            event_time = _json_event_time(event_time)
        for column in _DROPPED:
            row.pop(column, None)
        for column, key_value in zip(self.columns, values, strict=True):
            present = row.get(column, None)
            if present is None and column not in row:
                row[column] = key_value  # a row without its key columns (Flink's EXCEPT_KEY)
            elif present != key_value or type(present) is not type(key_value):
                raise BadRecord(Reason.KEY_MISMATCH, f"the row's {column!r} differs from the message key's")
        return UpsertRecord(values, row, event_time)

    def key_of(self, key: bytes | None) -> tuple[Any, ...]:
        """The message-key columns' values of a record key. Raises BadRecord."""
        if key is None:
            raise BadRecord(Reason.NULL_KEY, "an upsert record needs its key")
        try:
            parsed = orjson.loads(key)
        except orjson.JSONDecodeError as exc:
            raise BadRecord(Reason.KEY_MISMATCH, f"the key is not JSON: {exc}") from exc
        if type(parsed) is not dict or any(column not in parsed for column in self.columns):
            raise BadRecord(Reason.KEY_MISMATCH, f"the key is not a JSON object of {list(self.columns)}")
        return tuple(parsed[column] for column in self.columns)


def json_row(value: bytes) -> dict[str, Any]:
    """A row as a JSON object (no `op`: that would be a changelog event). Raises BadRecord."""
    row = json_object(value)
    if row is None:
        raise BadRecord(Reason.UNDECODABLE, "not a JSON object but JSON null (a tombstone is a null value)")
    if "op" in row:
        raise BadRecord(Reason.SCHEMA_MISMATCH, "a row with an op: an upsert source's values are rows "
                                                "(form: changelog reads changelog events)")
    return row


class AvroRow:
    """Rows as schemaless Avro records of one row schema (no `op`). Raises ConfigError
    for an unusable schema."""

    def __init__(self, schema_path: str) -> None:
        raw = load_raw_schema(schema_path)
        self.name = str(raw.get("name", "?"))
        for field in raw.get("fields", []):
            if field.get("name") in SYSTEM_COLUMNS - {"event_time"}:
                raise ConfigError(f"row field {field.get('name')!r} is a system column name: an upsert "
                                  "source's schema is the row's, without op", where=self.name)
            check_row_types(field.get("type"), f"{self.name}.{field.get('name')}")
        self._schema = parse_row_schema(raw, self.name)

    def __call__(self, value: bytes) -> dict[str, Any]:
        return read_one(value, self._schema, None, f"an Avro {self.name} record")


def upsert_decoder(format: str, schema_path: str | None, columns: Sequence[str]) -> UpsertDecoder:
    """The decoder of an upsert source in `format` (`jsonl`, or `avro` with the row's
    schema), keyed by `columns`. Raises ConfigError."""
    if format == "jsonl":
        return UpsertDecoder(columns, json_row)
    if format == "avro":
        if schema_path is None:
            raise ConfigError("form upsert with format avro needs schema: the row's .avsc", where="source")
        return UpsertDecoder(columns, AvroRow(schema_path))
    raise ConfigError(f"form upsert reads jsonl or avro, not {format!r}", where="source")
