"""The Confluent Schema Registry wire format, checked against confluent-kafka's own
`AvroSerializer`/`AvroDeserializer`.

No schema registry server can run on this machine (no Docker, none on PyPI), so
both sides use confluent-kafka's in-process mock registry (`mock://` URLs); the
wire format itself — magic byte, 4-byte schema id, Avro binary — is the same.
"""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema, schemaless_reader

from refold.codecs import (
    JsonRows,
    RegistryAvroDecoder,
    frame,
    output_encoders,
    registry_client,
    source_decoder,
    unframe,
    with_system_fields,
)
from refold.config import Pipeline, parse_pipeline
from refold.errors import ConfigError, DecodeError, InvalidEventError
from refold.model.changelog import ChangelogEvent, Op

ROW = {
    "type": "record",
    "name": "Total",
    "namespace": "test",
    "fields": [{"name": "player_name", "type": "string"}, {"name": "total", "type": "long"}],
}
SCORE = {
    "type": "record",
    "name": "Score",
    "namespace": "test",
    "fields": [{"name": "player_name", "type": "string"}, {"name": "score", "type": "long"}],
}


def pipeline(tmp_path: Path, *, url: str | None, view: dict[str, Any] | None = None,
             source: dict[str, Any] | None = None) -> Pipeline:
    row = tmp_path / "total.avsc"
    row.write_text(json.dumps(ROW))
    data: dict[str, Any] = {
        "pipeline": "p",
        "source": source or {"topic": "scores"},
        "view": {"key": ["player_name"], "columns": {"total": {"sum": "score"}}},
        "outputs": {
            "view": view or {"topic": "p.view", "format": "avro", "schema": str(row)},
            "delta": {"topic": "p.delta", "format": "avro", "schema": str(row)},
        },
    }
    if url:
        data["schema_registry"] = {"url": url}
    return parse_pipeline(data)


def mock_url() -> str:
    return f"mock://{uuid.uuid4().hex[:8]}"


def test_outputs_are_read_by_confluents_avro_deserializer(tmp_path: Path) -> None:
    url = mock_url()
    p = pipeline(tmp_path, url=url)
    view_rows, delta_rows = output_encoders(p)
    value = view_rows.encode({"player_name": "Alice", "total": 130}, Op.CORRECT_TO)
    assert value[0] == 0  # the magic byte, then the schema id
    client = registry_client(p.schema_registry)  # type: ignore[arg-type]
    registered = client.get_latest_version("p.view-value")
    assert unframe(value)[0] == registered.schema_id
    deserialize = AvroDeserializer(client)
    record = deserialize(value, SerializationContext("p.view", MessageField.VALUE))
    assert record == {"op": 3, "event_time": None, "player_name": "Alice", "total": 130}
    delta = delta_rows.encode({"player_name": "Bob", "total": -5})
    assert deserialize(delta, SerializationContext("p.delta", MessageField.VALUE)) == {"player_name": "Bob", "total": -5}
    assert client.get_latest_version("p.delta-value").schema.schema_str is not None


def test_upsert_form_has_no_op_and_registration_is_idempotent(tmp_path: Path) -> None:
    url = mock_url()
    row = tmp_path / "total.avsc"
    p = pipeline(tmp_path, url=url, view={"topic": "p.view", "form": "upsert", "format": "avro", "schema": str(row)})
    first, _ = output_encoders(p)
    again, _ = output_encoders(p)  # a restart registers the same schema: same id
    value = first.encode({"player_name": "Al", "total": 1})
    assert unframe(value)[0] == unframe(again.encode({"player_name": "Al", "total": 1}))[0]
    record = AvroDeserializer(registry_client(p.schema_registry))(value, SerializationContext("p.view", MessageField.VALUE))  # type: ignore[arg-type]
    assert record == {"player_name": "Al", "total": 1}


def test_without_a_registry_avro_outputs_are_schemaless_and_json_stays_default(tmp_path: Path) -> None:
    p = pipeline(tmp_path, url=None)
    view_rows, _ = output_encoders(p)
    value = view_rows.encode({"player_name": "Alice", "total": 7}, Op.APPEND)
    parsed = parse_schema(with_system_fields(ROW))
    assert schemaless_reader(io.BytesIO(value), parsed, None) == {"op": 0, "event_time": None, "player_name": "Alice", "total": 7}
    plain = parse_pipeline({"pipeline": "q", "source": {"topic": "s"}, "view": {"key": ["k"], "columns": {"n": {"count": "*"}}},
                            "outputs": {"view": {"topic": "v"}, "delta": {"topic": "d"}}})
    view_json, delta_json = output_encoders(plain)
    assert isinstance(view_json, JsonRows) and isinstance(delta_json, JsonRows)
    assert view_json.encode({"k": "a", "n": 1}, Op.CORRECT_FROM) == b'{"op":"-C","k":"a","n":1}'


def test_a_row_that_does_not_fit_the_output_schema_is_a_config_error(tmp_path: Path) -> None:
    view_rows, _ = output_encoders(pipeline(tmp_path, url=mock_url()))
    with pytest.raises(ConfigError, match=r"p\.view: a row does not fit"):
        view_rows.encode({"player_name": "Alice", "total": "lots"}, Op.APPEND)


def test_avro_source_reads_what_confluents_avro_serializer_writes(tmp_path: Path) -> None:
    url = mock_url()
    p = pipeline(tmp_path, url=url, source={"topic": "scores", "format": "avro"})  # no schema: the registry has it
    client = registry_client(p.schema_registry)  # type: ignore[arg-type]
    serialize = AvroSerializer(client, json.dumps(with_system_fields(SCORE)))
    ctx = SerializationContext("scores", MessageField.VALUE)
    good = serialize({"op": 2, "event_time": 1_700_000_000_000, "player_name": "Al", "score": 3}, ctx)
    plain = serialize({"op": 0, "event_time": None, "player_name": "Bo", "score": 4}, ctx)
    bad_op = serialize({"op": 9, "event_time": None, "player_name": "Bo", "score": 4}, ctx)
    decoder = source_decoder(p)
    assert isinstance(decoder, RegistryAvroDecoder)
    schema_id, payload = unframe(good)
    got = decoder.decode_records(
        [good, plain, b"\x01garbage", frame(schema_id + 1000, payload), good[:-1], bad_op, None],
        list(range(7)), topic="scores", partition=0,
    )
    assert got[0] == [ChangelogEvent(Op.CORRECT_FROM, {"player_name": "Al", "score": 3}, 1_700_000_000_000)]
    assert got[1] == [ChangelogEvent(Op.APPEND, {"player_name": "Bo", "score": 4}, None)]
    for index, detail in [(2, "wire format"), (3, "no schema id"), (4, "not an Avro record"), (6, "tombstone")]:
        error = got[index]
        assert isinstance(error, DecodeError) and error.reason == "undecodable", index
        assert detail in (error.detail or ""), (index, error.detail)
        assert error.source.offset == index
    assert isinstance(got[5], InvalidEventError) and got[5].reason == "op out of range"


def test_avro_source_resolves_to_the_reader_schema(tmp_path: Path) -> None:
    url = mock_url()
    reader = tmp_path / "reader.avsc"
    extended = dict(SCORE, fields=[*SCORE["fields"], {"name": "team", "type": "string", "default": "none"}])
    reader.write_text(json.dumps(with_system_fields(extended)))
    p = pipeline(tmp_path, url=url, source={"topic": "scores", "format": "avro", "schema": str(reader)})
    serialize = AvroSerializer(registry_client(p.schema_registry), json.dumps(with_system_fields(SCORE)))  # type: ignore[arg-type]
    value = serialize({"op": 0, "event_time": 5, "player_name": "Al", "score": 3},
                      SerializationContext("scores", MessageField.VALUE))
    (events,) = source_decoder(p).decode_records([value])
    assert events == [ChangelogEvent(Op.APPEND, {"player_name": "Al", "score": 3, "team": "none"}, 5)]


def test_an_incompatible_writer_schema_is_a_schema_mismatch(tmp_path: Path) -> None:
    # a reader schema, and a writer whose `score` became a string: Avro's resolution
    # cannot read it as the reader's long; the record is dead-lettered as a schema
    # mismatch that names the change, not as undecodable bytes
    url = mock_url()
    reader = tmp_path / "reader.avsc"
    reader.write_text(json.dumps(with_system_fields(SCORE)))
    p = pipeline(tmp_path, url=url, source={"topic": "scores", "format": "avro", "schema": str(reader)})
    changed = dict(SCORE, fields=[SCORE["fields"][0], {"name": "score", "type": "string"}])
    serialize = AvroSerializer(registry_client(p.schema_registry), json.dumps(with_system_fields(changed)))  # type: ignore[arg-type]
    value = serialize({"op": 0, "event_time": 5, "player_name": "Al", "score": "three"},
                      SerializationContext("scores", MessageField.VALUE))
    (error,) = source_decoder(p).decode_records([value])
    assert isinstance(error, DecodeError) and error.reason == "schema mismatch"
    assert "incompatible schema change" in (error.detail or "") and "string is not long" in (error.detail or "")


def test_registry_config_is_typed() -> None:
    base = {"pipeline": "p", "source": {"topic": "s", "format": "avro"},
            "view": {"key": ["k"], "columns": {"n": {"count": "*"}}}, "outputs": {"view": {"topic": "v"}}}
    with pytest.raises(ConfigError, match="needs schema"):
        parse_pipeline(base)  # avro without a schema file and without a registry
    with pytest.raises(ConfigError, match=r"schema_registry\.urls: unknown setting"):
        parse_pipeline({**base, "schema_registry": {"url": "http://r:8081", "urls": "x"}})
    with pytest.raises(ConfigError, match=r"schema_registry\.url"):
        parse_pipeline({**base, "schema_registry": {"url": "r:8081"}})
    secret = parse_pipeline({**base, "schema_registry": {"url": "http://r:8081", "basic_auth_user_info": "u:pw"}})
    assert "pw" not in repr(secret)
    with pytest.raises(ConfigError, match=r"outputs\.view: format avro needs schema"):
        parse_pipeline({**base, "source": {"topic": "s"}, "outputs": {"view": {"topic": "v", "format": "avro"}}})
