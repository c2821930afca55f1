"""The Confluent Schema Registry wire format for Avro values.

A value is the magic byte `0`, the writer schema's id (4 bytes, big-endian), then
the schemaless Avro binary of one record — what confluent-kafka's
`AvroSerializer` writes and its `AvroDeserializer` (and every Kafka tool that
speaks the registry) reads. Refold writes its Avro outputs in this format when
the pipeline names a `schema_registry`, registering each output's schema under
`<topic>-value` (TopicNameStrategy), and reads `format: avro` sources in it,
fetching each writer schema by id (once, then cached).

Without a registry (the default), Avro values are schemaless and producer and
consumer share the schema file (`refold.codecs.serde.AvroCodec`).

The client is confluent-kafka's `SchemaRegistryClient`, one per registry per
process; a `mock://NAME` URL gives its in-process mock (shared per name here, so
a test's deserializer sees the schemas the engine registered).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from io import BytesIO
from typing import Any, Final

import orjson
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import SchemaParseException

from refold.codecs.serde import (
    _strip_logical_types,
    check_system_fields,
    load_raw_schema,
)
from refold.config import SchemaRegistrySpec
from refold.errors import (
    ConfigError,
    DecodeError,
    InvalidEventError,
    PrerequisiteError,
    RecordError,
    RecordSource,
)
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason

MAGIC: Final = 0
HEADER_BYTES: Final = 5

_clients: dict[tuple[str, str | None], SchemaRegistryClient] = {}
_clients_lock = threading.Lock()


def registry_client(spec: SchemaRegistrySpec) -> SchemaRegistryClient:
    """The process's client of this registry (created on first use)."""
    auth = spec.basic_auth_user_info.get_secret_value() if spec.basic_auth_user_info else None
    with _clients_lock:
        client = _clients.get((spec.url, auth))
        if client is None:
            conf: dict[str, Any] = {"url": spec.url}
            if auth is not None:
                conf["basic.auth.user.info"] = auth
            client = SchemaRegistryClient.new_client(conf)  # mock:// gives the in-process mock
            _clients[(spec.url, auth)] = client
        return client


def frame(schema_id: int, payload: bytes) -> bytes:
    """A wire-format value: magic byte, schema id, Avro binary."""
    return bytes((MAGIC,)) + schema_id.to_bytes(4, "big") + payload


def unframe(value: bytes) -> tuple[int, bytes]:
    """(schema id, Avro binary) of a wire-format value. Raises ValueError."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC:
        raise ValueError("not in the schema registry wire format (magic byte 0, 4-byte schema id)")
    return int.from_bytes(value[1:HEADER_BYTES], "big"), value[HEADER_BYTES:]


def register(client: SchemaRegistryClient, subject: str, schema: dict[str, Any]) -> int:
    """Register an Avro schema under `subject` (idempotent); its id. Raises
    PrerequisiteError when the registry cannot be reached or refuses it."""
    try:
        avro = Schema(orjson.dumps(schema).decode(), "AVRO")
        return int(client.register_schema(subject, avro))
    except SchemaRegistryError as exc:
        raise PrerequisiteError(f"schema registry refused the schema of {subject!r}: {exc}") from exc
    except Exception as exc:  # connection errors come from the HTTP client
        raise PrerequisiteError(f"schema registry unreachable while registering {subject!r}: {exc}") from exc


class RegistryAvroDecoder:
    """Source `format: avro` in the wire format: each record's writer schema comes
    from the registry by id; with `reader` (the source's `schema:`), records are
    resolved to it (Avro schema resolution), else read as written.

    A value that is not in the wire format or not one record of its schema, and an
    id the registry does not know, are bad records (`undecodable`). A registry that
    does not answer is not: the batch fails and is retried from Kafka.
    """

    format = "avro"

    def __init__(self, client: SchemaRegistryClient, reader: str | os.PathLike[str] | None = None) -> None:
        self.client = client
        self._reader: Any = None
        if reader is not None:
            raw = load_raw_schema(reader)
            check_system_fields(raw)
            self._reader = parse_row_schema(raw, str(reader))
        self._writers: dict[int, tuple[Any, bool]] = {}  # id → (parsed schema, has event_time)

    def decode_records(
        self,
        values: Sequence[bytes | None],
        offsets: Sequence[int] | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[list[ChangelogEvent] | RecordError]:
        out: list[list[ChangelogEvent] | RecordError] = []
        for index, value in enumerate(values):
            source = RecordSource(topic, partition, offsets[index] if offsets is not None else index)
            try:
                out.append([self._decode(value)])
            except _Bad as bad:
                error = bad.kind(bad.reason, source, detail=bad.detail, value=value)
                error.__cause__ = bad.__cause__
                out.append(error)
        return out

    def _decode(self, value: bytes | None) -> ChangelogEvent:
        if value is None:
            raise _Bad(DecodeError, Reason.UNDECODABLE, "null value (a tombstone)")
        try:
            schema_id, payload = unframe(value)
        except ValueError as exc:
            raise _Bad(DecodeError, Reason.UNDECODABLE, str(exc)) from exc
        writer, has_event_time = self._writers.get(schema_id) or self._writer(schema_id)
        stream = BytesIO(payload)
        try:
            record = schemaless_reader(stream, writer, self._reader)
        except Exception as exc:  # any failure to read means: not one record of this schema
            raise _Bad(DecodeError, Reason.UNDECODABLE, f"not an Avro record of schema id {schema_id}: {exc}") from exc
        if stream.tell() != len(payload):
            raise _Bad(DecodeError, Reason.UNDECODABLE, f"bytes left over after an Avro record of schema id {schema_id}")
        assert isinstance(record, dict)
        op = record.pop("op", None)
        if not isinstance(op, int) or not 0 <= op <= 3:
            raise _Bad(InvalidEventError, Reason.OP_OUT_OF_RANGE, f"op must be 0..3, got {op!r}")
        event_time = record.pop("event_time", None) if has_event_time or self._reader is not None else None
        return ChangelogEvent(Op(op), record, event_time)

    def _writer(self, schema_id: int) -> tuple[Any, bool]:
        try:
            schema = self.client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise _Bad(DecodeError, Reason.UNDECODABLE, f"the registry has no schema id {schema_id}") from exc
            raise PrerequisiteError(f"schema registry: cannot fetch schema id {schema_id}: {exc}") from exc
        if schema.schema_type not in (None, "AVRO"):
            raise _Bad(DecodeError, Reason.UNDECODABLE, f"schema id {schema_id} is {schema.schema_type}, not Avro")
        raw = orjson.loads(schema.schema_str or "null")
        try:
            check_system_fields(raw)
            parsed = parse_row_schema(raw, f"schema id {schema_id}")
        except ConfigError as exc:
            raise _Bad(DecodeError, Reason.UNDECODABLE, str(exc)) from exc
        has_event_time = any(f.get("name") == "event_time" for f in raw.get("fields", []))
        self._writers[schema_id] = (parsed, has_event_time)
        return parsed, has_event_time


class _Bad(Exception):
    def __init__(self, kind: type[RecordError], reason: str, detail: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.detail = detail


def parse_row_schema(raw: Any, where: str) -> Any:
    """A fastavro schema that reads and writes logical types as their primitives
    (rows are JSON values: timestamp-millis stays epoch ms)."""
    try:
        return parse_schema(_strip_logical_types(raw))
    except (ValueError, SchemaParseException) as exc:
        raise ConfigError(f"not a valid Avro schema: {exc}", where=where) from exc
