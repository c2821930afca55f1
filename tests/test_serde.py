"""Event codecs (JSON lines, Avro), the Avro schemas and the engine's own records."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import fastavro
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refold.codecs import (
    AvroCodec,
    JsonlCodec,
    check_system_fields,
    codec_for,
    event_time_from_iso,
    load_raw_schema,
    load_schema,
    schema_dir,
    with_system_fields,
)
from refold.codecs.schemas import schema_path
from refold.errors import (
    ConfigError,
    DecodeError,
    InternalError,
    InvalidEventError,
    RecordError,
    RecordSource,
)
from refold.model.changelog import ChangelogEvent, Op
from refold.recovery.records import (
    Checkpoint,
    DeadLetter,
    PendingRecord,
    dead_letter_headers,
    decode_checkpoint,
    decode_dead_letter,
    encode_checkpoint,
    encode_dead_letter,
)

SOURCE = RecordSource("scores", 2, 41)
ROW_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Score",
    "namespace": "demo",
    "fields": [
        {"name": "player_name", "type": "string"},
        {"name": "score", "type": "long"},
        {"name": "bonus", "type": ["null", "double"], "default": None},
        {"name": "played", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
}
EVENTS = [
    ChangelogEvent(Op.APPEND, {"player_name": "Al", "score": 1, "bonus": None, "played": 5, "tags": []}, 1_000),
    ChangelogEvent(Op.RETRACT, {"player_name": "Al", "score": 1, "bonus": 2.5, "played": 5, "tags": ["x"]}, None),
    ChangelogEvent(Op.CORRECT_FROM, {"player_name": "Bo", "score": -3, "bonus": 0.0, "played": 0, "tags": []}, 0),
    ChangelogEvent(Op.CORRECT_TO, {"player_name": "Bo", "score": 2**62, "bonus": None, "played": -1, "tags": []}, -5),
]


@pytest.fixture(scope="module")
def avro() -> AvroCodec:
    return AvroCodec(with_system_fields(ROW_SCHEMA))


def assert_keeps_facts(error: RecordError, value: bytes | None, reason: str, kind: type[RecordError]) -> None:
    assert type(error) is kind
    assert error.reason == reason
    assert error.value == value
    assert error.source == SOURCE
    assert (error.source.topic, error.source.partition, error.source.offset) == ("scores", 2, 41)
    assert "scores[2]@41" in str(error)


# Schemas ---------------------------------------------------------------------------


def test_schema_dir_is_the_repository_schemas() -> None:
    assert schema_dir() == Path(__file__).resolve().parent.parent / "schemas" / "avro"
    assert (schema_dir() / "checkpoint.avsc").is_file()


@pytest.mark.parametrize("name", ["event_system", "checkpoint", "deadletter"])
def test_own_schemas_parse_by_name_and_path(name: str) -> None:
    parsed = load_schema(name)
    assert parsed["type"] == "record"
    assert load_schema(f"{name}.avsc") is parsed  # cached
    assert load_schema(schema_dir() / f"{name}.avsc") is parsed
    assert load_raw_schema(name)["doc"]


def test_load_schema_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_schema(tmp_path / "missing.avsc")
    bad = tmp_path / "bad.avsc"
    bad.write_text('{"type": "record", "name": "X", "fields": [{"name": "a", "type": "nope"}]}')
    with pytest.raises(ConfigError, match="not a valid Avro schema"):
        load_schema(bad)
    with pytest.raises(ConfigError, match="not JSON"):
        AvroCodec(_write(tmp_path / "nojson.avsc", "{"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_event_system_schema_is_a_valid_event_schema() -> None:
    codec = AvroCodec(load_raw_schema("event_system"))
    event = ChangelogEvent(Op.CORRECT_TO, {}, 1_700_000_000_123)
    assert codec.decode(codec.encode(event), SOURCE) == event
    check_system_fields(load_raw_schema("event_system"))


def test_with_system_fields() -> None:
    full = with_system_fields(ROW_SCHEMA)
    assert [f["name"] for f in full["fields"]] == ["op", "event_time", "player_name", "score", "bonus", "played", "tags"]
    assert full["name"] == "Score" and full["namespace"] == "demo"
    assert len(ROW_SCHEMA["fields"]) == 5  # input untouched
    check_system_fields(full)
    with pytest.raises(ConfigError, match="'op' is a system column"):
        with_system_fields(full)
    with pytest.raises(ConfigError, match="must be an Avro record"):
        with_system_fields({"type": "string"})


def _schema(*fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "E", "fields": list(fields)}


OP = {"name": "op", "type": "int"}


@pytest.mark.parametrize(
    "event_time",
    [
        "long",
        {"type": "long"},
        {"type": "long", "logicalType": "timestamp-millis"},
        ["null", "long"],
        [{"type": "long", "logicalType": "timestamp-millis"}, "null"],
    ],
)
def test_check_system_fields_accepts(event_time: Any) -> None:
    check_system_fields(_schema(OP, {"name": "event_time", "type": event_time}))
    check_system_fields(_schema({"name": "op", "type": {"type": "int"}}))


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (_schema({"name": "x", "type": "int"}), "no field 'op'"),
        (_schema({"name": "op", "type": "string"}), "'op' must be an Avro int"),
        (_schema({"name": "op", "type": ["null", "int"]}), "'op' must be an Avro int"),
        (_schema(OP, {"name": "event_time", "type": "int"}), "'event_time' must be a long"),
        (_schema(OP, {"name": "event_time", "type": "string"}), "'event_time' must be a long"),
        (_schema(OP, {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-micros"}}),
         "'event_time' must be a long"),
        (_schema(OP, {"name": "event_time", "type": ["null", "long", "string"]}), "'event_time' must be a long"),
        (_schema(OP, {"name": "offset", "type": "long"}), "'offset' is a system column"),
        (_schema(OP, {"name": "system_time", "type": "long"}), "'system_time' is a system column"),
        ({"type": "enum", "name": "E", "symbols": ["a"]}, "must be an Avro record"),
    ],
)
def test_check_system_fields_rejects(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as failure:
        check_system_fields(schema)
    assert failure.value.where == "E"
    with pytest.raises(ConfigError, match=message):
        AvroCodec(schema)


@pytest.mark.parametrize(
    "kind",
    [
        "bytes",
        {"type": "fixed", "name": "F", "size": 4},
        {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 2},
        ["null", "bytes"],
        {"type": "array", "items": "bytes"},
        {"type": "map", "values": {"type": "record", "name": "In", "fields": [{"name": "b", "type": "bytes"}]}},
    ],
)
def test_avro_rows_may_not_hold_bytes(kind: Any) -> None:
    with pytest.raises(ConfigError, match="not supported: rows are JSON values"):
        AvroCodec(_schema(OP, {"name": "blob", "type": kind}))


def test_avro_codec_reads_a_schema_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "event.avsc", orjson.dumps(with_system_fields(ROW_SCHEMA)).decode())
    for codec in (AvroCodec(path), AvroCodec(str(path)), codec_for("avro", str(path))):
        assert isinstance(codec, AvroCodec)
        assert codec.decode(codec.encode(EVENTS[0]), SOURCE) == EVENTS[0]


# JSON lines ----------------------------------------------------------------------


@pytest.mark.parametrize("event", EVENTS)
def test_jsonl_round_trip(event: ChangelogEvent) -> None:
    codec = JsonlCodec()
    value = codec.encode(event)
    assert orjson.loads(value)["op"] == event.op.code
    assert next(iter(orjson.loads(value))) == "op"
    assert codec.decode(value, SOURCE) == event


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"op": 0, "k": "a"}', ChangelogEvent(Op.APPEND, {"k": "a"})),
        (b'{"op": "3", "k": "a"}', ChangelogEvent(Op.CORRECT_TO, {"k": "a"})),
        (b'{"k": "a", "op": "-R", "event_time": null}', ChangelogEvent(Op.RETRACT, {"k": "a"})),
        (b'{"op": "-C", "event_time": 17, "offset": 3, "system_time": 4, "k": null}',
         ChangelogEvent(Op.CORRECT_FROM, {"k": None}, 17)),
        (b'{"op": "+A", "event_time": "2023-11-14T22:13:20.123Z"}', ChangelogEvent(Op.APPEND, {}, 1_700_000_000_123)),
        (b'{"op": "+A", "event_time": "2023-11-14T23:13:20.123456+01:00"}',
         ChangelogEvent(Op.APPEND, {}, 1_700_000_000_123)),
        (b'{"op": "+A", "event_time": "1970-01-01T00:00:01"}', ChangelogEvent(Op.APPEND, {}, 1_000)),
    ],
)
def test_jsonl_decode_variants(value: bytes, expected: ChangelogEvent) -> None:
    assert JsonlCodec().decode(value, SOURCE) == expected


def test_event_time_from_iso_floors_to_the_millisecond() -> None:
    assert event_time_from_iso("1970-01-01T00:00:00.0009Z") == 0
    assert event_time_from_iso("1969-12-31T23:59:59.9995Z") == -1
    assert event_time_from_iso("2024-02-29") == 1_709_164_800_000


@pytest.mark.parametrize(
    ("value", "reason", "kind"),
    [
        (None, "undecodable", DecodeError),
        (b"", "undecodable", DecodeError),
        (b"\x00\xffnot json", "undecodable", DecodeError),
        (b'{"op": "+A"', "undecodable", DecodeError),
        (b"[1, 2]", "undecodable", DecodeError),
        (b'"+A"', "undecodable", DecodeError),
        (b"null", "undecodable", DecodeError),
        (b'{"op": 1e400}', "undecodable", DecodeError),
        (b'{"k": "a"}', "schema mismatch", DecodeError),
        (b'{"op": "+A", "event_time": "yesterday"}', "schema mismatch", DecodeError),
        (b'{"op": "+A", "event_time": 1.5}', "schema mismatch", DecodeError),
        (b'{"op": "+A", "event_time": true}', "schema mismatch", DecodeError),
        (b'{"op": 7}', "op out of range", InvalidEventError),
        (b'{"op": -1}', "op out of range", InvalidEventError),
        (b'{"op": "+X"}', "op out of range", InvalidEventError),
        (b'{"op": true}', "op out of range", InvalidEventError),
        (b'{"op": 1.0}', "op out of range", InvalidEventError),
        (b'{"op": null}', "op out of range", InvalidEventError),
        (b'{"op": ["+A"]}', "op out of range", InvalidEventError),
    ],
)
def test_jsonl_decode_failures_keep_their_facts(value: bytes | None, reason: str, kind: type[RecordError]) -> None:
    codec = JsonlCodec()
    with pytest.raises(RecordError) as failure:
        codec.decode(value, SOURCE)
    assert_keeps_facts(failure.value, value, reason, kind)
    # decode_many returns the same error in place and goes on.
    good = b'{"op": "+A", "k": 1}'
    out = codec.decode_many([good, value, good], [40, 41, 42], topic="scores", partition=2)
    assert out[0] == out[2] == ChangelogEvent(Op.APPEND, {"k": 1})
    assert isinstance(out[1], RecordError)
    assert_keeps_facts(out[1], value, reason, kind)
    assert out[1].detail == failure.value.detail


def test_jsonl_undecodable_chains_the_parser_error() -> None:
    with pytest.raises(DecodeError) as failure:
        JsonlCodec().decode(b"{", SOURCE)
    assert isinstance(failure.value.__cause__, orjson.JSONDecodeError)
    assert failure.value.detail is not None and failure.value.detail.startswith("not JSON")


def test_jsonl_encode_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="system columns"):
        JsonlCodec().encode(ChangelogEvent(Op.APPEND, {"op": 1}))
    with pytest.raises(ValueError, match="not JSON"):
        JsonlCodec().encode(ChangelogEvent(Op.APPEND, {"b": b"raw"}))


def test_decode_many_without_offsets_uses_indexes() -> None:
    out = JsonlCodec().decode_many([b"{}", None])
    assert [type(e) for e in out] == [DecodeError, DecodeError]
    assert [e.source.offset for e in out if isinstance(e, RecordError)] == [0, 1]


# Avro --------------------------------------------------------------------------------


@pytest.mark.parametrize("event", EVENTS)
def test_avro_round_trip(avro: AvroCodec, event: ChangelogEvent) -> None:
    value = avro.encode(event)
    assert avro.decode(value, SOURCE) == event
    # Standard readers see the logical types: op is an int, event_time a UTC datetime.
    record = fastavro.schemaless_reader(io.BytesIO(value), fastavro.parse_schema(with_system_fields(ROW_SCHEMA)))
    assert isinstance(record, dict) and record["op"] == int(event.op)
    if event.event_time is not None:
        assert int(record["event_time"].timestamp() * 1000) == event.event_time


def test_avro_reads_values_written_with_datetimes(avro: AvroCodec) -> None:
    from datetime import UTC, datetime

    schema = fastavro.parse_schema(with_system_fields(ROW_SCHEMA))
    stream = io.BytesIO()
    moment = datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    fastavro.schemaless_writer(
        stream, schema,
        {"op": 3, "event_time": moment, "player_name": "Al", "score": 1, "bonus": None, "played": moment, "tags": []},
    )
    event = avro.decode(stream.getvalue(), SOURCE)
    assert event == ChangelogEvent(
        Op.CORRECT_TO,
        {"player_name": "Al", "score": 1, "bonus": None, "played": 1_700_000_000_123, "tags": []},
        1_700_000_000_123,
    )


def test_avro_without_event_time_drops_it() -> None:
    codec = AvroCodec(_schema(OP, {"name": "k", "type": "string"}))
    assert codec.decode(codec.encode(ChangelogEvent(Op.RETRACT, {"k": "a"}, 99)), SOURCE) == ChangelogEvent(
        Op.RETRACT, {"k": "a"}, None
    )


def _op_value(op: int) -> bytes:
    stream = io.BytesIO()
    fastavro.schemaless_writer(stream, fastavro.parse_schema(_schema(OP, {"name": "k", "type": "string"})),
                               {"op": op, "k": "a"})
    return stream.getvalue()


@pytest.mark.parametrize(
    ("value", "reason", "kind"),
    [
        (None, "undecodable", DecodeError),
        (b"", "undecodable", DecodeError),
        (_op_value(0)[:-1], "undecodable", DecodeError),
        (_op_value(0) + b"\x00", "undecodable", DecodeError),
        (b"\x00\xffnot avro at all", "undecodable", DecodeError),
        (b"\x00\x08\xff\xfe\xfd\xfc", "undecodable", DecodeError),  # not UTF-8
        (_op_value(4), "op out of range", InvalidEventError),
        (_op_value(-1), "op out of range", InvalidEventError),
        (_op_value(2**40), "op out of range", InvalidEventError),
    ],
)
def test_avro_decode_failures_keep_their_facts(value: bytes | None, reason: str, kind: type[RecordError]) -> None:
    codec = AvroCodec(_schema(OP, {"name": "k", "type": "string"}))
    with pytest.raises(RecordError) as failure:
        codec.decode(value, SOURCE)
    assert_keeps_facts(failure.value, value, reason, kind)
    good = _op_value(1)
    out = codec.decode_many([good, value, good], [40, 41, 42], topic="scores", partition=2)
    assert out[0] == out[2] == ChangelogEvent(Op.RETRACT, {"k": "a"})
    assert isinstance(out[1], RecordError)
    assert_keeps_facts(out[1], value, reason, kind)


@pytest.mark.parametrize("format", ["jsonl", "avro"])
def test_a_codec_is_a_source_decoder_of_one_event_per_record(format: str) -> None:
    codec = JsonlCodec() if format == "jsonl" else AvroCodec(_schema(OP, {"name": "k", "type": "string"}))
    event = ChangelogEvent(Op.RETRACT, {"k": "a"})
    values = [codec.encode(event), None, b"\x00\xff", codec.encode(event)]
    out = codec.decode_records(values, [40, 41, 42, 43], topic="scores", partition=2)
    assert out[0] == out[3] == [event]
    for index in (1, 2):
        error = out[index]
        assert isinstance(error, DecodeError) and error.reason == "undecodable"
        assert error.source == RecordSource("scores", 2, 40 + index) and error.value == values[index]
    assert isinstance(out[2], RecordError) and out[2].__cause__ is not None  # the parser's error
    many = codec.decode_many(values, [40, 41, 42, 43], topic="scores", partition=2)
    assert many[0] == many[3] == event
    assert [(type(e), e.source, e.detail) for e in many[1:3] if isinstance(e, RecordError)] == [
        (type(e), e.source, e.detail) for e in out[1:3] if isinstance(e, RecordError)
    ]


def test_avro_encode_rejects_what_does_not_fit(avro: AvroCodec) -> None:
    row = dict(EVENTS[0].row)
    with pytest.raises(ValueError, match="does not fit"):
        avro.encode(ChangelogEvent(Op.APPEND, {**row, "extra": 1}))
    with pytest.raises(ValueError, match="does not fit"):
        avro.encode(ChangelogEvent(Op.APPEND, {k: v for k, v in row.items() if k != "score"}))
    with pytest.raises(ValueError, match="does not fit"):
        avro.encode(ChangelogEvent(Op.APPEND, {**row, "score": "high"}))
    with pytest.raises(ValueError, match="system columns"):
        avro.encode(ChangelogEvent(Op.APPEND, {**row, "event_time": 1}))
    required = AvroCodec(_schema(OP, {"name": "event_time", "type": "long"}))
    with pytest.raises(ValueError, match="does not fit"):
        required.encode(ChangelogEvent(Op.APPEND, {}, None))


def test_avro_missing_defaulted_field_is_filled(avro: AvroCodec) -> None:
    row = {k: v for k, v in EVENTS[0].row.items() if k != "bonus"}
    assert avro.decode(avro.encode(ChangelogEvent(Op.APPEND, row)), SOURCE).row == {**row, "bonus": None}


def test_codec_for() -> None:
    assert isinstance(codec_for("jsonl", None), JsonlCodec)
    with pytest.raises(ConfigError, match="needs schema"):
        codec_for("avro", None)
    with pytest.raises(ConfigError, match="unknown format 'csv'"):
        codec_for("csv", None)
    with pytest.raises(ConfigError, match="cannot read"):
        codec_for("avro", "/nonexistent/event.avsc")


# Records -----------------------------------------------------------------------------

CHECKPOINT = Checkpoint(
    pipeline="scores",
    writer="w0",
    batch=12,
    source_topic="match_scores",
    offsets={2: 40, 0: 17, 1: 2**40},
    pending={1: PendingRecord(2**40 - 1, b'{"k":1}', b'{"op":"-C"}', 1_700_000_000_000), 0: PendingRecord(16, None, b"", 0)},
    records_in=100,
    records_out=80,
    dlq=3,
    committed_at=1_700_000_000_999,
    driver_checkpoints={"postgres": b"\x00\x01", "parquet": b""},
)


def test_checkpoint_round_trip_and_deterministic_bytes() -> None:
    data = encode_checkpoint(CHECKPOINT)
    assert decode_checkpoint(data) == CHECKPOINT
    reordered = Checkpoint(**{
        **{f: getattr(CHECKPOINT, f) for f in Checkpoint.__dataclass_fields__},
        "offsets": dict(sorted(CHECKPOINT.offsets.items())),
        "pending": dict(sorted(CHECKPOINT.pending.items())),
        "driver_checkpoints": dict(sorted(CHECKPOINT.driver_checkpoints.items())),
    })
    assert encode_checkpoint(reordered) == data
    # Any Avro reader can read it with the schema file.
    record = fastavro.schemaless_reader(io.BytesIO(data), load_schema("checkpoint"))
    assert isinstance(record, dict) and record["offsets"][0] == {"partition": 0, "offset": 17}


@pytest.mark.parametrize("missing", [(), ("view_partitioning",), ("view_partitioning", "run"),
                                     ("view_partitioning", "run", "shard")])
def test_checkpoints_written_before_a_field_existed_read_with_its_default(missing: tuple[str, ...]) -> None:
    """Each field added since the first checkpoints: a record written without it reads as
    its schema default (a shard that wrote the view by key, run 0, shard 0)."""
    written = replace(CHECKPOINT, shard=3, run=17, view_partitioning="shard")
    raw = orjson.loads(schema_path("checkpoint").read_bytes())
    raw["fields"] = [f for f in raw["fields"] if f["name"] not in missing]
    old = fastavro.parse_schema(raw, named_schemas={})
    record = {**fastavro.schemaless_reader(io.BytesIO(encode_checkpoint(written)), load_schema("checkpoint"))}
    stream = io.BytesIO()
    fastavro.schemaless_writer(stream, old, {k: v for k, v in record.items() if k not in missing})
    defaults = {"view_partitioning": "key", "run": 0, "shard": 0}
    assert decode_checkpoint(stream.getvalue()) == replace(written, **{f: defaults[f] for f in missing})


def test_empty_checkpoint_round_trip() -> None:
    empty = Checkpoint("p", "w", 0, "t", {}, {}, 0, 0, 0, 0, {})
    assert decode_checkpoint(encode_checkpoint(empty)) == empty


LETTER = DeadLetter(
    reason="undecodable",
    detail="not JSON: unexpected character",
    topic="match_scores",
    partition=2,
    offset=41,
    timestamp=1_700_000_000_000,
    key=b"k",
    value=b"\x00\xffnot json",
    pipeline="scores",
)


@pytest.mark.parametrize(
    "letter",
    [LETTER, DeadLetter("not live", None, "t", 0, 0, None, None, None, "p")],
)
def test_dead_letter_round_trip(letter: DeadLetter) -> None:
    assert decode_dead_letter(encode_dead_letter(letter)) == letter


def test_dead_letter_headers() -> None:
    assert dead_letter_headers(LETTER) == [
        ("refold.reason", b"undecodable"),
        ("refold.detail", b"not JSON: unexpected character"),
        ("refold.topic", b"match_scores"),
        ("refold.partition", b"2"),
        ("refold.offset", b"41"),
        ("refold.pipeline", b"scores"),
    ]
    bare = DeadLetter("op out of range", None, "t", 0, 7, None, None, None, "p")
    assert [name for name, _ in dead_letter_headers(bare)] == [
        "refold.reason", "refold.topic", "refold.partition", "refold.offset", "refold.pipeline",
    ]


@pytest.mark.parametrize("data", [b"", b"\x02", encode_dead_letter(LETTER) + b"\x00"])
def test_decoding_a_broken_record_is_an_internal_error(data: bytes) -> None:
    with pytest.raises(InternalError):
        decode_checkpoint(data)
    with pytest.raises(InternalError):
        decode_dead_letter(data)


_longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.dictionaries(_ints, _longs, max_size=4),
    pending=st.dictionaries(
        _ints,
        st.builds(PendingRecord, _longs, st.none() | st.binary(max_size=8), st.binary(max_size=8), _longs),
        max_size=3,
    ),
    drivers=st.dictionaries(st.text(max_size=5), st.binary(max_size=8), max_size=3),
    text=st.text(max_size=10),
    counts=st.tuples(_longs, _longs, _longs, _longs, _longs),
)
def test_checkpoint_round_trip_property(
    offsets: dict[int, int],
    pending: dict[int, PendingRecord],
    drivers: dict[str, bytes],
    text: str,
    counts: tuple[int, int, int, int, int],
) -> None:
    checkpoint = Checkpoint(text, text, counts[0], text, offsets, pending, *counts[1:], drivers)
    assert decode_checkpoint(encode_checkpoint(checkpoint)) == checkpoint


_json_values = st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=5)


@settings(max_examples=100, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    row=st.dictionaries(st.text(max_size=4).filter(lambda s: s not in {"op", "event_time", "offset", "system_time"}),
                        _json_values | st.floats(allow_nan=False, allow_infinity=False), max_size=4),
    event_time=st.none() | _longs,
)
def test_jsonl_round_trip_property(op: Op, row: dict[str, Any], event_time: int | None) -> None:
    event = ChangelogEvent(op, row, event_time)
    assert JsonlCodec().decode(JsonlCodec().encode(event), SOURCE) == event
