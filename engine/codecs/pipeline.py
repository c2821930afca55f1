"""What the bytes of a pipeline's input and outputs are.

**Input**: a `SourceDecoder` (`refold.codecs.base`) turns each record value into
its changelog events — one for `jsonl` and `avro` (a `Codec`, `codec_for`), zero,
one or two for `debezium-json` (a tombstone gives none, an update a `-C`/`+C`
pair) — or into a RecordError for the dead-letter topic. With a
`schema_registry`, `avro` values are in the Confluent wire format
(`refold.codecs.registry`).

**Outputs**: a `RowEncoder` writes a view or delta row, with its `op` for the
changelog and retract forms: a JSON object (the default) or, with `format:
avro`, an Avro record of the output's row schema (the engine adds `op` and
`event_time` to it for those forms, as `refold.codecs.with_system_fields`) —
schemaless, or in the wire format with a registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from io import BytesIO
from typing import Any, Protocol

from fastavro import schemaless_writer

from refold.codecs.avro import AvroCodec
from refold.codecs.base import Codec, SourceDecoder
from refold.codecs.debezium import DebeziumJsonDecoder
from refold.codecs.jsonl import JsonlCodec
from refold.codecs.registry import RegistryAvroDecoder, frame, register, registry_client
from refold.codecs.schemas import load_raw_schema, parse_row_schema, with_system_fields
from refold.config import Pipeline
from refold.errors import ConfigError
from refold.model import jsonbytes
from refold.model.changelog import ChangelogEvent, Op


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


class OneEventPerRecord(SourceDecoder):
    """The engine's decoder of a `jsonl` or `avro` source: a `Codec`, one event per
    record. (A Codec is a SourceDecoder already; this names the choice.)"""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    @property
    def _events_of(self) -> Callable[[bytes | None], list[ChangelogEvent]]:
        # The codec's own method, looked up once per `decode_records`: a wrapping
        # method would cost one more Python call per record.
        return self.codec._events_of


def source_decoder(pipeline: Pipeline) -> SourceDecoder:
    """The decoder of the pipeline's `source.format`. Raises ConfigError."""
    source = pipeline.source
    if source.format == "debezium-json":
        return DebeziumJsonDecoder()
    if source.format == "avro" and pipeline.schema_registry is not None:
        return RegistryAvroDecoder(registry_client(pipeline.schema_registry), source.schema_path)
    return OneEventPerRecord(codec_for(source.format, source.schema_path))


# Outputs ---------------------------------------------------------------------------------


class RowEncoder(Protocol):
    def encode(self, row: Mapping[str, Any], op: Op | None = None) -> bytes:
        """The record value of an output row; `op` for the changelog/retract forms.
        Raises ConfigError when the row does not fit the output's schema."""
        ...


class JsonRows:
    """`{"op": "+A", ...row}` (or the bare row without an op), as JSON."""

    def encode(self, row: Mapping[str, Any], op: Op | None = None) -> bytes:
        if op is None:
            return jsonbytes.dumps(row)
        return jsonbytes.dumps({"op": op.code, **row})


class AvroRows:
    """Avro records of `schema` (with `op` for the forms that have one); in the
    wire format when `schema_id` is set."""

    def __init__(self, schema: dict[str, Any], topic: str, schema_id: int | None) -> None:
        self.topic = topic
        self.schema_id = schema_id
        self._parsed = parse_row_schema(schema, topic)
        self._prefix = b"" if schema_id is None else frame(schema_id, b"")

    def encode(self, row: Mapping[str, Any], op: Op | None = None) -> bytes:
        record = dict(row)
        if op is not None:
            record["op"] = int(op)
            record["event_time"] = None
        stream = BytesIO()
        stream.write(self._prefix)
        try:
            schemaless_writer(stream, self._parsed, record, strict_allow_default=True)
        except Exception as exc:  # fastavro raises ValueError, TypeError, struct.error...
            raise ConfigError(f"a row does not fit the output schema: {exc}", where=self.topic) from exc
        return stream.getvalue()


def output_encoders(pipeline: Pipeline) -> tuple[RowEncoder, RowEncoder]:
    """The encoders of the view and the delta output (JSON when not configured).
    Registers Avro output schemas with the registry, if any (PrerequisiteError)."""
    view, delta = pipeline.outputs.view, pipeline.outputs.delta
    view_rows: RowEncoder = JsonRows()
    delta_rows: RowEncoder = JsonRows()
    if view is not None and view.format == "avro":
        assert view.schema_path is not None
        raw = load_raw_schema(view.schema_path)
        schema = raw if view.form == "upsert" else with_system_fields(raw)
        view_rows = _avro_rows(pipeline, schema, view.topic)
    if delta is not None and delta.format == "avro":
        assert delta.schema_path is not None
        delta_rows = _avro_rows(pipeline, load_raw_schema(delta.schema_path), delta.topic)
    return view_rows, delta_rows


def _avro_rows(pipeline: Pipeline, schema: dict[str, Any], topic: str) -> AvroRows:
    schema_id = None
    if pipeline.schema_registry is not None:
        schema_id = register(registry_client(pipeline.schema_registry), f"{topic}-value", schema)
    return AvroRows(schema, topic, schema_id)
