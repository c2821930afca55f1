"""The Confluent Schema Registry wire format for Avro values.

A value is the magic byte `0`, the writer schema's id (4 bytes, big-endian), then
the schemaless Avro binary of one record — what confluent-kafka's
`AvroSerializer` writes and its `AvroDeserializer` (and every Kafka tool that
speaks the registry) reads. Refold writes its Avro outputs in this format when
the pipeline names a `schema_registry`, registering each output's schema under
`<topic>-value` (TopicNameStrategy), and reads `format: avro` sources in it,
fetching each writer schema by id (once, then cached).

Without a registry (the default), Avro values are schemaless and producer and
consumer share the schema file (`refold.codecs.avro.AvroCodec`).

The client is confluent-kafka's `SchemaRegistryClient`, one per registry per
process; a `mock://NAME` URL gives its in-process mock (shared per name within a
process). The engine registers its output schemas in the Spark tasks, on the
executors' Python workers: a mock there is each worker's own, so a test that reads
with `mock://` registers the same schemas in its own process first.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar, Final

import orjson
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from refold.codecs.avro import AvroEvents
from refold.codecs.base import BadRecord, SourceDecoder
from refold.codecs.schemas import check_system_fields, load_raw_schema, parse_row_schema
from refold.config import SchemaRegistrySpec
from refold.errors import ConfigError, PrerequisiteError
from refold.model.changelog import ChangelogEvent
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


class RegistryAvroDecoder(SourceDecoder):
    """Source `format: avro` in the wire format: each record's writer schema comes
    from the registry by id; with `reader` (the source's `schema:`), records are
    resolved to it (Avro schema resolution), else read as written.

    A value that is not in the wire format or not one record of its schema, and an
    id the registry does not know, are bad records (`undecodable`). A registry that
    does not answer is not: `decode_records` raises PrerequisiteError, the batch
    fails and is retried from Kafka. Each writer schema is fetched once per decoder.
    """

    format: ClassVar[str] = "avro"

    def __init__(self, client: SchemaRegistryClient, reader: str | os.PathLike[str] | None = None) -> None:
        self.client = client
        self._reader: Any = None
        if reader is not None:
            raw = load_raw_schema(reader)
            check_system_fields(raw)
            self._reader = parse_row_schema(raw, str(reader))
        self._writers: dict[int, AvroEvents] = {}  # by writer schema id

    def _events_of(self, value: bytes | None) -> list[ChangelogEvent]:
        if value is None:
            raise BadRecord.tombstone()
        try:
            schema_id, payload = unframe(value)
        except ValueError as exc:
            raise BadRecord(Reason.UNDECODABLE, str(exc)) from exc
        writer = self._writers.get(schema_id) or self._writer(schema_id)
        return writer.read(payload)

    def _writer(self, schema_id: int) -> AvroEvents:
        """Fetch, check and cache a writer schema. Raises BadRecord for an id the
        registry does not know or a schema that is not an Avro event schema,
        PrerequisiteError when the registry does not answer."""
        try:
            schema = self.client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise BadRecord(Reason.UNDECODABLE, f"the registry has no schema id {schema_id}") from exc
            raise PrerequisiteError(f"schema registry: cannot fetch schema id {schema_id}: {exc}") from exc
        if schema.schema_type not in (None, "AVRO"):
            raise BadRecord(Reason.UNDECODABLE, f"schema id {schema_id} is {schema.schema_type}, not Avro")
        raw = orjson.loads(schema.schema_str or "null")
        try:
            check_system_fields(raw)
            parsed = parse_row_schema(raw, f"schema id {schema_id}")
        except ConfigError as exc:
            raise BadRecord(Reason.UNDECODABLE, str(exc)) from exc
        writer = self._writers[schema_id] = AvroEvents(parsed, self._reader, f"an Avro record of schema id {schema_id}")
        return writer
