"""Bytes in and out: JSON lines, schemaless Avro, the Confluent wire format, Debezium.

The contract: a source decoder turns a record's value into changelog events or a
`RecordError` (never raises for bad bytes: the record is dead-lettered with its
reason); an output encoder turns a row into bytes. `source_decoder(pipeline)` and
`output_encoders(pipeline)` pick them for a pipeline. The Avro schemas Refold owns
are the package data `refold.schemas` (`load_schema("checkpoint")`).
"""

from refold.codecs.debezium import DebeziumJsonDecoder
from refold.codecs.pipeline import JsonRows, OneEventPerRecord, output_encoders, source_decoder
from refold.codecs.registry import RegistryAvroDecoder, frame, registry_client, unframe
from refold.codecs.serde import (
    AvroCodec,
    Codec,
    JsonlCodec,
    check_system_fields,
    codec_for,
    event_time_from_iso,
    load_raw_schema,
    load_schema,
    schema_dir,
    with_system_fields,
)

__all__ = [
    "AvroCodec",
    "Codec",
    "DebeziumJsonDecoder",
    "JsonRows",
    "JsonlCodec",
    "OneEventPerRecord",
    "RegistryAvroDecoder",
    "check_system_fields",
    "codec_for",
    "event_time_from_iso",
    "frame",
    "load_raw_schema",
    "load_schema",
    "output_encoders",
    "registry_client",
    "schema_dir",
    "source_decoder",
    "unframe",
    "with_system_fields",
]
