"""Bytes in and out: JSON lines, schemaless Avro, the Confluent wire format, Debezium.

The contract: a source decoder turns a record's value into changelog events or a
`RecordError` (never raises for bad bytes: the record is dead-lettered with its
reason); an output encoder turns a row into bytes. `source_decoder(pipeline)` and
`output_encoders(pipeline)` pick them for a pipeline. The Avro schemas Refold owns
are the package data `refold.schemas` (`load_schema("checkpoint")`).

Modules: `base` (the Codec and SourceDecoder contracts, the bad-record exception,
the one decode loop, the reasons table), `schemas` (Avro schema files, system
fields, checks), `jsonl` and `avro` (the two codecs), `debezium` and `registry`
(the other source decoders; `registry` also the wire format), `pipeline` (which
decoder and encoders a pipeline uses).
"""

from refold.codecs.avro import AvroCodec
from refold.codecs.base import Codec, SourceDecoder
from refold.codecs.debezium import DebeziumJsonDecoder
from refold.codecs.jsonl import JsonlCodec, event_time_from_iso
from refold.codecs.pipeline import (
    JsonRows,
    OneEventPerRecord,
    codec_for,
    output_encoders,
    source_decoder,
)
from refold.codecs.registry import RegistryAvroDecoder, frame, registry_client, unframe
from refold.codecs.schemas import (
    check_system_fields,
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
    "SourceDecoder",
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
